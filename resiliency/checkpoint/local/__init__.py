"""The node-local tier: its store, its listing and replication across nodes (``tier``)."""
