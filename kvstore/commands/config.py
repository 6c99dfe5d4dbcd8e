"""`kvstore config`: print the default configuration, or check a configuration file.

    kvstore config --print-defaults > kvstore.toml     # every field, with its description
    kvstore config --check kvstore.toml                # exit 0, or 2 naming the bad field(s)

``--check`` applies the same sources as ``kvstore serve`` (file, then ``KVSTORE_*`` environment
overrides), so it answers "would the sidecar start with this?".
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstore.commands import Subparsers


def register(sub: Subparsers) -> None:
    p = sub.add_parser("config", help="print the default configuration or validate a config file")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--print-defaults", action="store_true", help="print the defaults as TOML, with descriptions")
    what.add_argument("--check", metavar="FILE", help="validate FILE (plus KVSTORE_* environment overrides)")
    p.add_argument("--show", action="store_true", help="with --check: print the effective configuration as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvstore.config import defaults_toml, load_config

    if args.print_defaults:
        print(defaults_toml(), end="")
        return 0
    from kvstore.policy import make_policy

    cfg = load_config(args.check)  # raises ConfigError (exit 2, message names the field)
    make_policy(cfg.index.policy)  # names are checked by the registry, as at start
    if args.show:
        print(json.dumps(cfg.model_dump(), indent=2))
    else:
        print(f"{args.check}: ok")
    return 0
