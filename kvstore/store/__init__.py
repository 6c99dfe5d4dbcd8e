"""The sidecar's store: its request logic over its books.

* :mod:`kvstore.store.books` -- the books: the index, placement (a tier's ``Space``), the DRAM space,
  tenants' quotas, retention and the hint budget, the tiers below as the state layer sees them.
* :mod:`kvstore.store.block_store` -- the state machine (Lookup, Allocate, Commit, Acquire, ...), with
  its checks (``checks``), the DRAM copies' checksums (``sealing``) and the reads that reach the rest of
  the cluster (``cluster_reads``, through ``remote``).
* :mod:`kvstore.store.exchange` -- the cluster's door, held by the cluster as ``door.StoreDoor``.
"""
