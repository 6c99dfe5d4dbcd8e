"""Prefix-cache traces: Mooncake's JSONL format, plus synthetic held-out generators.

A trace is a list of requests in timestamp order; each request is the chain of its prompt's block
ids (an id names a whole prefix, so the same id always sits behind the same parent). Mooncake's
format, one JSON object per line, plain or gzip-compressed (the copies in ``data/traces/``)::

    {"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [int, ...]}

with 512-token blocks, ``len(hash_ids) == ceil(input_length / 512)`` and a usually partial last
block. The generators below build other shapes of sharing with the same format, so that policies
are judged on traces they were not tuned on.
"""

from __future__ import annotations

import gzip
import json
import random
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from kvstore.errors import InvalidArgument

BLOCK_TOKENS = 512


@dataclass(slots=True, frozen=True)
class Request:
    timestamp: int
    keys: tuple[int, ...]  # block ids of the prompt, root first
    last_size: int  # tokens in the last block (1..block_tokens)
    output_length: int = 0  # tokens the request generated (the trace's output_length)


@dataclass(slots=True)
class Trace:
    name: str
    requests: list[Request]
    block_tokens: int = BLOCK_TOKENS

    @property
    def references(self) -> int:
        return sum(len(r.keys) for r in self.requests)

    def unique_blocks(self) -> int:
        seen: set[int] = set()
        for r in self.requests:
            seen.update(r.keys)
        return len(seen)

    def to_jsonl(self, path: str | Path) -> None:
        """The trace as Mooncake JSONL (what :func:`load_trace` reads), gzip'd without a name or
        time when ``path`` ends in .gz: the same bytes for the same trace (the committed traces)."""
        bt = self.block_tokens
        lines = "".join(
            json.dumps({"timestamp": r.timestamp, "input_length": (len(r.keys) - 1) * bt + r.last_size,
                        "output_length": r.output_length, "hash_ids": list(r.keys)}) + "\n"
            for r in self.requests
        ).encode()
        with open(path, "wb") as f:
            if str(path).endswith(".gz"):
                with gzip.GzipFile(filename="", mode="wb", compresslevel=9, fileobj=f, mtime=0) as z:
                    z.write(lines)
            else:
                f.write(lines)


def _request(ts: int, hash_ids: list[int], input_length: int, bt: int, output_length: int = 0) -> Request:
    n = len(hash_ids)
    last = input_length - (n - 1) * bt
    if not 1 <= last <= bt:
        last = bt  # tolerate traces whose input_length disagrees with hash_ids
    return Request(ts, tuple(hash_ids), last, max(0, output_length))


def parse_records(records: Iterable[dict[str, Any]], name: str = "trace", block_tokens: int = BLOCK_TOKENS) -> Trace:
    reqs: list[Request] = []
    for i, rec in enumerate(records):
        try:
            ids = rec["hash_ids"]
            ts = int(rec.get("timestamp", i))
            length = int(rec.get("input_length", len(ids) * block_tokens))
            output = int(rec.get("output_length", 0))
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgument(f"trace {name}: record {i} lacks hash_ids/timestamp/input_length") from exc
        if ids:
            reqs.append(_request(ts, [int(x) for x in ids], length, block_tokens, output))
    reqs.sort(key=lambda r: r.timestamp)  # stable: ties keep file order
    return Trace(name, reqs, block_tokens)


GZIP_MAGIC = b"\x1f\x8b"


def _open_text(p: Path) -> IO[str]:
    """The file as UTF-8 text, decompressed when it is gzip (recognised by its first bytes, so
    ``.jsonl.gz`` and ``.jsonl`` both work whatever the name says)."""
    with open(p, "rb") as f:
        magic = f.read(len(GZIP_MAGIC))
    if magic == GZIP_MAGIC:
        return gzip.open(p, "rt", encoding="utf-8")
    return open(p, encoding="utf-8")


