"""Slurm: the sbatch script of a run (``script``), submitting it (``cli``) and following the job
(``manage``: status, logs, cancel)."""
