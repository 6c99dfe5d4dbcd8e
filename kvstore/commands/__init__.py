"""Subcommands of the `kvstore` CLI, one module each (see kvstore/cli.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import argparse


class Subparsers(Protocol):
    """What each command's ``register`` uses of what ``add_subparsers()`` returns: argparse gives
    that class no public name (and it is generic only in typeshed)."""

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser: ...
