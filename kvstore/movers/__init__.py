"""Between DRAM and the tiers below: Tiering (the facade), a Level per tier, one module per mover."""
