"""The state layer's view of the tiers below stays small and in step (issue 31): the movers'
Protocol has at most eight calls, ``NoMovers`` and ``Tiering`` each have every member of it, and a
``Level`` every member of ``Lower`` (what the DRAM space, the block store and the audit read). A
``Level`` keeps its tier, its placement space, its capacity and its health, and no mover's state
(issue 40: the demotion's queue, the removal's releasing bytes, the eviction's reservations)."""

from __future__ import annotations

import ast
import inspect
import textwrap

from kvstore.movers.level import Level
from kvstore.movers.tiering import Tiering
from kvstore.store.books.below import Lower, Movers, NoMovers


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


def test_a_level_keeps_its_tier_space_capacity_and_health_only() -> None:
    init = ast.parse(textwrap.dedent(inspect.getsource(Level.__init__)))
    fields = {
        t.attr
        for node in ast.walk(init)
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
    }
    assert fields == {
        "name", "tier", "capacity", "placement", "write_through", "codec", "slots", "_index", "_stats", "_down"
    }, "a mover's state belongs to the mover (demotion.Lane, Removal, Eviction), not to the level"
