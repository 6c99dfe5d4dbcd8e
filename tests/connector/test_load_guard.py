"""The guard that lets a load skip the hash (``connector/roles/guard.py``, ``kvstore/dram/protect.py``):
a client maps the sidecar's slab read-only, so a stray write of the engine process into a sealed
slot faults instead of changing it; only its own allocations' slots are writable, until their
Commit or Abort. Where the slab cannot be kept read-only, loads fall back to hashing and still
refuse a corrupted slot. Real sidecar processes, real slab, a real fault."""

from __future__ import annotations

import ctypes
import errno
import mmap
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import serve_args
from paged_cases import NS, PROMPT, SPEC, caches
from test_connector_held_leases import held_load
from test_verified_load import scribble, sealed_load

from connector.roles import WorkerConnector
from connector.roles.guard import in_force, must_hash
from connector.roles.metadata import Failure, SaveSpec
from connector.roles.ops import load_blocks, save_blocks
from connector.transfer.engines import DONE, Completion, NumpyTransfer, bind_caches
from connector.vllm.config import Settings
from kvstore.client import SyncClient
from kvstore.dram import protect
from kvstore.dram.protect import PAGE, ReadOnlyMapping, pages_whole, protection, runs
from kvstore.dram.slab import attach, read_only, reclaimed_in
from kvstore.errors import FailedPrecondition, InvalidArgument
from kvstore.harness.sidecar import REPO, ServeProcess
from kvstore.keys import prefix_keys
from kvstore.store.books.retention import MAX_RETAIN_MS

# A process that acquires the sealed block at keys[0] and writes into it through its own mapping
# of the slab, as a bad pointer of the engine would; it prints "wrote" if the write went through.
SCRIBBLER = """
import sys
from kvstore.client import SyncClient
from kvstore.dram.slab import attach
from paged_cases import NS, PROMPT
from kvstore.keys import prefix_keys

with SyncClient(sys.argv[1]) as c, c.acquire(NS, prefix_keys(NS, PROMPT)[:1]) as lease:
    slot = lease.slots[0]
    assert lease.checksums[0], "not sealed"
    attach(slot.segment)[slot.offset + slot.length // 2] ^= 0xFF
    print("wrote", flush=True)
"""


LIBC = protect._libc


def address(slot) -> int:
    return int(attach(slot.segment).__array_interface__["data"][0]) + slot.offset


def test_a_write_into_a_sealed_slot_through_a_clients_mapping_faults(client, sidecar_process) -> None:
    src, ids, load = sealed_load(client)
    client.release(load.lease.id)
    here = Path(__file__).parent
    p = subprocess.run([sys.executable, "-c", SCRIBBLER, sidecar_process.url], capture_output=True, text=True,
                       cwd=REPO, env={"PYTHONPATH": f"{REPO}:{here}", "PATH": "/usr/bin:/bin"}, timeout=120,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_CORE, (0, 0)))  # no core file
    assert "wrote" not in p.stdout, "the write into a sealed slot went through"
    assert p.returncode == -signal.SIGSEGV, p.stderr
    worker = WorkerConnector(client, NS, SPEC, load_guard="hash")  # hash it anyway: byte-exact as sealed
    dst = caches(2)
    worker.register_kv_caches(dst)
    again = held_load(client)
    [r] = worker.load_now([again])
    client.release(again.lease.id)
    worker.close()
    assert r.ok and r.loaded == 6
    for layer in range(SPEC.num_layers):
        np.testing.assert_array_equal(dst[layer][list(again.block_ids)], src[layer][ids])


