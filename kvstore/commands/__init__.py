"""Subcommands of the `kvstore` CLI, one module each (see kvstore/cli.py)."""
