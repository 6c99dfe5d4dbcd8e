"""Counters, latency histograms, the one /stats document and its /metrics rendering."""
