"""``python -m drill.equivalence``: the resume-equivalence gate (docs/checkpoints.md,
"Proving a resume exact")."""
