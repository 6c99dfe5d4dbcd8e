"""The suite's leak check (issue #21 item 3): every test must leave the pytest process as it found it.

A pytest plugin (``tests/conftest.py`` loads it with ``pytest_plugins``; another run can load it
with ``-p tests.leaks``). It fails a test -- an error at its teardown -- that leaves behind,
compared with just before the test's setup:

* **shm**: POSIX shared-memory segments, entries of /dev/shm, that this session made: a slab name
  (``<prefix>-<pid>-<8 hex>``, :class:`kvstore.dram.slab.Slab`) whose pid is this process or one it
  started, or a segment this process created with ``multiprocessing.shared_memory``;
* **fds**: open file descriptors of this process (/proc/self/fd), named by their target (a socket
  also by its addresses, from /proc/net);
* **threads**: ``threading.enumerate()``, named by thread name and target;
* **processes**: processes this session started that are still alive (not zombies): children and
  grandchildren of this process, and also orphans -- every process started here inherits
  ``KVSTORE_LEAK_SESSION=<pid>-<start>`` in its environment, so a server's worker re-parented to
  init when the server was killed is still found; named by pid and command line;
* **tmp**: entries in the system temp dir (``tempfile.gettempdir()``) whose name starts with one
  of :data:`TMP_PREFIXES`, created during the test by this process (seen by an audit hook:
  ``tempfile.mkstemp``/``mkdtemp``, ``open`` with O_CREAT, ``os.mkdir``, a Unix socket's
  ``bind``) or carrying the pid of a process this session started (the local socket
  ``kvstore-<segment>.sock``); pytest's ``tmp_path`` lives elsewhere and is not looked at;
* **sidecars**: an in-process :class:`kvstore.server.sidecar.Sidecar` started during the test and
  still running at its end (a leak in itself), or, for one that a broader-scoped fixture runs,
  leases or allocations it did not hold before the test (or when its fixture was set up).

What belongs to a broader-scoped fixture is not a leak of the test that happened to set it up:

1. The window opens in a ``pytest_runtest_setup`` hook wrapper, before any fixture of the test is
   set up, and closes in a ``pytest_runtest_teardown`` wrapper, after every function-scoped
   fixture (an async test's event loop included) is torn down -- a hook rather than an autouse
   fixture, so no fixture, whatever the order pytest gives it, sits outside the window.
2. Each session/package/module/class-scoped fixture's setup is wrapped (``pytest_fixture_setup``):
   what appears between its start and end is that fixture's and is excused until the fixture is
   finalized (``pytest_fixture_post_finalizer``). Then it must be gone at the end of that teardown
   ("left behind by fixture X"), so a session fixture that does not stop its server fails too.
3. What a live broader-scoped fixture's value reaches (a walk of its object graph: a ``Popen``,
   a thread, a socket or file, a ``Path`` in the temp dir, a ``Sidecar``) is its own, even when it
   was made during a test: ``redis_single.stop(); redis_single.start()`` in a fault test restarts a
   session server under a new pid. A process whose parent (or any ancestor) existed before the test
   or is owned this way belongs to that ancestor (chromium's renderers under the playwright driver).

Things other processes of the machine do (another pytest run, an engineer's sidecar) are not
counted: a segment or temp entry counts only when it is attributed to this session as above; one
made by a grandchild that has since exited, under a name without a pid, is not seen (the
grandchild itself would have been, had it outlived the test).

Leaks are looked for at once; only if some are found is the rest done (most tests leave nothing,
and a full collection in a process that has imported torch takes half a second): what the live
broader-scoped fixtures reach is claimed (3. above), ``gc.collect()`` runs (an unreferenced
socket or channel is closed by it), then ``gc.unfreeze()`` and another collection (an in-process
``Sidecar.start()`` calls ``gc.freeze()``, and frozen garbage is never collected), and then the
check is repeated every 50 ms for up to :data:`GRACE_S` seconds (``KVSTORE_LEAK_GRACE_S``) while
something remains: a thread that has been told to stop, a killed process not yet reaped by the
kernel, a gRPC socket closed on its core's thread, all get the time to go.

A test that failed already gets its leak report as a report section, not a second error.

Opting out: ``@pytest.mark.leaks_allowed("why")``, optionally ``kinds=("threads", ...)`` (any of
:data:`KINDS`) to excuse only some; the reason is required. What a test was allowed to leave is
part of the next test's "before", so it is never blamed on another test.

Allowances (process-wide things made once, by design; each is matched exactly, not by a count):
see :data:`THREAD_ALLOW` and :func:`_process_wide`.
"""

from __future__ import annotations

import contextlib
import gc
import io
import os
import re
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

