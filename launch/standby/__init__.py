"""Pre-imported standby workers: a per-node server that has imported torch, megatron-core and
the trainer forks each worker the launcher starts (``launch.standby=true``)."""
