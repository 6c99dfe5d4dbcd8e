"""The DRAM tier: the shared-memory slab, the space that owns it, staging buffers and copies."""