KINDS = ("shm", "fds", "threads", "processes", "tmp", "sidecars")
GRACE_S = float(os.environ.get("KVSTORE_LEAK_GRACE_S", "5"))  # how long what is on its way out may take
ENV_MARKER = "KVSTORE_LEAK_SESSION"
SHM_DIR = "/dev/shm"
# Names of the temp entries the project makes (kvstore.harness: kvstore-serve-*.log, kvstore-redis-*,
# kvstore-cluster-*; kvstore.wire.framing: kvstore-<segment>.sock; the tests: kvstore-perm-*, kvstore-hosts-*;
# benchmarks: kvstore-bench-*, lmcache-bench-*), and tempfile's default "tmp" for a bare mkdtemp() made
# by this process.
TMP_PREFIXES = ("kvstore", "kvs", "lmcache-bench", "tmp")
SLAB_NAME = re.compile(r"-(\d+)-[0-9a-f]{8}(?:\.sock)?$")  # kvstore.dram.slab.Slab: f"{prefix}-{pid}-{uuid8}"

# Threads that kvstore makes once per process and keeps by design (module-level pools, never shut
# down; their threads are started lazily, up to the pool's size, by whichever test first needs one).
THREAD_ALLOW: dict[str, str] = {
    r"kvstore-hash_\d+": "kvstore/checksum.py: the process-wide checksum pool (HASH_THREADS), "
                         "module-level, so no block hashing waits for a pool to start",
    r"kvstore-copy_\d+": "kvstore/dram/copying.py: the process-wide slot copy pool (COPY_THREADS), "
                         "module-level, shared by every client of every slab in the process",
    r"kvstore-peer-(fetch|send)_\d+": "kvstore/wire/peer.py: the process-wide peer data path I/O "
                                     "pools (FETCHING, SENDING: IO_THREADS each), module-level, where every "
                                     "node's fetches and answers move",
}
_THREAD_ALLOW = [re.compile(p) for p in THREAD_ALLOW]


# --- snapshots -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    start: int  # clock ticks since boot: (pid, start) names one process even after its pid is reused
    zombie: bool
    marked: bool  # carries this session's ENV_MARKER

    @property
    def key(self) -> tuple[int, int]:
        return (self.pid, self.start)


@dataclass
class Snapshot:
    shm: set[str]
    fds: dict[int, str]
    threads: dict[int, threading.Thread]  # id(thread) -> thread (the objects, so ids are not reused)
    procs: dict[tuple[int, int], Proc]  # this session's live processes
    tmp: set[str]
    sidecars: dict[int, tuple[Any, frozenset[str], frozenset[str]]]  # id -> (sidecar, lease ids, allocation ids)
    created: int  # len(_created) at the time: temp paths this process made after it are _created[created:]


@dataclass
class Owned:
    """Resources a broader-scoped fixture owns (or, in a report, what leaked)."""

    shm: set[str] = field(default_factory=set)
    fds: set[tuple[int, str]] = field(default_factory=set)
    threads: set[int] = field(default_factory=set)
    procs: set[tuple[int, int]] = field(default_factory=set)
    pids: set[int] = field(default_factory=set)  # from Popen objects: matched by pid alone
    tmp: set[str] = field(default_factory=set)
    sidecars: set[int] = field(default_factory=set)
    # an owned sidecar's leases and allocations when its fixture was set up: a test's new ones count
    held: dict[int, tuple[frozenset[str], frozenset[str]]] = field(default_factory=dict)

    def update(self, other: Owned) -> None:
        for name in ("shm", "fds", "threads", "procs", "pids", "tmp", "sidecars", "held"):
            getattr(self, name).update(getattr(other, name))


_session = f"{os.getpid()}-{time.monotonic_ns()}"
_created: list[str] = []  # temp-dir paths this process created (audit hook), in order
_spawned: set[int] = {os.getpid()}  # pids this process started (Popen, multiprocessing) and itself
_own_shm: set[str] = set()  # shared_memory segments this process created
_sidecars: weakref.WeakSet[Any] = weakref.WeakSet()  # every in-process Sidecar started
_serve_logs: set[str] = set()  # kvstore.harness.sidecar.ServeProcess logs (see _process_wide)
_tmpdirs: set[str] = set()


def _tmpdir_names() -> set[str]:
    d = tempfile.gettempdir()
    return {d, os.path.realpath(d)}


def _proc_starttime(stat: str) -> tuple[int, int, str]:
    """(ppid, starttime, state) from a /proc/<pid>/stat line."""
    rest = stat[stat.rindex(")") + 2:].split()
    return int(rest[1]), int(rest[19]), rest[0]


