"""Resiliency on top of the training core, in four layers (each imports only those below it):

- ``storage``: the publish protocol on plain files (no torch): layout, manifest, checksums,
  verify, publish, select, retention, the single-writer lease, attempt records.
- ``checkpoint``: the full training state through megatron-core: the checkpointer and its
  writers, staging buffers, restore planning, the topology validator, the node-local tier, and
  the checkpoint hook.
- ``monitor``: hooks that watch a run: ft_launcher sections and learned timeouts, stack
  evidence and post-mortems, stragglers, the post-restore watch, metrics, preemption.
- ``hooks`` (every feature as train-loop hooks, found by the trainer through an entry point)
  and ``cli`` (``python -m resiliency``).
"""
