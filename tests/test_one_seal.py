"""One hash of blocks' bytes in the sidecar: ``kvstore/store/sealing.py`` (issue #40, item 4).

The commit's check, the sealer, a verified read, the exchange's lend and the movers' sealers
(demotion, write-through, drain) hash through ``sealing.hashed`` / ``sealing.seal``, which judge
what a moved block's slot held once for all of them. This test reads ``kvstore/`` with ``ast``
(never importing it) for every module that imports the batch hash
(``kvstore.checksum.checksums``) and holds the list to ``HASHERS``: exact, so a stale entry
fails too.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.source_tree import parsed_sources, write_tree

ROOT = Path(__file__).resolve().parents[1]

# module -> why it may hash a batch of blocks' bytes itself
HASHERS: dict[str, str] = {
    "kvstore/store/sealing.py": "the one hash and hash-and-seal of DRAM and staged copies",
    "kvstore/tiers/base.py": "a tier's read checked against its header (with_hashes): no block is sealed there",
}


def hashers(root: Path) -> set[str]:
    """The modules of ``kvstore/`` under ``root`` that import ``checksums`` from the checksum module."""
    return {
        rel
        for rel, tree in parsed_sources(root, ("kvstore",))
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        and node.module == "kvstore.checksum"
        and any(a.name == "checksums" for a in node.names)
    }


def test_one_module_hashes_and_seals_blocks() -> None:
    assert hashers(ROOT) == set(HASHERS), (
        "hash blocks' bytes through kvstore.store.sealing (hashed, seal), which judge a block that "
        "left its slot meanwhile; or name the module in HASHERS with its reason"
    )


def test_the_check_finds_a_second_hasher(tmp_path: Path) -> None:
    write_tree(
        tmp_path,
        {
            "kvstore/store/sealing.py": "from kvstore.checksum import checksums\n",
            "kvstore/movers/demotion.py": "from kvstore.checksum import checksum, checksums\n",
            "kvstore/store/exchange.py": "from kvstore.checksum import checksum\n",  # (one block: not the batch)
        },
    )
    assert hashers(tmp_path) == {"kvstore/store/sealing.py", "kvstore/movers/demotion.py"}
