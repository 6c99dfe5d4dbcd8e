"""The store's books: index, placement, DRAM space, quotas, retention, hint budget, the tiers below."""
