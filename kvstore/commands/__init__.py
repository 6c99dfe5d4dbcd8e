"""Subcommands of the `kvstore` CLI, one module each (see kvstore/cli.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:
    import argparse

    # What ``add_subparsers()`` returns, as each command's ``register`` takes it: argparse gives the
    # class no public name, and it is generic only in typeshed (subscripting it fails at run time).
    Subparsers: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]
