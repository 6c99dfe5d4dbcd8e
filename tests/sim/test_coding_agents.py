"""The agentic coding trace (kvstore/sim/coding_agents.py, data/traces/coding_agent_trace.jsonl.gz):
the committed file is what the generator gives, and it has the shape the issue measured hints on."""

from __future__ import annotations

from pathlib import Path

from kvstore.sim.coding_agents import Params, generate
from kvstore.sim.hints import continued_by
from kvstore.sim.traces import load_trace

TRACE = Path(__file__).resolve().parents[2] / "data" / "traces" / "coding_agent_trace.jsonl.gz"


def test_regenerating_the_trace_gives_the_committed_file(tmp_path: Path) -> None:
    out = tmp_path / "coding_agent_trace.jsonl.gz"
    generate().to_jsonl(out)  # the one trace writer (kvstore/sim/traces.py)
    assert out.read_bytes() == TRACE.read_bytes()  # the gzip file itself, not only its contents


def test_another_seed_gives_another_trace() -> None:
    a, b = generate(Params(duration_s=60.0)), generate(Params(duration_s=60.0, seed=1))
    assert [r.keys for r in a.requests] != [r.keys for r in b.requests]
    assert [r.keys for r in a.requests] == [r.keys for r in generate(Params(duration_s=60.0)).requests]


def test_the_trace_is_long_agentic_conversations() -> None:
    t = load_trace(TRACE)
    n = len(t.requests)
    tokens = sum((len(r.keys) - 1) * t.block_tokens + r.last_size for r in t.requests) / n
    assert 110_000 <= tokens <= 135_000 and 215 <= t.references / n <= 265  # ~120 k tokens, ~236 blocks
    links = continued_by(t)
    assert sum(j >= 0 for _, j in links) > 0.85 * n  # nearly every step comes back (a tool call)
    mid = t.requests[-1].timestamp / 2
    waiting = sum(1 for i, (_, j) in enumerate(links)
                  if j >= 0 and t.requests[i].timestamp <= mid < t.requests[j].timestamp)
    assert 120 <= waiting <= 200  # conversations overlapping, each waiting on its tool call
    gaps = sorted(t.requests[j].timestamp - t.requests[i].timestamp for i, (_, j) in enumerate(links) if j >= 0)
    assert 1_000 <= gaps[len(gaps) // 2] <= 60_000 and gaps[int(0.99 * len(gaps))] >= 60_000  # seconds to minutes