def _scan_procs() -> dict[tuple[int, int], Proc]:
    """This session's live processes: every descendant of this process, and every process that
    carries the session marker in its environment (orphans included). Plain /proc reads (psutil,
    where installed, reads the same files; this is the one walk the check makes per test)."""
    me = os.getpid()
    marker = f"{ENV_MARKER}={_session}".encode()
    info: dict[int, Proc] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        if pid == me:
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid, start, state = _proc_starttime(f.read())
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    marked = marker in f.read().split(b"\0")
            except OSError:  # a kernel thread, or gone
                marked = False
        except (OSError, ValueError, IndexError):
            continue
        info[pid] = Proc(pid, ppid, start, state in ("Z", "X"), marked)
    children: dict[int, list[int]] = {}
    for p in info.values():
        children.setdefault(p.ppid, []).append(p.pid)
    ours: set[int] = set()
    stack = [me] + [p.pid for p in info.values() if p.marked]
    while stack:
        pid = stack.pop()
        for c in children.get(pid, ()):
            if c not in ours:
                ours.add(c)
                stack.append(c)
    ours.update(p.pid for p in info.values() if p.marked)
    return {info[p].key: info[p] for p in ours if p in info}


def _fds() -> dict[int, str]:
    out: dict[int, str] = {}
    fd_dir = "/proc/self/fd"
    for name in os.listdir(fd_dir):
        with contextlib.suppress(OSError):
            out[int(name)] = os.readlink(f"{fd_dir}/{name}")
    # the listing's own descriptor, closed by now (its readlink failed) or naming the fd directory
    return {fd: t for fd, t in out.items() if not t.startswith(("/proc/self/fd", f"/proc/{os.getpid()}/fd"))}


def _listdir(path: str) -> set[str]:
    try:
        return set(os.listdir(path))
    except OSError:
        return set()


def _tmp_entries() -> set[str]:
    d = tempfile.gettempdir()
    return {os.path.join(d, n) for n in _listdir(d) if n.startswith(TMP_PREFIXES)}


def _sidecar_state() -> dict[int, tuple[Any, frozenset[str], frozenset[str]]]:
    out = {}
    for sc in list(_sidecars):
        if _sidecar_running(sc):
            index = getattr(getattr(sc, "store", None), "index", None)
            leases = frozenset(getattr(index, "leases", {}) or {})
            allocs = frozenset(getattr(index, "allocations", {}) or {})
            out[id(sc)] = (sc, leases, allocs)
    return out


def _sidecar_running(sc: Any) -> bool:
    stopped = getattr(sc, "_stopped", None)
    return stopped is not None and not stopped.is_set()


def snapshot() -> Snapshot:
    return Snapshot(
        shm=_listdir(SHM_DIR),
        fds=_fds(),
        threads={id(t): t for t in threading.enumerate()},
        procs=_scan_procs(),
        tmp=_tmp_entries(),
        sidecars=_sidecar_state(),
        created=len(_created),
    )


# --- what is new, attributed to this session ---------------------------------------------------------


def _known_pids(*snaps: Snapshot) -> set[int]:
    pids = set(_spawned)
    for s in snaps:
        pids.update(p.pid for p in s.procs.values())
    return pids


def _ours_by_name(name: str, pids: set[int]) -> bool:
    m = SLAB_NAME.search(name)
    return m is not None and int(m.group(1)) in pids


def diff(before: Snapshot, after: Snapshot, exempt: Owned) -> Owned:
    """What ``after`` has that ``before`` had not, this session's, less ``exempt`` and the
    process-wide allowances."""
    pids = _known_pids(before, after)
    wide = _process_wide()
    new = Owned()
    new.shm = {
        n for n in after.shm - before.shm
        if (n in _own_shm or _ours_by_name(n, pids)) and n not in exempt.shm
    }
    new.fds = {
        (fd, t) for fd, t in after.fds.items()
        if before.fds.get(fd) != t and (fd, t) not in exempt.fds and (fd, t) not in wide.fds
    }
    new.threads = {
        i for i, t in after.threads.items()
        if i not in before.threads and t.is_alive() and i not in exempt.threads and i not in wide.threads
        and not any(p.fullmatch(t.name) for p in _THREAD_ALLOW)
    }
    # a process belongs to the first of its ancestors that existed before or is owned; only those
    # whose line up to this process is all new are the test's
    old_pids = {p.pid for p in before.procs.values()} | exempt.pids | {p[0] for p in exempt.procs} | wide.pids
    by_pid = {p.pid: p for p in after.procs.values()}

    def owned_line(p: Proc) -> bool:
        seen = 0
        while p is not None and seen < 64:
            if p.pid in old_pids or p.key in before.procs or p.key in exempt.procs:
                return True
            p = by_pid.get(p.ppid)  # type: ignore[assignment]
            seen += 1
        return False

    new.procs = {k for k, p in after.procs.items() if not p.zombie and not owned_line(p)}
    created = {os.path.normpath(c) for c in _created[before.created:after.created]}
    new.tmp = {
        e for e in after.tmp - before.tmp
        if (e in created or _ours_by_name(os.path.basename(e), pids))
        and e not in exempt.tmp and e not in wide.tmp
    }
    new.sidecars = set()
    for i, (_sc, leases, allocs) in after.sidecars.items():
        if i in before.sidecars:
            _, old_leases, old_allocs = before.sidecars[i]
        elif i in exempt.sidecars:  # a broader-scoped fixture's, started during this test's setup
            old_leases, old_allocs = exempt.held.get(i, (frozenset(), frozenset()))
        else:  # started by the test and still running
            new.sidecars.add(i)
            continue
        if leases - old_leases or allocs - old_allocs:
            new.sidecars.add(i)
    return new


