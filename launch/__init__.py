"""Launch adapters: local (torchrun / ft_launcher), Slurm (sbatch), Kubernetes (PyTorchJob)."""
