"""The leak check itself (tests/leaks.py): tests that leak each kind on purpose, run by a pytest of
their own (pytester, in a subprocess), fail at teardown with a message that names what leaked --
and what is not a leak (a broader-scoped fixture's server, an opted-out test) passes."""

from __future__ import annotations

import contextlib
import os
import signal
import textwrap
import types
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

REPO = Path(__file__).resolve().parent.parent

# One module of deliberately leaky tests. Each leak is kept in LEFT (and its pid in PIDS) so that the
# last test, and the outer test after the run, can undo it: the inner run must not leave anything.
LEAKY = '''
import asyncio, os, socket, subprocess, sys, tempfile, threading, time
from multiprocessing import shared_memory
from pathlib import Path

import pytest
import pytest_asyncio

from kvstore.config import load_config
from kvstore.dram.slab import Slab
from kvstore.server.sidecar import Sidecar

LEFT = []
PIDS = Path(os.environ["LEAK_PIDS"])


def note(pid):
    with PIDS.open("a") as f:
        f.write(f"{pid}\\n")


def config(d):
    return load_config(None, {
        "data_dir": str(d), "server.grpc_address": "127.0.0.1:0", "server.http_address": "127.0.0.1:0",
        "dram.capacity_bytes": 4 * 65536, "dram.page_bytes": 65536, "dram.min_slot_bytes": 4096,
        "ssd.enabled": False, "server.local_socket": "off",
    })


def test_fd():
    LEFT.append(open(os.devnull))


def test_socket():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    LEFT.append(s)


def test_thread():
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, name="leaky-thread", daemon=True)
    t.start()
    LEFT.append(stop)


def test_process():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)  # leaky-child"])
    note(p.pid)
    LEFT.append(p)


def test_orphan():
    # the shell exits at once; its background sleep is re-parented away from this process
    out = subprocess.run(["sh", "-c", "sleep 121 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True)
    pid = int(out.stdout)
    note(pid)
    # until it has exec'd sleep (bounded): a process caught between fork and exec may show an empty
    # environment for a moment, and the check finds an orphan by the marker in its environment
    for _ in range(500):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if f.read().startswith(b"sleep"):
                break
        time.sleep(0.01)


def test_shm():
    shm = shared_memory.SharedMemory(create=True, size=4096)
    LEFT.append(shm)


def test_slab():
    LEFT.append(Slab(65536, page_bytes=65536, prefault=False, name_prefix="kvstore-leaktest"))


def test_tmp():
    LEFT.append(tempfile.mkdtemp(prefix="kvstore-leaktest-"))


@pytest.mark.asyncio(loop_scope="module")
async def test_sidecar_left_running(tmp_path):
    sc = await Sidecar(config(tmp_path / "sc")).start()
    LEFT.append(sc)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def shared_sidecar(tmp_path_factory):
    async with Sidecar(config(tmp_path_factory.mktemp("module-sidecar"))) as sc:
        yield sc


@pytest.mark.asyncio(loop_scope="module")
async def test_lease_left_held(shared_sidecar):
    from kvstore.keys import Namespace, prefix_keys
    from kvstore.client import KVStoreClient

    ns = Namespace(model="m", kv_layout="raw", dtype="uint8", block_size=16)
    keys = prefix_keys(ns, list(range(16)))
    async with KVStoreClient.from_url(f"127.0.0.1:{shared_sidecar.grpc_port}") as c:
        await c.put_blocks(ns, keys, [b"x" * 4096])
        lease = await c.acquire(ns, keys).__aenter__()
        LEFT.append(lease)  # never released: the sidecar holds it until its deadline


@pytest.mark.asyncio(loop_scope="module")
async def test_uses_the_shared_sidecar_and_leaves_nothing(shared_sidecar):
    assert shared_sidecar.grpc_port


@pytest.mark.leaks_allowed("kept on purpose: the opt-out")
def test_opted_out():
    LEFT.append(open(os.devnull))


@pytest.mark.leaks_allowed()
def test_opt_out_without_a_reason():
    pass


@pytest.mark.leaks_allowed("threads only", kinds=("threads",))
def test_opt_out_of_another_kind():
    LEFT.append(open(os.devnull))


def test_already_failing():
    LEFT.append(open(os.devnull))
    assert False, "the test's own failure"


def test_clean():
    with open(os.devnull) as f, tempfile.TemporaryDirectory(prefix="kvstore-leaktest-"):
        t = threading.Thread(target=f.fileno)
        t.start()
        t.join()
    subprocess.run([sys.executable, "-c", "pass"], check=True)


@pytest.mark.asyncio(loop_scope="module")
async def test_zz_undo_every_leak():
    for x in LEFT:
        if isinstance(x, Sidecar):
            await x.stop()
        elif isinstance(x, Slab):
            x.close(unlink=True)
        elif isinstance(x, shared_memory.SharedMemory):
            x.close()
            x.unlink()
        elif isinstance(x, str):
            os.rmdir(x)
        elif isinstance(x, threading.Event):
            x.set()
        elif isinstance(x, subprocess.Popen):
            x.kill()
            x.wait()
        elif hasattr(x, "views"):
            x.views.clear()
        else:
            x.close()
    LEFT.clear()
'''