def still_there(owned: Owned, now: Snapshot) -> Owned:
    """Which of a finalized fixture's resources ``now`` still has."""
    wide = _process_wide()
    left = Owned()
    left.shm = owned.shm & now.shm
    left.fds = {(fd, t) for fd, t in owned.fds if now.fds.get(fd) == t and (fd, t) not in wide.fds}
    left.threads = {
        i for i in owned.threads
        if i in now.threads and now.threads[i].is_alive() and i not in wide.threads
        and not any(p.fullmatch(now.threads[i].name) for p in _THREAD_ALLOW)
    }
    left.procs = {k for k in owned.procs if k in now.procs and not now.procs[k].zombie and k[0] not in wide.pids}
    left.tmp = {e for e in owned.tmp if os.path.lexists(e)} - wide.tmp
    left.sidecars = {i for i in owned.sidecars if i in now.sidecars}
    return left


def _with_pids(o: Owned, snap: Snapshot) -> Owned:
    """``o`` with its processes' pids too (reachability finds a Popen by pid alone)."""
    out = Owned()
    out.update(o)
    out.pids = {k[0] for k in o.procs} | {p.pid for p in snap.procs.values()}
    return out


def _intersect(found: Owned, candidates: Owned) -> Owned:
    """What of ``found`` is among ``candidates``; a pid found claims its process (by key) and,
    through the ancestor rule of :func:`diff`, the processes under it."""
    out = Owned()
    out.shm = found.shm & candidates.shm
    out.fds = found.fds & candidates.fds
    out.threads = found.threads & candidates.threads
    out.tmp = found.tmp & candidates.tmp
    out.sidecars = found.sidecars & candidates.sidecars
    out.procs = {k for k in candidates.procs if k[0] in found.pids}
    out.pids = found.pids & candidates.pids
    return out


def empty(o: Owned) -> bool:
    return not (o.shm or o.fds or o.threads or o.procs or o.tmp or o.sidecars)


def _process_wide() -> Owned:
    """Descriptors, processes and files that exist once per process by design, matched exactly:

    * multiprocessing's resource tracker: Python 3.11's ``shared_memory.SharedMemory`` starts it on
      first use (one child process, ``from multiprocessing.resource_tracker import main``, and the
      pipe to it, kept for the process's life); kvstore.dram.slab creates and attaches segments.
    * PRODUCT DEFECT kvstore/dram/slab.py:273-303 (``attach``): a segment attached in this process
      is cached in ``_attached`` for the process's life; nothing ever detaches it, so a client that
      attached the slab of a sidecar that has since stopped keeps the ``SharedMemory`` open -- its fd
      on ``/dev/shm/<segment> (deleted)`` and its mapping, which keeps the unlinked segment's pages
      (the whole slab, prefaulted by ``_prefault``) allocated. Here: one fd (and up to the slab's
      size in memory) per subprocess sidecar a test attached. Allowed by exactly those fds.
    * PRODUCT DEFECT kvstore/harness/sidecar.py:26-28 (``ServeProcess``): its stderr log is a
      ``NamedTemporaryFile(prefix="kvstore-serve-", delete=False)`` that nothing removes (``stop()``
      closes it, ``logs()`` reads it afterwards): one /tmp/kvstore-serve-*.log per ``kvstore serve``
      a test starts. Allowed by exactly the paths ServeProcess created (tests/conftest.py's
      ``serve_process`` fixture removes the ones it starts).
    * a slab closed while a view of its mapping is still alive (``Slab.close``,
      ``kvstore.dram.slab._close_when_unexported``): its SharedMemory cannot close yet, so it keeps
      its fd (and its mapping's) until the last view is gone and the next garbage collection closes
      it. Seen when a tier goes down during a test: the warning (kvstore/movers/tiering.py:211 logs the
      exception object as an argument) is kept by pytest's log capture until the test ends, its
      traceback's frames hold slot views, and the in-process sidecar stops while they are alive.
      Allowed by exactly the fds on a slab this process created and has since closed and unlinked
      (``/dev/shm/<name> (deleted)``, no longer in ``_owned``).
    * the CUDA driver's device files (``/dev/nvidia*``): opened by the first CUDA call, kept for the
      process's life; its eventfds and pipes are made part of a GPU test's "before" (``_init_cuda``).
    * tqdm's monitor threads (``TMonitor``, one per tqdm class), and ``threading._DummyThread``
      entries: see the comments in the code.
    """
    wide = Owned()
    fds = _fds()
    from multiprocessing import resource_tracker

    tracker = getattr(resource_tracker, "_resource_tracker", None)
    fd = getattr(tracker, "_fd", None)
    if isinstance(fd, int) and fd in fds:
        wide.fds.add((fd, fds[fd]))
    pid = getattr(tracker, "_pid", None)
    if isinstance(pid, int):
        wide.pids.add(pid)
    # two descriptors per segment: SharedMemory's own and the duplicate its mmap keeps
    slab = sys.modules.get("kvstore.dram.slab")
    attached = {f"{SHM_DIR}/{name}" for name in list(getattr(slab, "_attached", {}))}
    attached |= {f"{t} (deleted)" for t in attached}
    wide.fds.update((fd, t) for fd, t in fds.items() if t in attached)
    # the fds of an in-process slab that has been closed and unlinked, still open while a view of it
    # is alive (seen above)
    owned_now = set(getattr(slab, "_owned", {}))
    closed = {f"{SHM_DIR}/{n} (deleted)" for n in _own_shm if n not in owned_now and _ours_by_name(n, {os.getpid()})}
    wide.fds.update((fd, t) for fd, t in fds.items() if t in closed)
    # tqdm's monitor threads: one per tqdm class (the class attribute ``monitor``: tqdm's own, and
    # subclasses such as huggingface_hub's), started with its first progress bar (benchmarks.*,
    # kvstore.sim.replay, transformers saving the tiny model) and, in this tqdm, never stopped
    monitor_cls = getattr(sys.modules.get("tqdm._monitor"), "TMonitor", None)
    if isinstance(monitor_cls, type):
        wide.threads.update(id(t) for t in threading.enumerate() if isinstance(t, monitor_cls))
    # threads Python did not start: a C library's own thread that called into Python (gRPC core's
    # executor running the client's metadata plugin for a token over TLS) is listed by
    # threading.enumerate() as a _DummyThread for the rest of the process; it cannot be joined and
    # the library's pool owns it
    wide.threads.update(id(t) for t in threading.enumerate() if isinstance(t, threading._DummyThread))
    # the CUDA driver's device files, opened once per process by the first CUDA call (see _init_cuda)
    wide.fds.update((fd, t) for fd, t in fds.items() if t.startswith("/dev/nvidia"))
    wide.tmp = set(_serve_logs)
    return wide


