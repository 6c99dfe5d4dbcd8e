"""Ending tasks from a close or stop path (kvstore.util.tasks.cancel_and_wait): the tasks' own
cancellation is swallowed, the caller's is not.

DEFECT it replaces: ClusterNode.close, PeerServer.close and Sidecar.stop awaited their cancelled
tasks under ``suppress(CancelledError)``, which also swallowed a cancellation aimed at the caller:
a deadline (``asyncio.timeout``) around a stop never fired while a task held out (one that lost its
cancellation, CPython gh-86296), and the stop went on waiting for it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from pathlib import Path

from kvstore.server.sidecar import Sidecar
from kvstore.util.tasks import cancel_and_wait
from tests.conftest import small_config


async def holds_out(release: asyncio.Event, cancelled: asyncio.Event) -> None:
    """A task that loses its cancellations (as a call under Python 3.11's wait_for can) until released."""
    while not release.is_set():
        try:
            await release.wait()
        except asyncio.CancelledError:
            cancelled.set()


async def under_a_deadline(aw: Awaitable[None]) -> BaseException | None:
    """What ``aw`` under a short ``asyncio.timeout`` ended with (None: it returned), or a failed
    test when it has not ended within a minute (a bound that makes a hang fail, not a timing)."""

    async def run() -> None:
        async with asyncio.timeout(0.2):
            await aw

    task = asyncio.create_task(run())
    done, _ = await asyncio.wait({task}, timeout=60)
    assert task in done, "the caller's deadline was swallowed: still waiting for the task that holds out"
    return task.exception()


async def test_a_callers_deadline_fires_while_a_task_holds_out() -> None:
    release, cancelled = asyncio.Event(), asyncio.Event()
    stubborn = asyncio.create_task(holds_out(release, cancelled))
    quick = asyncio.create_task(asyncio.sleep(3600))
    await asyncio.sleep(0)
    assert isinstance(await under_a_deadline(cancel_and_wait([stubborn, quick])), TimeoutError)
    assert cancelled.is_set() and not stubborn.done() and quick.cancelled()
    release.set()
    await cancel_and_wait([stubborn])
    assert stubborn.done() and not stubborn.cancelled()


async def test_the_tasks_cancellation_is_not_raised_and_every_one_is_awaited() -> None:
    release, cancelled = asyncio.Event(), asyncio.Event()
    stubborn = asyncio.create_task(holds_out(release, cancelled))
    sleepers = [asyncio.create_task(asyncio.sleep(3600)) for _ in range(3)]
    await asyncio.sleep(0)
    waiting = asyncio.create_task(cancel_and_wait([*sleepers, None, stubborn]))
    await cancelled.wait()
    assert not waiting.done()  # still waiting for the one that holds out
    release.set()
    assert await waiting == []
    assert all(s.cancelled() for s in sleepers) and stubborn.done()


async def test_an_error_a_task_ended_with_is_returned_not_raised_once_all_have_ended() -> None:
    """A stop goes on to its next step whatever its tasks died of (issue 29: a background task's
    error re-raised here ended a sidecar's stop before it left the cluster or unlinked its slab)."""
    async def fails_when_cancelled() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            raise RuntimeError("cleanup failed") from None

    failing = asyncio.create_task(fails_when_cancelled())
    sleeper = asyncio.create_task(asyncio.sleep(3600))
    await asyncio.sleep(0)
    errors = await cancel_and_wait([failing, sleeper])
    assert [str(e) for e in errors] == ["cleanup failed"]
    assert sleeper.cancelled()


async def test_a_deadline_around_a_sidecars_stop_fires(tmp_path: Path) -> None:
    sc = await Sidecar(small_config(tmp_path)).start()
    release, cancelled = asyncio.Event(), asyncio.Event()
    stubborn = asyncio.create_task(holds_out(release, cancelled))
    sc._tasks.append(stubborn)  # a background task that loses its cancellation
    try:
        assert isinstance(await under_a_deadline(sc.stop()), TimeoutError)
        assert cancelled.is_set() and not stubborn.done()
    finally:
        release.set()
        await sc.stop()  # the rest of the stop
    assert stubborn.done()
