"""The copy plan run on the host by one native loop per batch (the CPU engine's copy).

:class:`connector.transfer.engines.NumpyTransfer` executes the plan (:mod:`connector.transfer.plan`) here:
one call per batch into a loop compiled at first use from the LLVM IR below (llvmlite, a wheel on
every supported Python: nothing is compiled at install time), over the plan's pieces and the
batch's blocks, ``memcpy`` per piece. Without llvmlite (or a JIT for this CPU) the engine falls
back to :func:`connector.transfer.engines.run_plan`, one ``ctypes.memmove`` per piece from Python.

Why native: from Python a piece costs ~0.5 µs of call overhead, which at 8 KiB pieces is most of
the work. Why *streaming* stores: a regular store first reads the destination's line into the
cache (read for ownership), a third memory access per byte copied. glibc's ``memcpy`` streams only
a copy larger than 3/4 of a thread's share of the last-level cache (180 MiB on the build machine,
whose VM reports a 480 MiB L3), which no piece reaches: pieces of 64 KiB, or even 64 MiB, copied a
call at a time ran at ~0.5-0.6 of one ``memcpy`` of them all. A batch of at least
:data:`STREAM_BYTES` (a CPU's share of its L2) is therefore written with streaming stores: each
piece's whole 64-byte lines with LLVM's ``!nontemporal`` stores, a line from each quarter of the
piece in turn (four streams of reads in flight, as glibc interleaves four pages in its own large
copies: 0.98-1.04 of one ``memcpy`` against 0.78-0.85 for one stream, 64 KiB pieces; the head up
to the destination's first line and the tail by ``memcpy``), then one fence before the call returns, so every store is
visible to the caller and to other processes mapping the slab. Such a batch would not stay in the
core's cache anyway, and what reads it next finds it in memory either way: a forward pass streams
the model's weights through the cache before it reads the loaded blocks, a saved slot is hashed,
served or spilled later. A smaller batch is copied by ``memcpy`` alone.

The loop is the plan's own arithmetic: piece ``p`` of block ``ids[i]`` is the bytes
``[src[p] + ids[i] * stride[p], + nbytes[p])`` of the cache and ``[slots[i] + slot_off[p], +
nbytes[p])`` of the slot; pieces outer, blocks inner (the cache side walks one plane at a time).
The caller has checked every id against the cache and every slot's size.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from connector.transfer.plan import Piece

log = logging.getLogger(__name__)

LINE = 64  # bytes a streaming store writes at once (one cache line)
MIN_STREAMED = 4 * LINE  # a shorter piece is one memcpy even in a streamed batch

LOOP_IR = r"""
declare ptr @memcpy(ptr, ptr, i64)