def _init_cuda() -> None:
    """Create the process's CUDA context before a GPU test's window opens: the driver's own
    descriptors (``/dev/nvidia*``, ``nvidia-uvm``, its eventfds and pipes), opened by the first CUDA
    call and kept for the process's life, are then part of the "before". cupy's context, a
    blocking event waited on (the transfer's completions: the driver opens what it sleeps on at the
    first), and torch's own CUDA state when torch is loaded. Nothing without CUDA."""
    with contextlib.suppress(Exception):
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            cupy.cuda.runtime.free(0)  # forces the context (a no-op free)
            stream = cupy.cuda.Stream(non_blocking=True)
            event = cupy.cuda.Event(block=True, disable_timing=True)
            event.record(stream)
            event.synchronize()
    torch = sys.modules.get("torch")
    with contextlib.suppress(Exception):
        if torch is not None and torch.cuda.is_available():
            torch.cuda.init()
            torch.cuda.current_stream().synchronize()


# --- ownership by reachability -------------------------------------------------------------------------

_SKIP = (type, type(sys), type(len), type(lambda: 0), type(_fds.__code__), str, bytes, int, float, bool,
         type(None), range)


def reachable(roots: Iterable[Any], max_depth: int = 7, max_objects: int = 200_000) -> Owned:
    """What the objects ``roots`` lead to (breadth first, ``max_depth`` references deep) that this
    check counts: Popen pids, threads, sockets/files/epolls (their fds), temp-dir Paths, sidecars."""
    out = Owned()
    fds = _fds()
    tmp = _tmpdirs or _tmpdir_names()
    sidecar_cls = _sidecar_class()
    seen: set[int] = set()
    frontier = list(roots)
    for _ in range(max_depth):
        nxt: list[Any] = []
        for o in frontier:
            if id(o) in seen or isinstance(o, _SKIP):
                continue
            seen.add(id(o))
            if len(seen) > max_objects:
                return out
            _classify(o, out, fds, tmp, sidecar_cls)
            nxt.extend(gc.get_referents(o))
        frontier = nxt
        if not frontier:
            break
    return out


def _classify(o: Any, out: Owned, fds: dict[int, str], tmp: set[str], sidecar_cls: type | None) -> None:
    if isinstance(o, subprocess.Popen):
        if isinstance(o.pid, int):
            out.pids.add(o.pid)
    elif isinstance(o, threading.Thread):
        out.threads.add(id(o))
    elif isinstance(o, (socket.socket, io.IOBase, select.epoll)):
        with contextlib.suppress(Exception):  # closed: no descriptor
            fd = o.fileno()
            if fd in fds:
                out.fds.add((fd, fds[fd]))
    elif isinstance(o, Path):
        if str(o.parent) in tmp:
            out.tmp.add(os.path.normpath(str(o)))
    elif isinstance(o, tempfile.TemporaryDirectory):
        out.tmp.add(os.path.normpath(o.name))
    elif sidecar_cls is not None and isinstance(o, sidecar_cls):
        out.sidecars.add(id(o))


