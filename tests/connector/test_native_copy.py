"""The CPU engine's native loop over the copy plan (connector/transfer/native.py), byte for byte against
the reference (plain array assignment in slot order) over every cache layout the connector binds:
pieces under and over the streamed minimum, piece sizes and addresses not multiples of 16 (fp8,
odd head sizes), slots at odd addresses with gaps between them, ids out of order; with and without
streaming stores. The check is shown to catch a wrong loop: compiled variants of the loop's IR
with one mistake each (a piece, a block, a line's tail, the slot offset, a quarter's lines) fail it."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from connector.transfer import native as native_copy
from connector.transfer.engines import NumpyTransfer, bind_caches, scatter_block
from connector.transfer.layout import slot_array
from tests.connector.test_copy_plan import DTYPES, LAYOUT, _caches, _reference, _spec

IDS = [5, 0, 6, 2, 3]


def _odd_slots(n: int, block_bytes: int) -> list[np.ndarray]:
    """``n`` slots in one buffer, each at an odd address, 7 bytes apart."""
    buf = np.zeros(1 + n * (block_bytes + 7), np.uint8)
    return [buf[1 + i * (block_bytes + 7):][:block_bytes] for i in range(n)]


def _addresses(slots: list[np.ndarray]) -> np.ndarray:
    return np.array([s.ctypes.data for s in slots], dtype=np.int64)


def _moves_the_reference_bytes(kind: str, dtype: str, d: int, *, stream: bool,
                               loop: native_copy.Loop | None = None) -> bool:
    """Gather (ids out of order) into odd slots, then scatter the reference's bytes from them into
    another cache in the other order, by the native loop; whether both match the reference."""
    spec = _spec(LAYOUT[kind], d, dtype)
    src, dst = _caches(kind, d, DTYPES[dtype], 1), _caches(kind, d, DTYPES[dtype], 2)
    kv = bind_caches(spec, src)
    slots = _odd_slots(len(IDS), spec.block_bytes)
    native_copy.run(native_copy.plan_table(kv.plan), np.array(IDS), _addresses(slots), to_slots=True,
                    stream=stream, loop=loop)
    want = _reference(spec, src, IDS)
    gathered = [s.tobytes() for s in slots] == want

    for s, w in zip(slots, want):
        s[:] = np.frombuffer(w, np.uint8)
    expected = bind_caches(spec, [tuple(t.clone() for t in c) if isinstance(c, tuple) else c.clone() for c in dst])
    for b, s in zip(IDS[::-1], slots):
        scatter_block(expected.planes, b, slot_array(s, spec))
    got = bind_caches(spec, dst)
    native_copy.run(native_copy.plan_table(got.plan), np.array(IDS[::-1]), _addresses(slots), to_slots=False,
                    stream=stream, loop=loop)
    scattered = all(np.array_equal(pg, pe) for lg, le in zip(got.planes, expected.planes) for pg, pe in zip(lg, le))
    return gathered and scattered


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3", "float32"])
@pytest.mark.parametrize("kind", sorted(LAYOUT))
@pytest.mark.parametrize("d", [8, 67])  # 67: pieces of 268 to 3,216 odd-placed bytes (whole lines, a head, a tail)
def test_the_native_loop_moves_the_reference_bytes(kind: str, dtype: str, d: int, stream: bool) -> None:
    assert _moves_the_reference_bytes(kind, dtype, d, stream=stream)


MISTAKES = {  # one wrong line each, in the loop's own IR
    "the last piece skipped": ("%more = icmp slt i64 %p1, %pieces",
                               "%p2 = add i64 %p1, 1\n  %more = icmp slt i64 %p2, %pieces"),
    "the last block skipped": ("%again = icmp slt i64 %b1, %blocks",
                               "%b2 = add i64 %b1, 1\n  %again = icmp slt i64 %b2, %blocks"),
    "a streamed piece's tail dropped": ("call ptr @memcpy(ptr %ptd, ptr %pts, i64 %t)", ""),
    "the slot offset ignored": ("%at = add i64 %slot, %off", "%at = add i64 %slot, 0"),
    "a quarter read from the wrong place": ("%sa2 = add i64 %sa1, %qb", "%sa2 = add i64 %sa1, 0"),
}


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_the_byte_check_catches_a_wrong_loop(mistake: str) -> None:
    """The check above fails for a loop that is wrong by one piece, one block, a tail, an offset or
    a quarter of a streamed piece."""
    old, new = MISTAKES[mistake]
    assert old in native_copy.LOOP_IR
    loop, engine = native_copy.build(native_copy.LOOP_IR.replace(old, new))
    assert not _moves_the_reference_bytes("flash_attn", "float8_e4m3", 67, stream=True, loop=loop)
    del engine  # owns the loop's code: kept alive until here


def test_numpy_transfer_runs_the_native_loop_like_the_python_one() -> None:
    """NumpyTransfer uses the native loop (llvmlite is a dependency: no silent fallback here), its
    bytes are the Python loop's (streamed or not), and two caches bound in turn each get their own
    plan's table."""
    t = NumpyTransfer()
    assert t.native and native_copy.available()
    spec = _spec("vllm_gpu", 67, "bfloat16")
    caches = {seed: _caches("flash_attn", 67, torch.bfloat16, seed) for seed in (1, 2)}
    kvs = {seed: bind_caches(spec, c) for seed, c in caches.items()}
    for seed in (1, 2, 1):
        out = {}
        for name, engine in (("native", t), ("streamed", NumpyTransfer(stream_bytes=0)),
                             ("python", NumpyTransfer(native=False))):
            slots = _odd_slots(len(IDS), spec.block_bytes)
            engine.gather(kvs[seed], IDS, slots)
            out[name] = [s.tobytes() for s in slots]
        assert out["native"] == out["streamed"] == out["python"] == _reference(spec, caches[seed], IDS)


def test_without_llvmlite_the_python_loop_copies() -> None:
    """Where llvmlite cannot be imported the engine falls back to the Python loop, same bytes."""
    code = """
import sys; sys.modules["llvmlite"] = None
import numpy as np
from connector.transfer.layout import KVSpec
from connector.transfer.engines import NumpyTransfer, bind_caches
spec = KVSpec(layout="vllm_cpu", num_layers=2, kv_heads=1, head_size=4, block_size=2, dtype="float32")
caches = [np.arange(3 * 16, dtype=np.float32).reshape(3, 1, 2, 8) + 100 * i for i in range(2)]
t = NumpyTransfer()
slot = np.zeros(spec.block_bytes, np.uint8)
t.gather(bind_caches(spec, caches), [1], [slot])
assert not t.native
assert slot.view(np.float32).tolist() == caches[0][1].ravel().tolist() + caches[1][1].ravel().tolist()
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr
