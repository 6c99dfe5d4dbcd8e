"""`kvstore` command line: one module per subcommand under kvstore/commands/.

Each command module has ``register(subparsers)`` which adds its parser and sets ``func``;
they are imported lazily only to build the parser, and heavy imports happen inside ``func``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from kvstore.errors import KVStoreError

COMMANDS = (
    "serve",
    "stats",
    "config",
    "bench",
    "replay",
    "demo",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstore", description="KV-cache tier service for LLM inference")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"kvstore.commands.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        rc = args.func(args)
    except KVStoreError as exc:
        logging.getLogger("kvstore").debug("command failed", exc_info=True)
        print(f"kvstore {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