def _sidecar_class() -> type | None:
    mod = sys.modules.get("kvstore.server.sidecar")
    return getattr(mod, "Sidecar", None)


# --- describing a leak ---------------------------------------------------------------------------------


def _socket_names() -> dict[str, str]:
    """socket inode -> "tcp 127.0.0.1:5000 -> 127.0.0.1:6000" (or a unix path), from /proc/net."""
    names: dict[str, str] = {}
    for proto in ("tcp", "tcp6", "udp", "udp6"):
        with contextlib.suppress(OSError), open(f"/proc/net/{proto}") as f:
            next(f)
            for line in f:
                parts = line.split()
                if len(parts) > 9:
                    state = "LISTEN " if parts[3] == "0A" and proto.startswith("tcp") else ""
                    names[parts[9]] = f"{proto} {state}{_addr(parts[1])} -> {_addr(parts[2])}"
    with contextlib.suppress(OSError), open("/proc/net/unix") as f:
        next(f)
        for line in f:
            parts = line.split()
            if len(parts) >= 7:
                names[parts[6]] = f"unix {parts[7] if len(parts) > 7 else '(unnamed)'}"
    return names


def _addr(hexaddr: str) -> str:
    host, _, port = hexaddr.partition(":")
    try:
        if len(host) == 8:
            ip = socket.inet_ntop(socket.AF_INET, bytes.fromhex(host)[::-1])
        else:
            raw = bytes.fromhex(host)
            ip = socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
        return f"{ip}:{int(port, 16)}"
    except (ValueError, OSError):
        return hexaddr


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:300] or "?"
    except OSError:
        return "(gone)"


def describe(leaked: Owned, snap: Snapshot) -> list[str]:
    lines: list[str] = []
    sockets = _socket_names() if any(t.startswith("socket:[") for _, t in leaked.fds) else {}
    for fd, target in sorted(leaked.fds):
        extra = ""
        if target.startswith("socket:["):
            extra = f" ({sockets.get(target[8:-1], 'socket')})"
        lines.append(f"fd {fd} -> {target}{extra}")
    for i in sorted(leaked.threads, key=lambda i: snap.threads[i].name):
        t = snap.threads[i]
        target = getattr(t, "_target", None)
        what = getattr(target, "__qualname__", None) or type(t).__name__
        lines.append(f"thread {t.name!r} ({what}, daemon={t.daemon})")
    for key in sorted(leaked.procs):
        p = snap.procs[key]
        lines.append(f"process {p.pid} (parent {p.ppid}): {_cmdline(p.pid)}")
    for name in sorted(leaked.shm):
        lines.append(f"shared memory {SHM_DIR}/{name}")
    for path in sorted(leaked.tmp):
        lines.append(f"temp {'dir' if os.path.isdir(path) else 'file'} {path}")
    for i in sorted(leaked.sidecars):
        sc, leases, allocs = snap.sidecars[i]
        slab = getattr(getattr(sc, "slab", None), "name", "?")
        lines.append(
            f"in-process Sidecar (grpc port {getattr(sc, 'grpc_port', '?')}, slab {slab}) running, "
            f"holding {len(leases)} lease(s) {sorted(leases)[:5]} and {len(allocs)} allocation(s) {sorted(allocs)[:5]}"
        )
    return lines


def kinds_of(leaked: Owned) -> set[str]:
    return {k for k, v in (("shm", leaked.shm), ("fds", leaked.fds), ("threads", leaked.threads),
                           ("processes", leaked.procs), ("tmp", leaked.tmp), ("sidecars", leaked.sidecars)) if v}


def drop_kinds(leaked: Owned, kinds: Iterable[str]) -> Owned:
    attr = {"processes": "procs"}
    for k in kinds:
        getattr(leaked, attr.get(k, k)).clear()
    return leaked


# --- instrumentation (installed once, by pytest_configure) -------------------------------------------


_AUDIT_EVENTS = frozenset({"open", "os.mkdir", "tempfile.mkstemp", "tempfile.mkdtemp", "socket.bind"})


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event not in _AUDIT_EVENTS:
        return
    try:
        if event == "open":
            path, _mode, flags = args
            if not isinstance(flags, int) or not flags & os.O_CREAT or isinstance(path, int):
                return
        elif event == "socket.bind":
            path = args[1]
            if not isinstance(path, (str, bytes)):
                return
        else:
            path = args[0]
        path = os.fsdecode(path)
        if os.path.dirname(path) in _tmpdirs and os.path.basename(path).startswith(TMP_PREFIXES):
            _created.append(path)
    except Exception:  # noqa: BLE001 - an audit hook must never break the call it watches
        return