SERVER = '''
import os, subprocess, sys
from pathlib import Path

import pytest


def note(pid):
    with Path(os.environ["LEAK_PIDS"]).open("a") as f:
        f.write(f"{pid}\\n")


class Server:
    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)  # module-server"])
        note(self.proc.pid)


@pytest.fixture(scope="module")
def server():
    yield Server()
    # forgets to stop it


def test_first_user_of_a_module_server_passes(server):
    assert server.proc.poll() is None


def test_a_restart_of_the_module_server_is_its_own(server):
    server.proc.kill()
    server.proc.wait()
    server.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)  # module-server"])
    note(server.proc.pid)


def test_zz_last_of_the_module(server):
    pass  # the module's teardown follows this test: `server` is left running
'''


@pytest.fixture
def inner(pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    pids = tmp_path / "pids"
    pids.touch()
    monkeypatch.setenv("LEAK_PIDS", str(pids))
    monkeypatch.setenv("KVSTORE_LEAK_GRACE_S", "0.5")  # every test there leaks: do not wait 5 s on each
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    pytester.makeini(textwrap.dedent("""
        [pytest]
        asyncio_mode = auto
        asyncio_default_fixture_loop_scope = function
    """))
    yield pytester
    for line in pids.read_text().split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(line), signal.SIGKILL)


def _section(out: str, test: str) -> str:
    """The teardown error (or leaks section) printed for ``test`` (``file.py::name``)."""
    start = out.find(f"{test} left resources behind")
    assert start >= 0, f"no leak report for {test}:\n{out}"
    end = out.find("Fix the test", start)
    return out[start:end]


def _named(out: str, word: str) -> set[str]:
    return {line.split()[1] for line in out.splitlines() if line.startswith(f"{word} test_leaky")}


def test_each_kind_of_leak_fails_its_test_and_names_it(inner: pytest.Pytester) -> None:
    inner.makepyfile(test_leaky=LEAKY, test_leaky_server=SERVER)
    result = inner.runpytest_subprocess("-p", "tests.leaks", "-p", "no:cacheprovider", "-rfE", timeout=300)
    out = result.stdout.str()

    def section(name: str) -> str:
        return _section(out, f"test_leaky.py::{name}")

    assert "/dev/null" in section("test_fd")
    assert "tcp LISTEN 127.0.0.1:" in section("test_socket")
    assert "thread 'leaky-thread'" in section("test_thread")
    assert "leaky-child" in section("test_process")
    assert "sleep 121" in section("test_orphan")  # not a child any more: found by its environment
    assert "shared memory /dev/shm/psm_" in section("test_shm")
    slab = section("test_slab")
    assert "shared memory /dev/shm/kvstore-leaktest-" in slab and "fd " in slab
    assert "temp dir " in section("test_tmp") and "kvstore-leaktest-" in section("test_tmp")
    assert "in-process Sidecar" in section("test_sidecar_left_running")
    assert "running, holding 1 lease(s)" in section("test_lease_left_held")
    assert "needs a reason" in out
    assert "/dev/null" in section("test_opt_out_of_another_kind")
    assert "Captured leaks teardown" in out and "/dev/null" in section("test_already_failing")
    # the module server: its first user and the test that restarted it pass; the module's end,
    # where the fixture should have stopped it, names the fixture and the restarted process
    last = _section(out, "test_leaky_server.py::test_zz_last_of_the_module")
    assert "module-server" in last and "left behind by module-scoped fixture 'server'" in last

    assert _named(out, "ERROR") == {
        f"test_leaky.py::{t}" for t in (
            "test_fd", "test_socket", "test_thread", "test_process", "test_orphan", "test_shm", "test_slab",
            "test_tmp", "test_sidecar_left_running", "test_lease_left_held", "test_opt_out_without_a_reason",
            "test_opt_out_of_another_kind",
        )
    } | {"test_leaky_server.py::test_zz_last_of_the_module"}, out
    assert _named(out, "FAILED") == {"test_leaky.py::test_already_failing"}, out
    # 20 tests: one fails, one errors at setup (no reason), 12 error at teardown after passing
    result.assert_outcomes(passed=18, failed=1, errors=13)


def test_a_gpu_tests_before_holds_torch_cuda_and_a_blocking_event(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before a GPU test's window the leak check opens what the driver keeps for the process:
    cupy's context, a blocking event recorded and waited on, and torch's CUDA state (checked
    through the recording model of cupy, tests/support/cuda_streams.py)."""
    import torch

    from tests.leaks import _init_cuda
    from tests.support.cuda_streams import installed

    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "init", lambda: calls.append("init"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(
        synchronize=lambda: calls.append("synchronize")))
    with installed(monkeypatch) as (gpu, _):
        _init_cuda()
    assert [(e.block, e.recorded, e.waited) for e in gpu.events] == [(True, True, True)]
    assert calls == ["init", "synchronize"]
