"""Benchmarks as ratios to this machine's own limits, measured in the same run.

``python -m bench``."""
