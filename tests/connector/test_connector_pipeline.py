"""Calls sent now and answered later on one connection to a real sidecar's Unix socket
(``kvstore.client.pipeline``, held by the connectors in ``connector.roles.pipeline``): the
scheduler's lookup sent when the engine adds a request and read when the engine asks, and the
worker's lease releases sent without waiting for their answers."""

from __future__ import annotations

import socket
import struct
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from paged_cases import BLOCKS, NS, PROMPT, SPEC, caches, stored

from connector.roles import SchedulerConnector, WorkerConnector
from connector.roles.finders import LeaseFinder
from connector.roles.pipeline import PipelineSlot
from kvstore.client import Pipeline, SyncClient, namespace_pb
from kvstore.errors import InvalidArgument, KVStoreError, ResourceExhausted, Unavailable
from kvstore.harness.sidecar import ServeProcess
from kvstore.keys import Namespace
from kvstore.v1 import kvstore_pb2 as pb
from tests.connector.conftest import serve_args
from tests.core.raw_frames import raw_server, recv_call, send_answer

SMALL_LIMIT = 1 << 20
OVERSIZE = pb.EchoRequest(payload=b"x" * (4 << 20))  # over SMALL_LIMIT, and over what a socket's buffers hold
UNDECODABLE = b"\xff"  # an OK answer whose message cannot be parsed


def leases(client: SyncClient) -> int:
    return client.stats()["index"]["leases"]


def acquires(client: SyncClient) -> int:
    return client.stats()["reads"].get("acquires", 0)


def until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def scheduler(client: SyncClient) -> tuple[SchedulerConnector, PipelineSlot]:
    slot = PipelineSlot(client)
    return SchedulerConnector(client, NS, SPEC, finder=LeaseFinder(client, slot)), slot


def test_answers_come_back_to_their_calls_in_order(client) -> None:
    stored(client)
    pipe = PipelineSlot(client).get()
    assert isinstance(pipe, Pipeline)
    keys = SchedulerConnector(client, NS, SPEC).keys(PROMPT)
    ns = namespace_pb(NS)
    bad = pb.AcquireRequest(namespace=namespace_pb(Namespace(model="m", kv_layout="raw", dtype="uint8", block_size=1)),
                            keys=[b"short"])
    calls = [pipe.send("Acquire", pb.AcquireRequest(namespace=ns, keys=keys[:n])) for n in (2, 6)]
    wrong = pipe.send("Acquire", bad)
    last = pipe.send("Lookup", pb.LookupRequest(namespace=ns, keys=keys))
    assert [len(pipe.result(c).blocks) for c in calls] == [2, 6]
    with pytest.raises(InvalidArgument, match="keys"):  # one call's error is that call's only
        pipe.result(wrong)
    assert pipe.result(last).matched == 6
    heard = []
    pipe.forget(pipe.send("Release", pb.ReleaseRequest(lease_id=pipe.result(calls[0]).lease_id)), heard.append)
    pipe.drain()
    assert [h.released for h in heard] == [2]
    pipe.send("Release", pb.ReleaseRequest(lease_id=pipe.result(calls[1]).lease_id))
    pipe.close()  # waits for that answer
    assert leases(client) == 0


def test_a_lookup_sent_when_the_request_arrives_is_answered_before_the_engine_asks(client) -> None:
    src, ids = stored(client)
    sched, slot = scheduler(client)
    before = acquires(client)
    sched.on_new_request("r", PROMPT)
    assert until(lambda: acquires(client) == before + 1)  # answered while nobody waited for it
    assert sched.get_num_new_matched_tokens("r", PROMPT, 0) == 6 * 4
    assert acquires(client) == before + 1  # no second lookup
    assert sched.stats["early_lookups"] == 1
    sched.update_state_after_alloc("r", list(range(BLOCKS)), 6 * 4)
    [load] = sched.build_connector_meta().loads
    dst = caches(2)
    worker = WorkerConnector(client, NS, SPEC, pipeline=PipelineSlot(client))
    worker.register_kv_caches(dst)
    [r] = worker.load_now([load])
    assert r.ok and r.loaded == 6
    for layer in range(SPEC.num_layers):
        np.testing.assert_array_equal(dst[layer][list(load.block_ids)], src[layer][ids])
    sched.request_finished("r")
    worker.get_finished(finished={"r"})  # the release goes out, on the background thread
    worker.close()  # waits for its answer
    slot.close()
    assert leases(client) == 0
    assert worker.stats.as_dict()["failures"] == {}


def test_an_early_lookup_serves_an_engine_that_meanwhile_holds_some_blocks(client) -> None:
    src, ids = stored(client)
    sched, slot = scheduler(client)
    sched.on_new_request("r", PROMPT)
    assert sched.get_num_new_matched_tokens("r", PROMPT, 2 * 4) == 4 * 4  # blocks 0-1 are the engine's now
    sched.update_state_after_alloc("r", list(range(BLOCKS)), 4 * 4)
    [load] = sched.build_connector_meta().loads
    assert load.lease.first == 2 and len(load.lease.slots) == 4
    dst = caches(2)
    worker = WorkerConnector(client, NS, SPEC)
    worker.register_kv_caches(dst)
    [r] = worker.load_now([load])
    worker.close()
    assert r.ok and r.loaded == 4
    for layer in range(SPEC.num_layers):
        np.testing.assert_array_equal(dst[layer][list(load.block_ids)], src[layer][ids[2:]])
    slot.close()
    assert leases(client) == 0


