"""What every process of a run shares without torch: the run directory's names and JSONL
records, the exit codes and the failure classes behind them."""