define internal void @copy(i64 %d, i64 %s, i64 %n, i1 %stream) {
entry:
  %long = icmp uge i64 %n, MIN_STREAMED
  %lines = and i1 %stream, %long
  br i1 %lines, label %head, label %plain
plain:
  %pd = inttoptr i64 %d to ptr
  %ps = inttoptr i64 %s to ptr
  call ptr @memcpy(ptr %pd, ptr %ps, i64 %n)
  ret void
head:                                   ; up to the destination's first 64-byte line
  %neg = sub i64 0, %d
  %h = and i64 %neg, 63
  %hd = inttoptr i64 %d to ptr
  %hs = inttoptr i64 %s to ptr
  call ptr @memcpy(ptr %hd, ptr %hs, i64 %h)
  %d0 = add i64 %d, %h
  %s0 = add i64 %s, %h
  %rest = sub i64 %n, %h
  %k = lshr i64 %rest, 6
  %q = lshr i64 %k, 2
  %q4 = shl i64 %q, 2
  %qb = shl i64 %q, 6
  %hasq = icmp ugt i64 %q, 0                ; q lines a quarter, the rest after
  br i1 %hasq, label %quad, label %lines0
quad:                                   ; a line from each quarter of the piece a step
  %j = phi i64 [ 0, %head ], [ %j1, %quad ]
  %o = shl i64 %j, 6
  %sa0 = add i64 %s0, %o
  %sa1 = add i64 %sa0, %qb
  %sa2 = add i64 %sa1, %qb
  %sa3 = add i64 %sa2, %qb
  %da0 = add i64 %d0, %o
  %da1 = add i64 %da0, %qb
  %da2 = add i64 %da1, %qb
  %da3 = add i64 %da2, %qb
  %ps0 = inttoptr i64 %sa0 to ptr
  %ps1 = inttoptr i64 %sa1 to ptr
  %ps2 = inttoptr i64 %sa2 to ptr
  %ps3 = inttoptr i64 %sa3 to ptr
  %v0 = load <8 x i64>, ptr %ps0, align 1
  %v1 = load <8 x i64>, ptr %ps1, align 1
  %v2 = load <8 x i64>, ptr %ps2, align 1
  %v3 = load <8 x i64>, ptr %ps3, align 1
  %pd0 = inttoptr i64 %da0 to ptr
  %pd1 = inttoptr i64 %da1 to ptr
  %pd2 = inttoptr i64 %da2 to ptr
  %pd3 = inttoptr i64 %da3 to ptr
  store <8 x i64> %v0, ptr %pd0, align 64, !nontemporal !0
  store <8 x i64> %v1, ptr %pd1, align 64, !nontemporal !0
  store <8 x i64> %v2, ptr %pd2, align 64, !nontemporal !0
  store <8 x i64> %v3, ptr %pd3, align 64, !nontemporal !0
  %j1 = add i64 %j, 1
  %qmore = icmp ult i64 %j1, %q
  br i1 %qmore, label %quad, label %lines0
lines0:                                 ; the k - 4q lines the quarters left
  %left = icmp ult i64 %q4, %k
  br i1 %left, label %line, label %tail
line:
  %jj = phi i64 [ %q4, %lines0 ], [ %jj1, %line ]
  %oo = shl i64 %jj, 6
  %ld = add i64 %d0, %oo
  %ls = add i64 %s0, %oo
  %vd = inttoptr i64 %ld to ptr
  %vs = inttoptr i64 %ls to ptr
  %v = load <8 x i64>, ptr %vs, align 1
  store <8 x i64> %v, ptr %vd, align 64, !nontemporal !0
  %jj1 = add i64 %jj, 1
  %more = icmp ult i64 %jj1, %k
  br i1 %more, label %line, label %tail
tail:
  %body = shl i64 %k, 6
  %td = add i64 %d0, %body
  %ts = add i64 %s0, %body
  %t = and i64 %rest, 63
  %ptd = inttoptr i64 %td to ptr
  %pts = inttoptr i64 %ts to ptr
  call ptr @memcpy(ptr %ptd, ptr %pts, i64 %t)
  ret void
}

; tables: int64 [4][pieces] (src, stride, nbytes, slot_off); ids, slots: int64 [blocks]
define void @run_plan(i64 %tables, i64 %pieces, i64 %ids, i64 %slots, i64 %blocks, i64 %to_slots,
                      i64 %stream) {
entry:
  %tab = inttoptr i64 %tables to ptr
  %idp = inttoptr i64 %ids to ptr
  %slp = inttoptr i64 %slots to ptr
  %out = icmp ne i64 %to_slots, 0
  %nt = icmp ne i64 %stream, 0
  %nop = icmp sle i64 %pieces, 0
  %nob = icmp sle i64 %blocks, 0
  %none = or i1 %nop, %nob
  br i1 %none, label %exit, label %piece
piece:
  %p = phi i64 [ 0, %entry ], [ %p1, %next ]
  %a0 = getelementptr i64, ptr %tab, i64 %p
  %src = load i64, ptr %a0
  %i1 = add i64 %p, %pieces
  %a1 = getelementptr i64, ptr %tab, i64 %i1
  %stride = load i64, ptr %a1
  %i2 = add i64 %i1, %pieces
  %a2 = getelementptr i64, ptr %tab, i64 %i2
  %n = load i64, ptr %a2
  %i3 = add i64 %i2, %pieces
  %a3 = getelementptr i64, ptr %tab, i64 %i3
  %off = load i64, ptr %a3
  br label %block
block:
  %b = phi i64 [ 0, %piece ], [ %b1, %block ]
  %bp = getelementptr i64, ptr %idp, i64 %b
  %id = load i64, ptr %bp
  %sp = getelementptr i64, ptr %slp, i64 %b
  %slot = load i64, ptr %sp
  %into = mul i64 %id, %stride
  %cache = add i64 %src, %into
  %at = add i64 %slot, %off
  %dst = select i1 %out, i64 %at, i64 %cache
  %from = select i1 %out, i64 %cache, i64 %at
  call void @copy(i64 %dst, i64 %from, i64 %n, i1 %nt)
  %b1 = add i64 %b, 1
  %again = icmp slt i64 %b1, %blocks
  br i1 %again, label %block, label %next
next:
  %p1 = add i64 %p, 1
  %more = icmp slt i64 %p1, %pieces
  br i1 %more, label %piece, label %exit
exit:
  br i1 %nt, label %fence, label %done
fence:                                  ; streaming stores are weakly ordered: visible before return
  fence seq_cst
  br label %done
done:
  ret void
}

