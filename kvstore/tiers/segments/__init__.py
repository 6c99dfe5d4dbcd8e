"""The SSD's segment layout: the tier, its slot size classes, segment files, logs, records, import."""
