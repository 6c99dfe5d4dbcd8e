"""The sidecar's state: the block index, the block store over it, checksums and counters."""