def _wrap_init(cls: type, after: Callable[[Any], None]) -> None:
    orig = cls.__init__  # type: ignore[misc]

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            orig(self, *args, **kwargs)
        finally:
            with contextlib.suppress(Exception):
                after(self)

    __init__.__wrapped__ = orig  # type: ignore[attr-defined]
    cls.__init__ = __init__  # type: ignore[misc]


_installed = False


def install() -> None:
    """Instrument this process (once): the session marker in the environment, an audit hook for
    temp-dir creations, and records of the processes, shm segments, sidecars and serve logs made."""
    global _installed
    if _installed:
        return
    _installed = True
    os.environ[ENV_MARKER] = _session
    _tmpdirs.update(_tmpdir_names())
    sys.addaudithook(_audit)

    def popen_started(p: Any) -> None:
        if isinstance(getattr(p, "pid", None), int):
            _spawned.add(p.pid)

    _wrap_init(subprocess.Popen, popen_started)

    import multiprocessing.process

    start = multiprocessing.process.BaseProcess.start

    def mp_start(self: Any) -> None:
        start(self)
        if self.pid:
            _spawned.add(self.pid)

    multiprocessing.process.BaseProcess.start = mp_start  # type: ignore[method-assign]

    from multiprocessing import shared_memory

    def shm_made(shm: Any) -> None:
        if getattr(shm, "_flags", 0) & os.O_CREAT:
            _own_shm.add(shm.name.lstrip("/"))

    _wrap_init(shared_memory.SharedMemory, shm_made)

    from kvstore.server.sidecar import Sidecar

    sc_start = Sidecar.start

    async def start_and_record(self: Any, *args: Any, **kw: Any) -> Any:
        _sidecars.add(self)
        return await sc_start(self, *args, **kw)

    Sidecar.start = start_and_record  # type: ignore[method-assign]

    from kvstore.harness.sidecar import ServeProcess

    def serve_log(p: Any) -> None:
        log = getattr(p, "log", None)
        if log is not None:
            _serve_logs.add(os.path.normpath(log.name))

    _wrap_init(ServeProcess, serve_log)


# --- the pytest plugin ---------------------------------------------------------------------------------


@dataclass
class _FixtureOwned:
    name: str
    scope: str
    owned: Owned
    value: Any = None


class LeakCheck:
    def __init__(self) -> None:
        self.fixtures: dict[int, _FixtureOwned] = {}  # id(fixturedef) -> what its setup made
        self.finalized: list[_FixtureOwned] = []  # finalized during the current teardown
        self.before: Snapshot | None = None

    def exempt(self) -> Owned:
        out = Owned()
        for f in self.fixtures.values():
            out.update(f.owned)
        return out

    def claim_reachable(self, candidates: Owned) -> Owned:
        """Give each live broader-scoped fixture the ``candidates`` its value reaches (they are its
        from now on: checked when it is finalized); returns all that were claimed."""
        claimed = Owned()
        for f in self.fixtures.values():
            if f.value is None:
                continue
            mine = _intersect(reachable([f.value]), candidates)
            f.owned.update(mine)
            claimed.update(mine)
        return claimed

    def settle(
        self, compute: Callable[[Snapshot], Owned], claim: Callable[[Owned, Snapshot], None],
    ) -> tuple[Owned, Snapshot]:
        """Leaks, after giving what is on its way out :data:`GRACE_S` seconds to go. The costly
        steps run only while something is left: most tests leave nothing, and a full collection
        in a process that has imported torch takes half a second."""
        snap = snapshot()
        leaked = compute(snap)
        if empty(leaked):
            return leaked, snap
        claim(leaked, snap)  # what a live broader-scoped fixture reaches is its own
        gc.collect()
        snap = snapshot()
        leaked = compute(snap)
        if empty(leaked):
            return leaked, snap
        # An in-process Sidecar.start() calls gc.freeze() (kvstore/server/sidecar.py): what is frozen
        # is never collected, garbage cycles holding a socket or a channel included.
        gc.unfreeze()
        gc.collect()
        deadline = time.monotonic() + GRACE_S
        collected = time.monotonic()
        while True:
            snap = snapshot()
            leaked = compute(snap)
            if empty(leaked) or time.monotonic() > deadline:
                return leaked, snap
            if time.monotonic() - collected > 1.0:
                gc.collect()
                collected = time.monotonic()
            time.sleep(0.05)


_KEY = pytest.StashKey[LeakCheck]()
_FAILED = pytest.StashKey[bool]()


