"""The state layer's view of the tiers below stays small and in step (issue 31): the movers'
Protocol has at most eight calls, ``NoMovers`` and ``Tiering`` each have every member of it, and a
``Level`` every member of ``Lower`` (what the DRAM space, the block store and the audit read)."""

from __future__ import annotations

import inspect

from kvstore.store.below import Lower, Movers, NoMovers
from kvstore.tiers.level import Level
from kvstore.tiers.movers import Tiering


def members(proto: type) -> set[str]:
    return {n for n in vars(proto) if not n.startswith("_")}


def calls(proto: type) -> set[str]:
    return {n for n, v in vars(proto).items() if not n.startswith("_") and inspect.isfunction(v)}


def test_the_movers_protocol_has_at_most_eight_calls() -> None:
    assert len(calls(Movers)) <= 8, sorted(calls(Movers))


def test_no_movers_and_tiering_have_every_member_of_the_protocol() -> None:
    for impl in (NoMovers, Tiering):
        assert not [n for n in members(Movers) if not hasattr(impl, n)], impl


def test_a_level_has_every_member_the_state_layer_reads() -> None:
    properties = {n for n, v in vars(Level).items() if isinstance(v, property)}
    init = inspect.getsource(Level.__init__)
    missing = [n for n in members(Lower) if n not in properties and not hasattr(Level, n) and f"self.{n} =" not in init]
    assert not missing
