"""Bytes between an engine's KV cache and DRAM slots: the layouts, the copy plan, the engines, kernels."""
