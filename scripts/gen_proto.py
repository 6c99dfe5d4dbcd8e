"""Regenerate the gRPC stubs in kvstore/v1/ from proto/kvstore/v1/*.proto.

    python scripts/gen_proto.py            # write the stubs
    python scripts/gen_proto.py --out DIR  # write them under DIR instead (used by the drift test)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"


def generate(out: Path) -> list[Path]:
    from grpc_tools import protoc  # dev dependency

    protos = sorted(PROTO_ROOT.glob("kvstore/v1/*.proto"))
    out.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *map(str, protos),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    pkg = out / "kvstore" / "v1"
    return sorted(p for p in pkg.iterdir() if p.suffix in (".py", ".pyi") and p.name != "__init__.py")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT)
    args = parser.parse_args()
    for path in generate(args.out):
        print(path.relative_to(args.out))


if __name__ == "__main__":
    sys.exit(main())
