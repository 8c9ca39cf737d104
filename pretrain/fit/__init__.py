"""``python -m pretrain --plan``: the memory fit on the meta device, and the planners' time
formulas (step, save, interval, progress)."""