!0 = !{i32 1}
""".replace("MIN_STREAMED", str(MIN_STREAMED))

Loop = Callable[[int, int, int, int, int, int, int], None]


def _cache_share(level: int) -> int:
    """A CPU's share of its data (or unified) cache at ``level``, in bytes, from sysfs; 0 if unknown."""
    for d in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            if (d / "type").read_text().strip() == "Instruction" or int((d / "level").read_text()) != level:
                continue
            return _size((d / "size").read_text().strip()) // _count_cpus((d / "shared_cpu_list").read_text().strip())
        except (OSError, ValueError, KeyError):
            continue
    return 0


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def _count_cpus(text: str) -> int:
    n = 0
    for part in text.split(","):
        a, _, b = part.partition("-")
        n += int(b or a) - int(a) + 1
    return n


# A batch this long is written with streaming stores: more than a CPU's share of its L2 (1 MiB
# where sysfs does not say) cannot stay in the copying core's own cache.
STREAM_BYTES = _cache_share(2) or 1 << 20


@functools.cache
def _compiled() -> tuple[Loop, object] | None:
    """The loop as a C function (and the engine that owns its code), or None without llvmlite."""
    try:
        return build(LOOP_IR)
    except ImportError:
        log.info("transfer: llvmlite is not installed; the CPU engine copies a piece at a time from Python")
    except (RuntimeError, OSError) as exc:  # no JIT for this CPU, no LLVM library: the Python loop copies
        log.warning("transfer: the native copy loop could not be built (%s); copying from Python", exc)
    return None


def build(ir: str) -> tuple[Loop, object]:
    """Compile ``ir`` for this CPU: its ``run_plan`` as a C function, and the engine owning the code."""
    import llvmlite.binding as llvm

    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    module = llvm.parse_assembly(ir)
    module.verify()
    machine = llvm.Target.from_default_triple().create_target_machine(
        cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten(), opt=3)
    engine = llvm.create_mcjit_compiler(module, machine)
    engine.finalize_object()
    fn = ctypes.CFUNCTYPE(None, *[ctypes.c_int64] * 7)(engine.get_function_address("run_plan"))
    return fn, engine  # a foreign call: ctypes releases the GIL for it


def available() -> bool:
    return _compiled() is not None


def plan_table(plan: Sequence[Piece]) -> np.ndarray:
    """The plan as the loop's table: int64 ``[4, pieces]`` (src, stride, nbytes, slot_off)."""
    return np.array([[p.src for p in plan], [p.stride for p in plan], [p.nbytes for p in plan],
                     [p.slot_off for p in plan]], dtype=np.int64).reshape(4, len(plan))


def run(table: np.ndarray, block_ids: np.ndarray, addresses: np.ndarray, *, to_slots: bool, stream: bool,
        loop: Loop | None = None) -> None:
    """Execute the plan ``table`` (:func:`plan_table`): block ``block_ids[i]`` <-> the slot at
    ``addresses[i]``, with streaming stores when ``stream``, by ``loop`` (default: :data:`LOOP_IR`
    compiled). The caller has checked the ids against the cache and the slots' sizes."""
    if loop is None:
        native = _compiled()
        if native is None:
            raise RuntimeError("the native copy loop is not available (llvmlite)")
        loop = native[0]
    tab = np.ascontiguousarray(table, dtype=np.int64)
    ids = np.ascontiguousarray(block_ids, dtype=np.int64)
    addr = np.ascontiguousarray(addresses, dtype=np.int64)
    if tab.ndim != 2 or tab.shape[0] != 4 or ids.shape != addr.shape or ids.ndim != 1:
        raise ValueError(f"native copy: a [4, pieces] table and as many ids as slots, got {tab.shape},"
                         f" {ids.shape} ids, {addr.shape} slots")
    loop(int(tab.ctypes.data), tab.shape[1], int(ids.ctypes.data), int(addr.ctypes.data), len(ids), int(to_slots),
         int(stream))