def _check(config: pytest.Config) -> LeakCheck | None:
    return config.stash.get(_KEY, None)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--no-leak-check", action="store_true", default=False,
                     help="do not check tests for leaked fds, threads, processes, shm, temp files (tests/leaks.py)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        'leaks_allowed(reason, kinds=None): this test may leave resources behind (tests/leaks.py); '
        f"the reason is required; kinds: some of {', '.join(KINDS)} (default all)",
    )
    if config.getoption("--no-leak-check"):
        return
    install()
    config.stash[_KEY] = LeakCheck()


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest) -> Iterator[Any]:
    check = _check(request.config)
    if check is None or fixturedef.scope == "function":
        return (yield)
    before = snapshot()
    try:
        result = yield
    finally:
        after = snapshot()
        owned = diff(before, after, Owned())
        owned.held = {i: after.sidecars[i][1:] for i in owned.sidecars}
        check.fixtures[id(fixturedef)] = _FixtureOwned(fixturedef.argname, fixturedef.scope, owned)
    check.fixtures[id(fixturedef)].value = result
    return result


def pytest_fixture_post_finalizer(fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest) -> None:
    check = _check(request.config)
    if check is None or fixturedef.scope == "function":
        return
    f = check.fixtures.pop(id(fixturedef), None)
    if f is not None:
        f.value = None
        check.finalized.append(f)


@pytest.hookimpl(wrapper=True, tryfirst=True)  # outermost: before any other plugin's setup work
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    check = _check(item.config)
    if check is not None:
        if item.get_closest_marker("gpu") is not None:
            _init_cuda()
        check.before = snapshot()
        check.finalized.clear()
    result = yield
    # checked once the setup has run: failing before it would skip other plugins' setup wrappers,
    # whose teardown halves then fail
    marker = item.get_closest_marker("leaks_allowed")
    if marker is not None:
        reason = marker.args[0] if marker.args else marker.kwargs.get("reason")
        if not isinstance(reason, str) or not reason.strip():
            pytest.fail('@pytest.mark.leaks_allowed needs a reason: leaks_allowed("why")', pytrace=False)
        bad = set(marker.kwargs.get("kinds") or ()) - set(KINDS)
        if bad:
            pytest.fail(f"leaks_allowed: kinds {sorted(bad)} are not among {KINDS}", pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[pytest.TestReport]:
    report: pytest.TestReport = yield
    if report.failed and call.when in ("setup", "call"):
        item.stash[_FAILED] = True
    return report


# outermost: runs after the logging plugin drops the test's log records (a record's args can hold an
# exception, and through its traceback the frames, channels and servers of the call that raised it)
@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    result = yield
    check = _check(item.config)
    if check is None or check.before is None:
        return result
    # pytest drops the fixture values (item.funcargs) only after this hook (runner.runtestprotocol); a
    # torn-down fixture's value -- a closed channel, a stopped server object -- keeps its library's
    # process-wide state alive until then (grpc.aio's poller thread lives while any channel object
    # does). Every fixture is finalized by now, so drop them here.
    if isinstance(getattr(item, "funcargs", None), dict):
        item.funcargs = {}  # type: ignore[attr-defined]
    before, check.before = check.before, None
    finalized, check.finalized = check.finalized, []
    marker = item.get_closest_marker("leaks_allowed")
    allowed: set[str] = set()
    if marker is not None:
        allowed = set(marker.kwargs.get("kinds") or KINDS)
        if allowed >= set(KINDS):
            return result

    # what fixtures finalized in this teardown made is checked apart (below), named by fixture
    exempt = check.exempt()
    for f in finalized:
        exempt.update(f.owned)

    def fixtures_left(snap: Snapshot) -> list[tuple[_FixtureOwned, Owned]]:
        return [(f, drop_kinds(still_there(f.owned, snap), allowed)) for f in finalized]

    def compute(snap: Snapshot) -> Owned:
        left = drop_kinds(diff(before, snap, exempt), allowed)
        for _, mine in fixtures_left(snap):
            left.update(mine)
        return left

    def claim(leaked: Owned, snap: Snapshot) -> None:
        # a server a session fixture restarted mid-test, say: its fixture's from now on
        exempt.update(check.claim_reachable(_with_pids(leaked, snap)))

    leaked, snap = check.settle(compute, claim)
    lines: list[str] = []
    if not empty(leaked):
        lines = [f"  {line}" for line in describe(drop_kinds(diff(before, snap, exempt), allowed), snap)]
        for f, left in fixtures_left(snap):
            lines += [f"  {line}   [left behind by {f.scope}-scoped fixture {f.name!r}]"
                      for line in describe(left, snap)]
    if not lines:
        return result
    msg = (
        f"{item.nodeid} left resources behind (compared with before its setup; tests/leaks.py):\n"
        + "\n".join(lines)
        + '\nFix the test (close, stop, join, unlink what it made), or mark it '
        '@pytest.mark.leaks_allowed("why"[, kinds=(...)]).'
    )
    if item.stash.get(_FAILED, False):
        item.add_report_section("teardown", "leaks", msg)
        return result
    pytest.fail(msg, pytrace=False)