def test_only_an_allocations_own_slots_are_writable_until_it_ends(client) -> None:
    seg = client.hello().segment
    attach(seg)
    assert read_only(seg) is not None and in_force("read_only", seg) == "read_only"
    assert not must_hash("read_only", [seg]) and must_hash("hash", [seg]) and must_hash("read_only", None)
    _, _, load = sealed_load(client)
    sealed = address(load.lease.slots[0])
    client.release(load.lease.id)
    for n, end in enumerate(("commit", "abort")):
        keys = [bytes([n, i]) * 16 for i in range(3)]
        with client.allocate(NS, keys, [1000] * 3) as alloc:
            refs = list(alloc.slot_refs().values())
            assert [protection(address(r))[:2] for r in refs] == ["r-"] * 3  # until this process writes them
            views = [v for _, v in alloc.writable()]
            assert [protection(address(r))[:2] for r in refs] == ["rw"] * 3
            assert protection(sealed)[:2] == "r-"
            for view in views:
                view[:] = 7
            alloc.commit() if end == "commit" else alloc.abort()
            assert [protection(address(r))[:2] for r in refs] == ["r-"] * 3, end


class DeviceLike(NumpyTransfer):
    """A transfer that pins the slab and writes slots by DMA, as ``CupyTransfer`` does: it records
    the CPU's permissions on what it registers and on the slots it is given to write, and writes
    nothing through the CPU (which would fault: a device does not need the CPU's mapping)."""

    pins_host = True

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, str]] = []

    def register(self, host, page_bytes: int = 0) -> None:
        self.seen.append(("register", protection(int(host.__array_interface__["data"][0]))[:2]))

    def gather(self, kv, block_ids, slots) -> Completion:
        self.seen += [("gather", protection(int(v.__array_interface__["data"][0]))[:2]) for v in slots]
        return DONE


def test_a_device_save_leaves_the_cpu_mapping_read_only(client) -> None:
    """Pinning needs the whole slab writable once (lifted for the registration, restored after);
    a save by a device's DMA never makes the CPU's mapping of its slots writable."""
    t = DeviceLike()
    worker = WorkerConnector(client, NS, SPEC, transfer=t)
    worker.register_kv_caches(caches(1))
    seg = client.hello().segment
    assert t.seen == [("register", "rw")]
    assert protection(int(attach(seg).__array_interface__["data"][0]))[:2] == "r-"
    r = save_blocks(client, NS, worker.kv, t, SaveSpec("s", tuple(prefix_keys(NS, PROMPT)[:3]), (1, 2, 3)))
    worker.close()
    assert r.written == 3 and t.seen[1:] == [("gather", "r-")] * 3


