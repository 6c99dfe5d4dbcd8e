"""kvstore: a KV-cache tier service for LLM inference (HBM -> DRAM -> SSD -> Redis/S3)."""

__version__ = "0.1.0"