def test_an_early_lookup_nobody_needs_ends_its_lease(client) -> None:
    stored(client)
    sched, slot = scheduler(client)
    sched.on_new_request("all-local", PROMPT)
    assert sched.get_num_new_matched_tokens("all-local", PROMPT, 6 * 4) == 0  # the engine had every block
    sched.on_new_request("aborted", PROMPT)
    sched.request_finished("aborted")  # finished before it was scheduled
    slot.get().drain()
    assert until(lambda: leases(client) == 0)
    assert sched.stats["early_lookups"] == 0
    slot.close()


def test_a_miss_answered_early_is_not_asked_again(client) -> None:
    stored(client)
    sched, slot = scheduler(client)
    fresh = list(range(300, 300 + 6 * 4 + 1))  # nothing of it stored
    before = acquires(client)
    sched.on_new_request("r", fresh)
    assert sched.get_num_new_matched_tokens("r", fresh, 0) == 0
    assert acquires(client) == before + 1  # the early answer was the answer
    slot.close()


def test_an_early_lookup_short_of_the_engines_blocks_is_made_again(client) -> None:
    stored(client)
    sched, slot = scheduler(client)
    longer = PROMPT[:-1] + list(range(100, 100 + 4 * 4 + 1))  # blocks 0-5 stored, 6-9 not
    sched.on_new_request("r", longer)
    before = acquires(client)
    # the engine holds blocks 0-7 by now, past the 6 the early answer found: asked again from block 8
    assert sched.get_num_new_matched_tokens("r", longer, 8 * 4) == 0
    assert acquires(client) == before + 1
    slot.close()
    assert until(lambda: leases(client) == 0)


def test_a_sidecar_gone_mid_call_fails_the_calls_in_flight(client, sidecar_process) -> None:
    stored(client)
    slot = PipelineSlot(client)
    pipe = slot.get()
    keys = SchedulerConnector(client, NS, SPEC).keys(PROMPT)
    assert pipe.result(pipe.send("Lookup", pb.LookupRequest(namespace=namespace_pb(NS), keys=keys))).matched == 6
    sidecar_process.stop()
    call = pipe.send("Lookup", pb.LookupRequest(namespace=namespace_pb(NS), keys=keys))
    with pytest.raises(Unavailable):
        pipe.result(call)
    # the scheduler's early lookup then fails quietly and the lookup is made (and counted) as before
    sched = SchedulerConnector(client, NS, SPEC, finder=LeaseFinder(client, slot))
    sched.on_new_request("r", PROMPT)
    assert sched.get_num_new_matched_tokens("r", PROMPT, 0) == 0
    assert sched.stats["lookup.unavailable"] == 1
    slot.close()


def test_releases_that_fail_are_counted_when_their_answers_come(client, sidecar_process) -> None:
    stored(client)
    sched, slot = scheduler(client)
    assert sched.get_num_new_matched_tokens("r", PROMPT, 0) == 6 * 4
    sched.update_state_after_alloc("r", list(range(BLOCKS)), 6 * 4)
    [load] = sched.build_connector_meta().loads
    worker = WorkerConnector(client, NS, SPEC, pipeline=PipelineSlot(client))
    worker.register_kv_caches(caches(2))
    assert worker.load_now([load])[0].ok
    sidecar_process.stop()
    worker.get_finished(finished={"r"})
    worker.close()
    assert worker.stats["release.unavailable"] == 1
    slot.close()


# --- the local socket's rules, as the blocking and asyncio clients follow them ------------------
# (kvstore.client.local_channel: refused before sending when over the sidecar's limit; after a
# failed send, the answer waiting in the socket; sent again only when none of it went out)


def hello(conn: socket.socket, limit: int = 0) -> None:
    """A stand-in sidecar's hello: OK, with the longest call frame it takes (0: none given, as an
    older sidecar's hello)."""
    recv_call(conn)
    send_answer(conn, 0, struct.pack(">I", limit) if limit else b"")


def echoed(payload: bytes) -> bytes:
    return pb.EchoResponse(payload=payload).SerializeToString()


def test_a_call_over_the_sidecars_limit_is_refused_before_it_is_sent(tmp_path: Path) -> None:
    """RESOURCE_EXHAUSTED, as the sidecar (and a gRPC client) would give; nothing reaches the
    sidecar and the connection serves the next call (it was sent, failed on EPIPE, sent again on
    a new connection and failed UNAVAILABLE)."""
    sc = ServeProcess(serve_args(tmp_path / "d"), env={"KVSTORE_SERVER__MAX_MESSAGE_BYTES": str(SMALL_LIMIT)})
    try:
        with SyncClient(sc.grpc) as client:
            slot = PipelineSlot(client)
            pipe = slot.get()
            assert pipe is not None
            sock = pipe._sock
            call = pipe.send("Echo", OVERSIZE)
            assert call.done and isinstance(call.error, ResourceExhausted)
            assert "server.max_message_bytes" in str(call.error)
            assert pipe._sock is sock
            assert pipe.result(pipe.send("Echo", pb.EchoRequest(payload=b"next"))).payload == b"next"
            assert "RESOURCE_EXHAUSTED" not in client.stats()["errors"]
            slot.close()
    finally:
        sc.stop()


