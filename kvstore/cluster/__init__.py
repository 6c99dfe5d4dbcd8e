"""Many sidecars, one cache: the cluster directory (Redis / Redis Cluster), membership leases,
and the peer data path that moves blocks between nodes. See docs/cluster.md."""
