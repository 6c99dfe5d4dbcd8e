"""Process-wide helpers: logging, threads, allocator tuning."""