def test_a_failed_send_reads_the_answers_waiting_and_is_not_sent_again(tmp_path: Path) -> None:
    """An older sidecar (no limit at hello) refuses the second call on its length and closes while
    it is being sent: the first call gets its answer, the second the refusal, and neither is sent
    again (it used to fail both UNAVAILABLE and send the second once more on a new connection)."""

    def refuse_the_second(conn: socket.socket) -> None:
        hello(conn)
        recv_call(conn)
        send_answer(conn, 0, echoed(b"first"))
        conn.recv(4, socket.MSG_WAITALL)  # the second's length, refused as the sidecar does
        send_answer(conn, grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], b"frame: too long")

    path = str(tmp_path / "s.sock")
    with raw_server(path, refuse_the_second) as accepted:
        pipe = Pipeline(path)
        try:
            first = pipe.send("Echo", pb.EchoRequest(payload=b"first"))
            second = pipe.send("Echo", OVERSIZE)
            assert second.done and isinstance(second.error, ResourceExhausted), second.error
            assert pipe.result(first).payload == b"first"
            assert len(accepted) == 1
        finally:
            pipe.close()


def test_a_connection_broken_while_idle_sends_the_call_again_and_learns_the_new_limit(tmp_path: Path) -> None:
    """The sidecar restarted with a lower limit: nothing of the call went out on the old
    connection, so it goes on a new one, whose hello refuses it before it is sent."""
    closed = threading.Event()

    def restarted(conn: socket.socket) -> None:
        if len(accepted) == 1:  # the first sidecar: one call, then gone
            hello(conn)
            recv_call(conn)
            send_answer(conn, 0, echoed(b"one"))
            conn.shutdown(socket.SHUT_RDWR)
            closed.set()
        else:  # the restarted one: a lower limit, and refused on the length as the sidecar does
            hello(conn, SMALL_LIMIT)
            conn.recv(4, socket.MSG_WAITALL)
            send_answer(conn, grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], b"frame: too long")

    path = str(tmp_path / "s.sock")
    with raw_server(path, restarted) as accepted:
        pipe = Pipeline(path)
        try:
            assert pipe.result(pipe.send("Echo", pb.EchoRequest(payload=b"one"))).payload == b"one"
            assert closed.wait(10)
            call = pipe.send("Echo", OVERSIZE)
            assert call.done and isinstance(call.error, ResourceExhausted), call.error
            assert "server.max_message_bytes" in str(call.error)  # the client's own refusal
            assert len(accepted) == 2
        finally:
            pipe.close()


class _Slot:
    """A :class:`PipelineSlot` that always has ``pipe``."""

    def __init__(self, pipe: Pipeline) -> None:
        self.pipe = pipe

    def get(self) -> Pipeline:
        return self.pipe

    def close(self) -> None:
        self.pipe.close()


def test_an_answer_that_cannot_be_decoded_is_an_internal_error_and_the_connector_recomputes(tmp_path: Path) -> None:
    """It used to raise protobuf's DecodeError out of the pipeline, leaving the call at the head
    of the queue (every later answer went to it) and the worker's drain raising."""

    def garbled(conn: socket.socket) -> None:
        hello(conn)
        while (call := recv_call(conn)) is not None:
            send_answer(conn, 0, echoed(b"fine") if call[0] == "Echo" else UNDECODABLE)

    path = str(tmp_path / "s.sock")
    with raw_server(path, garbled) as accepted:
        pipe = Pipeline(path)
        bad = pipe.send("Lookup", pb.LookupRequest())
        fine = pipe.send("Echo", pb.EchoRequest())
        with pytest.raises(KVStoreError, match="Lookup answer cannot be decoded") as info:
            pipe.result(bad)
        assert info.value.code == grpc.StatusCode.INTERNAL
        assert pipe.result(fine).payload == b"fine"  # the next answer is its own call's
        slot = _Slot(pipe)
        sched = SchedulerConnector(None, NS, SPEC, finder=LeaseFinder(None, slot))  # type: ignore[arg-type]
        sched.on_new_request("r", PROMPT)
        assert sched.get_num_new_matched_tokens("r", PROMPT, 0) == 0  # recompute
        assert sched.stats["lookup.error"] == 1
        worker = WorkerConnector(None, NS, SPEC, pipeline=slot)  # type: ignore[arg-type]
        worker._tell_sidecar([("r", "release", "lease-1"), ("r", "touch", (NS, [b"k" * 32]))])
        assert worker.stats["release.error"] == 1 and worker.stats["touch.error"] == 1
        worker.close()
        assert len(accepted) == 1