def load_trace(path: str | Path, block_tokens: int = BLOCK_TOKENS) -> Trace:
    """A Mooncake-format trace from JSONL, plain or gzip-compressed (``.jsonl.gz``)."""
    p = Path(path)
    try:
        with _open_text(p) as f:
            records = [json.loads(line) for line in f if line.strip()]
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"trace: {p} is not JSONL ({exc})") from exc
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        raise InvalidArgument(f"trace: {p} is not a readable gzip file ({exc})") from exc
    except UnicodeDecodeError as exc:
        raise InvalidArgument(f"trace: {p} is not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    except OSError as exc:
        raise InvalidArgument(f"trace: cannot read {p}: {exc.strerror or exc}") from exc
    name = p.name.removesuffix(".gz").removesuffix(".jsonl").removesuffix("_trace")
    return parse_records(records, name, block_tokens)


# --- held-out generators -------------------------------------------------------------------------
#
# Each returns a Trace with the same conventions as Mooncake's (prefix ids, partial last blocks).
# They are deliberately different in shape from the two shared traces.


class _Ids:
    def __init__(self) -> None:
        self.n = 0

    def take(self, k: int) -> list[int]:
        out = list(range(self.n, self.n + k))
        self.n += k
        return out


def _tokens(rng: random.Random, mean: float, lo: int = 16) -> int:
    return max(lo, int(rng.expovariate(1.0 / mean)))


def _prompt_ids(
    ids: _Ids, prefix_ids: list[int], prefix_tokens: int, new_tokens: int, bt: int
) -> tuple[list[int], int]:
    """Extend a block-aligned prefix by ``new_tokens`` fresh tokens; the partial tail is unique."""
    total = prefix_tokens + new_tokens
    n = -(-total // bt)
    return prefix_ids + ids.take(n - len(prefix_ids)), total


def multi_turn(sessions: int = 3000, seed: int = 1, bt: int = BLOCK_TOKENS, system_prompts: int = 4,
               mean_turns: float = 4.0, mean_gap_s: float = 60.0, rate_per_s: float = 2.0) -> Trace:
    """Chat sessions whose prompt grows turn by turn (history + answer + new question), over a
    few shared system prompts; sessions start as a Poisson process, turns come after think time."""
    rng = random.Random(seed)
    ids = _Ids()
    sys_ids = [ids.take(rng.randint(1, 4)) for _ in range(system_prompts)]
    events: list[tuple[float, int, list[int], int]] = []
    t = 0.0
    for _ in range(sessions):
        t += rng.expovariate(rate_per_s)
        s = rng.randrange(system_prompts)
        prefix = list(sys_ids[s])
        ptoks = len(prefix) * bt
        turns = 1 + int(rng.expovariate(1.0 / max(mean_turns - 1, 0.1)))
        ts = t
        for _turn in range(turns):
            keys, total = _prompt_ids(ids, prefix, ptoks, _tokens(rng, 700), bt)
            events.append((ts, len(events), keys, total))
            # next turn: the whole prompt plus the answer; the old partial tail becomes full again
            answer = _tokens(rng, 400)
            full = (total + answer) // bt
            keep = keys[: len(keys) - (1 if total % bt else 0)]
            prefix = keep + ids.take(max(0, full - len(keep)))
            ptoks = len(prefix) * bt
            ts += rng.expovariate(1.0 / mean_gap_s)
    return _finish("multi_turn", events, bt)


def agentic(agents: int = 400, seed: int = 2, bt: int = BLOCK_TOKENS, tools_prompt_blocks: int = 6,
            mean_steps: float = 12.0, mean_step_s: float = 8.0, rate_per_s: float = 0.4) -> Trace:
    """Agent loops: a long shared tool-description prompt, then each step appends a tool call and
    its (often long) observation, re-sending the whole growing context every few seconds."""
    rng = random.Random(seed)
    ids = _Ids()
    tools = ids.take(tools_prompt_blocks)
    events: list[tuple[float, int, list[int], int]] = []
    t = 0.0
    for _ in range(agents):
        t += rng.expovariate(rate_per_s)
        prefix = list(tools) + ids.take(rng.randint(1, 3))  # task description
        steps = 1 + int(rng.expovariate(1.0 / mean_steps))
        ts = t
        for _step in range(steps):
            keys, total = _prompt_ids(ids, prefix, len(prefix) * bt, _tokens(rng, 300), bt)
            events.append((ts, len(events), keys, total))
            grow = _tokens(rng, 1200)  # tool call + observation
            full = (total + grow) // bt
            keep = keys[: len(keys) - (1 if total % bt else 0)]
            prefix = keep + ids.take(max(0, full - len(keep)))
            ts += rng.expovariate(1.0 / mean_step_s)
    return _finish("agentic", events, bt)


def shared_prompts(requests: int = 20000, seed: int = 3, bt: int = BLOCK_TOKENS, prompts: int = 200,
                   zipf_s: float = 1.1, one_shot_frac: float = 0.5, rate_per_s: float = 10.0) -> Trace:
    """Many short requests over a Zipf-popular set of long shared prompts (system prompts, few-shot
    templates, RAG documents), mixed with one-shot long prompts that share nothing (scans)."""
    rng = random.Random(seed)
    ids = _Ids()
    lib = [ids.take(rng.randint(2, 24)) for _ in range(prompts)]
    weights = [1.0 / (i + 1) ** zipf_s for i in range(prompts)]
    events: list[tuple[float, int, list[int], int]] = []
    t = 0.0
    for _ in range(requests):
        t += rng.expovariate(rate_per_s)
        if rng.random() < one_shot_frac:
            keys, total = _prompt_ids(ids, [], 0, _tokens(rng, 6000), bt)
        else:
            base = rng.choices(lib, weights)[0]
            keys, total = _prompt_ids(ids, list(base), len(base) * bt, _tokens(rng, 200), bt)
        events.append((t, len(events), keys, total))
    return _finish("shared_prompts", events, bt)


def mixed(seed: int = 4, bt: int = BLOCK_TOKENS) -> Trace:
    """The three shapes above interleaved in time (disjoint id spaces)."""
    parts = [multi_turn(sessions=1500, seed=seed, bt=bt), agentic(agents=200, seed=seed + 1, bt=bt),
             shared_prompts(requests=8000, seed=seed + 2, bt=bt, rate_per_s=4.0)]
    events: list[tuple[float, int, list[int], int]] = []
    off = 0
    for p in parts:
        top = 0
        for r in p.requests:
            keys = [k + off for k in r.keys]
            top = max(top, max(keys) + 1)
            events.append((r.timestamp / 1000.0, len(events), keys, (len(keys) - 1) * bt + r.last_size))
        off = top
    return _finish("mixed", events, bt)


def _finish(name: str, events: list[tuple[float, int, list[int], int]], bt: int) -> Trace:
    events.sort(key=lambda e: (e[0], e[1]))
    return Trace(name, [_request(int(ts * 1000), keys, total, bt) for ts, _, keys, total in events], bt)


HELD_OUT: dict[str, Callable[[], Trace]] = {
    "multi_turn": multi_turn,
    "agentic": agentic,
    "shared_prompts": shared_prompts,
    "mixed": mixed,
}


def held_out(names: Iterable[str] | None = None) -> Iterator[Trace]:
    for n in names or HELD_OUT:
        yield HELD_OUT[n]()