def test_runs_cover_whole_pages_and_merge_neighbours() -> None:
    assert runs([(2 * PAGE, 100), (0, PAGE), (PAGE, PAGE)]) == [(0, 3 * PAGE)]
    assert runs([(0, 10), (4 * PAGE, PAGE + 1)]) == [(0, PAGE), (4 * PAGE, 6 * PAGE)]
    assert pages_whole(4 << 20, PAGE) and not pages_whole(4 << 20, PAGE // 2) and not pages_whole(4 << 20, 0)


@pytest.fixture
def small_slots(tmp_path: Path) -> Iterator[SyncClient]:
    """A sidecar whose smallest slots are half an OS page: two share a page, so its slab cannot
    be kept read-only slot by slot, and loads from it hash."""
    sc = ServeProcess(serve_args(tmp_path / "kvstore-data"), env={"KVSTORE_DRAM__MIN_SLOT_BYTES": str(PAGE // 2)})
    try:
        with SyncClient(sc.grpc) as c:
            yield c
    finally:
        sc.stop()


def test_a_slab_that_cannot_be_kept_read_only_falls_back_to_hashing(small_slots) -> None:
    client = small_slots
    seg = client.hello().segment
    attach(seg)
    assert read_only(seg) is None and in_force("read_only", seg) == "hash"
    _, _, load = sealed_load(client)
    slot = load.lease.slots[2]
    attach(slot.segment)[slot.offset + 9] ^= 0xFF  # through this process's own (read-write) mapping
    worker = WorkerConnector(client, NS, SPEC)  # load_guard as shipped
    worker.register_kv_caches(caches(2))
    [r] = worker.load_now([load])
    client.release(load.lease.id)
    worker.close()
    assert (r.loaded, r.failure) == (2, Failure.CHECKSUM)


def test_the_setting_names_the_guard() -> None:
    assert Settings().load_guard == "read_only" and Settings().verify_checksums
    assert Settings.from_extra({"load_guard": "hash"}).load_guard == "hash"
    with pytest.raises(ValueError, match="load_guard"):
        Settings.from_extra({"load_guard": "none"})
    with pytest.raises(Exception, match="load_guard"):
        WorkerConnector(None, NS, SPEC, load_guard="crc")  # type: ignore[arg-type]


def test_a_slab_a_gpu_transfer_first_sees_on_a_request_is_writable_while_it_is_pinned(client, monkeypatch) -> None:
    """A slab not registered at start (a sidecar restarted: a new segment, attached read-only here)
    is pinned on the request's path by ``CupyTransfer``: writable for the registration (pinning for
    a device's writes needs it), read-only again after. (Before, it was pinned read-only: on a GPU
    the registration fails and every save and load on that slab with it, found by a review.)"""
    from connector.transfer.cuda import CupyTransfer
    from tests.support.cuda_streams import installed

    with installed(monkeypatch):
        t = CupyTransfer()
        seen: list[str] = []
        register = t._pinned.register

        def spy(start: int, size: int, page_bytes: int) -> None:
            seen.append(protection(start)[:2])
            register(start, size, page_bytes)

        monkeypatch.setattr(t._pinned, "register", spy)
        mem = attach(client.hello().segment)
        assert read_only(client.hello().segment) is not None and protection(int(mem.ctypes.data))[:2] == "r-"
        try:
            t._pin_missing([mem[:PAGE]], np.array([int(mem.ctypes.data)], np.int64), PAGE)
        finally:
            t.close()
        assert seen == ["rw"]
        assert protection(int(mem.ctypes.data))[:2] == "r-"


def test_an_allocation_reclaimed_unfinished_makes_loads_from_its_slab_hash(client) -> None:
    """A writer stalled past its ``ttl_ms`` may still hold its slots' pages writable here or in its
    own process, and write them after the sidecar handed them out again and they were sealed: from
    the first allocation reclaimed unfinished, loads from that slab hash under ``read_only`` too.
    (Before, they copied unhashed what such a late write left; found by a review.)"""
    seg = client.hello().segment
    attach(seg)
    assert not must_hash("read_only", [seg]) and reclaimed_in(seg) == 0
    keys = prefix_keys(NS, PROMPT)[:2]
    alloc = client.allocate(NS, keys, PAGE, ttl_ms=10).__enter__()
    for _, view in alloc.writable():
        view[:] = 7  # written, never committed: the sidecar reclaims it
    while not reclaimed_in(seg):  # (the reaper's next pass; a state, not a time, is awaited)
        time.sleep(0.05)
    assert must_hash("read_only", [seg]) and in_force("read_only", seg) == "hash"
    alloc.abort()  # (already reclaimed: its pages read-only again here)


class FailingLibc:
    """libc, but its ``nth`` mprotect from now fails with ENOMEM (as at ``vm.max_map_count``);
    ``partway``: after changing the range all the same (as one can stop partway through it)."""

    def __init__(self, nth: int, partway: bool = False) -> None:
        self.nth, self.calls, self.partway = nth, 0, partway

    def mprotect(self, address: int, size: int, prot: int) -> int:
        self.calls += 1
        if self.calls == self.nth:
            if self.partway:
                LIBC.mprotect(address, size, prot)
            ctypes.set_errno(errno.ENOMEM)
            return -1
        return LIBC.mprotect(address, size, prot)


@pytest.mark.parametrize("fails", ["open", "close"])
def test_an_mprotect_that_fails_makes_loads_from_the_slab_hash(client, monkeypatch, fails: str) -> None:
    """An mprotect of this process's read-only mapping fails (``open``: making an allocation's
    slots writable; ``close``: making them read-only again, at its Commit): its pages may be
    writable with nothing tracking them, so the call raises a clear error and loads from that slab
    hash from then on: a sealed slot changed meanwhile is refused under ``read_only``. (Before, the
    error left the mapping counted as read-only: the changed slot was copied unhashed.)"""
    _, _, load = sealed_load(client)
    seg = load.lease.slots[0].segment
    assert read_only(seg) is not None and not must_hash("read_only", [seg])
    keys = [bytes([9, i]) * 16 for i in range(2)]
    with client.allocate(NS, keys, [PAGE] * 2) as alloc:
        if fails == "close":
            for _, view in alloc.writable():
                view[:] = 7
        monkeypatch.setattr(protect, "_libc", FailingLibc(1))
        with pytest.raises(OSError, match="Cannot allocate memory") as info:
            list(alloc.writable()) if fails == "open" else alloc.commit()
        monkeypatch.setattr(protect, "_libc", LIBC)
        assert must_hash("read_only", [seg]) and in_force("read_only", seg) == "hash"
        if fails == "open":  # (the allocation is intact: aborted on leaving)
            assert [protection(address(r))[:2] for r in alloc.slot_refs().values()] == ["r-"] * 2
    scribble(load, 2)
    dst = caches(2)
    r = load_blocks(client, NS, bind_caches(SPEC, dst), NumpyTransfer(), load, verify=True, guard="read_only")
    client.release(load.lease.id)
    assert (r.loaded, r.failure) == (2, Failure.CHECKSUM)
    assert "loads from this slab hash" in str(info.value)  # (the error says so)


def test_writable_after_a_refused_commit_is_a_clear_error(client) -> None:
    """A Commit the sidecar refuses (a retain hint out of range) leaves the allocation open there,
    but its slots read-only here: ``writable()`` again is FailedPrecondition, not a view whose first
    write faults (SIGSEGV); a Commit of what was written still goes through."""
    keys = [bytes([8, i]) * 16 for i in range(2)]
    with client.allocate(NS, keys, [PAGE] * 2) as alloc:
        for _, view in alloc.writable():
            view[:] = 7
        with pytest.raises(InvalidArgument, match="retain_ms"):
            alloc.commit(retain=(MAX_RETAIN_MS + 1, 0))
        assert [protection(address(r))[:2] for r in alloc.slot_refs().values()] == ["r-"] * 2
        with pytest.raises(FailedPrecondition, match="read-only here"):
            next(alloc.writable())
        assert alloc.commit() == 2
    assert [g.tobytes() for g in client.get_blocks(NS, keys)] == [bytes([7]) * PAGE] * 2


def test_a_reprotect_that_fails_after_pinning_leaves_the_open_runs_writable(monkeypatch) -> None:
    """``unprotected()`` (the whole mapping writable while a device pins it) ends with the mapping
    read-only again but for the open runs: when making it read-only fails partway, the open runs
    are still made writable again (their writers write on; a write would fault otherwise), the
    mapping is no longer intact, and the error says loads hash. (Before, the failure skipped the
    open runs: an allocation being written was left read-only.)"""
    buf = mmap.mmap(-1, 4 * PAGE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    m = ReadOnlyMapping(base, 4 * PAGE)
    try:
        m.open([(PAGE, PAGE)])
        monkeypatch.setattr(protect, "_libc", FailingLibc(2, partway=True))  # 1: all rw; 2: all r-, "fails"
        with pytest.raises(OSError, match="Cannot allocate memory") as info, m.unprotected():
            pass
        monkeypatch.setattr(protect, "_libc", LIBC)
        assert protection(base + PAGE)[:2] == "rw"  # the open run: its writer writes on
        assert protection(base)[:2] == "r-" and not m.intact
        assert "loads from this slab hash" in str(info.value)
    finally:
        protect.mprotect(base, 4 * PAGE, writable=True)
        buf.close()
