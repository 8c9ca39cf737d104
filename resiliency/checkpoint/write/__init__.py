"""Writing a step: staging tensors to host memory, the shard writer, the async writer and its
process."""
