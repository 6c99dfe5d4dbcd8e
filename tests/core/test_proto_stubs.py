"""The generated stubs in kvstore/v1 must be what scripts/gen_proto.py makes of proto/ today."""

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_stubs_match_the_proto(tmp_path):
    spec = importlib.util.spec_from_file_location("gen_proto", REPO / "scripts" / "gen_proto.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    fresh = gen.generate(tmp_path)
    assert fresh, "protoc produced nothing"
    for path in fresh:
        committed = REPO / "kvstore" / "v1" / path.name
        assert committed.exists(), f"{path.name} is not committed; run scripts/gen_proto.py"
        assert committed.read_text() == path.read_text(), f"{path.name} is stale; run scripts/gen_proto.py"
