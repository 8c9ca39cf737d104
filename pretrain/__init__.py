"""Pretraining entrypoint and training loop on megatron-core."""
