"""What the loop runs on: megatron-core version fixes, the CPU shim, process groups, RNG,
the host's identity, the logging setup, the file queue and the pickle allow-list."""
