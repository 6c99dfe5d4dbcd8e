"""Offline simulation: trace loading, replay through the index and policies, Belady's bound."""
