"""A trace of long agentic coding conversations (``data/traces/coding_agent_trace.jsonl.gz``).

The two Mooncake traces are chat and synthetic traffic: prompts of a few thousand tokens. A coding
agent (Claude Code, Codex, SWE-agent) re-sends one growing context at every step of its loop: a
shared system prompt and tool schemas, the task, then every tool call and its observation (file
reads, test output), so that one prompt is a large share of a small cache and the turn it ends in
(a tool call) comes back seconds to minutes later. This module generates such a trace in
Mooncake's format (512-token blocks, ``hash_ids`` naming prefixes, the usual partial last block),
so that ``kvstore replay`` can judge retention hints where they can hurt (docs/eviction.md)::

    python -m kvstore.sim.coding_agents data/traces/coding_agent_trace.jsonl.gz

The output is a function of the parameters and the seed only (``gzip`` without a name or time):
``tests/sim/test_coding_agents.py`` regenerates it and compares the bytes.

The parameters (:class:`Params`) and where their values come from:

* **steps per conversation** (mean 40): the median session of the Thoughtworks
  agentic-coding-trajectories set (15 k SWE-agent / OpenHands sessions) has 36 assistant turns,
  p95 87 (huggingface.co/datasets/thoughtworks/agentic-coding-trajectories); TraceLab (UW, 4,265
  Claude Code and Codex sessions, tracelab.cs.washington.edu) counts 73.6 tool-triggered steps
  per session on average;
* **a human turn** every ~9 steps (``human_every``): TraceLab's 7.8 tool-triggered steps per
  user request; the human gap stands for TraceLab's "human thinking" between requests (its
  shape is this module's choice: log-normal, median 60 s, a tail to tens of minutes);
* **tool-call gaps of seconds to minutes**: the gap between two steps is the model's generation
  (``output_length`` at ``decode_tok_s``) plus the tool's latency, log-normal with median 3 s and
  a tail past a minute (this module's choice, after TraceLab's per-call tool latency: most calls
  take a few seconds, shell commands and test runs orders of magnitude longer);
* **prompts of ~120 k tokens on average, ~236 blocks a request**: a shared system prompt with the
  tool schemas (one of ``system_prompts`` variants, 12 k tokens), the task and the files read
  first (50 k on average), then each step appends its output and the tool's observation (5 k
  tokens on average, log-normal: a grep is short, a file read long); past ``compact_tokens`` (the
  agent's auto-compaction near its window) the context restarts from the system prompt and a
  summary with the files re-read (40 k). Measured on the generated trace: 125,943 tokens and 246
  blocks a request on average;
* **~160 conversations overlapping**: conversations start as a Poisson process at the rate that
  keeps ``overlapping`` of them running by Little's law over their mean length (an estimate: at
  the trace's middle ~150 are waiting on a tool call, each next step not yet sent), from well
  before the trace's start so that it opens in a steady state (the steps before 0 are not written).

The trace's figures (requests, unique blocks, prompt length) are in data/traces/README.md.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from dataclasses import dataclass

from kvstore.sim.traces import BLOCK_TOKENS, Request, Trace

SEED = 37


@dataclass(frozen=True, slots=True)
class Params:
    seed: int = SEED
    duration_s: float = 300.0  # the trace's length (the steps written: 0 <= t < duration)
    overlapping: int = 230  # conversations running at once by Little's law (~150 waiting on a tool call)
    mean_steps: float = 40.0  # model calls per conversation
    human_every: float = 9.0  # steps per user request (a human gap before each new one)
    system_prompts: int = 4  # agent / model variants, each its own shared prefix
    system_tokens: int = 12_288  # system prompt and tool schemas
    task_tokens: float = 50_000.0  # mean: the task and the first files read
    step_tokens: float = 5_000.0  # mean: a step's output and the tool's observation appended
    step_sigma: float = 1.0  # log-normal spread of a step's growth
    compact_tokens: int = 230_000  # auto-compaction: the context restarts from a summary
    summary_tokens: int = 40_000
    output_tokens: float = 300.0  # mean output of a step (the tool call and its reasoning)
    decode_tok_s: float = 50.0
    tool_median_s: float = 3.0  # log-normal tool latency: median, spread
    tool_sigma: float = 1.4
    human_median_s: float = 60.0
    human_sigma: float = 1.2
    block_tokens: int = BLOCK_TOKENS


def _lognormal(rng: random.Random, median: float, sigma: float) -> float:
    return median * math.exp(rng.gauss(0.0, sigma))


def _lognormal_mean(rng: random.Random, mean: float, sigma: float) -> float:
    return mean * math.exp(rng.gauss(-sigma * sigma / 2, sigma))


class _Ids:
    """Fresh block ids, in order of first use."""

    def __init__(self) -> None:
        self.n = 0

    def take(self, k: int) -> list[int]:
        out = list(range(self.n, self.n + k))
        self.n += k
        return out


def generate(p: Params = Params()) -> Trace:
    """The trace of ``p``: conversations of growing prompts, one request per model call."""
    rng = random.Random(p.seed)
    bt = p.block_tokens
    mean_gap = (p.output_tokens / p.decode_tok_s
                + math.exp(p.tool_sigma ** 2 / 2) * p.tool_median_s * (1 - 1 / p.human_every)
                + math.exp(p.human_sigma ** 2 / 2) * p.human_median_s / p.human_every)
    mean_life = p.mean_steps * mean_gap
    rate = p.overlapping / mean_life
    events: list[tuple[float, int, list[int], int, int]] = []  # (time, conversation, keys, tokens, output)
    ids = _Ids()
    systems = [ids.take(p.system_tokens // bt) for _ in range(p.system_prompts)]
    t, conv = -4 * mean_life, 0
    while True:
        t += rng.expovariate(rate)
        if t >= p.duration_s:
            break
        conv += 1
        system = systems[rng.randrange(p.system_prompts)]
        steps = 1 + int(rng.expovariate(1 / (p.mean_steps - 1)))
        ts = t
        prefix = list(system)  # full blocks shared with the next step
        tokens = len(prefix) * bt + int(_lognormal_mean(rng, p.task_tokens, 0.8))
        for step in range(steps):
            n = -(-tokens // bt)
            keys = prefix + ids.take(n - len(prefix))
            out = max(16, int(rng.expovariate(1 / p.output_tokens)))
            if ts >= 0:
                events.append((ts, conv, keys, tokens, out))
            grown = tokens + out + int(_lognormal_mean(rng, p.step_tokens, p.step_sigma))
            if grown > p.compact_tokens:  # compaction: the system prompt and a summary, new blocks
                prefix, tokens = list(system), len(system) * bt + p.summary_tokens
            else:
                prefix, tokens = keys[: tokens // bt], grown
            gap = out / p.decode_tok_s
            if rng.random() < 1 / p.human_every and step:
                gap += _lognormal(rng, p.human_median_s, p.human_sigma)
            else:
                gap += _lognormal(rng, p.tool_median_s, p.tool_sigma)
            ts += gap
            if ts >= p.duration_s:
                break
    events.sort(key=lambda e: (e[0], e[1]))
    reqs = [Request(int(ts * 1000), tuple(keys), tokens - (len(keys) - 1) * bt, out)
            for ts, _, keys, tokens, out in events]
    return Trace("coding_agent", _renumber(reqs), bt)


def _renumber(reqs: list[Request]) -> list[Request]:
    """Ids in order of first appearance (the steps before the trace's start are not written)."""
    seen: dict[int, int] = {}
    return [Request(r.timestamp, tuple(seen.setdefault(k, len(seen)) for k in r.keys), r.last_size,
                    r.output_length) for r in reqs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvstore.sim.coding_agents", description=__doc__.split("\n")[0])
    ap.add_argument("out", help="the trace to write (.jsonl or .jsonl.gz)")
    ap.add_argument("--seed", type=int, default=SEED)
    args = ap.parse_args(argv)
    trace = generate(Params(seed=args.seed))
    trace.to_jsonl(args.out)
    n = len(trace.requests)
    tokens = sum((len(r.keys) - 1) * trace.block_tokens + r.last_size for r in trace.requests)
    print(f"{args.out}: {n} requests, {trace.references} block references, {trace.unique_blocks()} unique "
          f"blocks, {tokens / n:,.0f} tokens a prompt, {trace.references / n:.1f} blocks", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
