"""The direct path's RESP2 client against a real redis-server: replies into buffers, errors, long
pipelines, authentication and a server restart under a pooled connection."""

from __future__ import annotations

import os

import pytest
import redis

from kvstore.harness.servers import redis_server
from kvstore.wire.resp import Connection, Endpoint, ErrorReply, Overflow, Pool, encode


def test_encode_joins_small_parts_and_passes_large_buffers_by_reference():
    big = memoryview(bytearray(32 * 1024))
    parts = encode([(b"SET", b"k", big), (b"GET", b"k")])
    assert parts[1] is big
    assert b"".join(bytes(p) for p in parts) == (
        b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$32768\r\n" + bytes(big) + b"\r\n*2\r\n$3\r\nGET\r\n$1\r\nk\r\n"
    )


def test_replies_land_in_their_buffers_and_errors_are_values(redis_clean):
    r = redis.Redis(port=redis_clean.port)
    payload = os.urandom(300_000)  # longer than the line buffer: most of it comes straight off the socket
    r.set("big", payload)
    r.set("small", b"abc")
    r.rpush("list", b"x")
    conn = Connection(Endpoint("127.0.0.1", redis_clean.port))
    try:
        into = memoryview(bytearray(len(payload) + 10))
        tight = memoryview(bytearray(100))
        replies = conn.execute(
            [
                (b"GET", b"big"),
                (b"GET", b"small"),
                (b"GET", b"missing"),
                (b"GET", b"list"),
                (b"GET", b"big"),
                (b"INCR", b"n"),
            ],
            [into, None, None, None, tight, None],
        )
        assert replies[0] == len(payload) and into[: len(payload)] == payload
        assert replies[1:3] == [b"abc", None]
        assert isinstance(replies[3], ErrorReply) and replies[3].code == "WRONGTYPE"
        assert replies[4] == Overflow(len(payload))  # dropped, and the stream is still in step:
        assert replies[5] == 1
        assert conn.execute([(b"SET", b"k", memoryview(payload)), (b"GET", b"small")]) == [b"OK", b"abc"]
        assert r.get("k") == payload
    finally:
        conn.close()


def test_a_long_pipeline_of_small_replies_crosses_the_line_buffer(redis_clean):
    r = redis.Redis(port=redis_clean.port)
    values = {f"k{i}".encode(): os.urandom(i % 97) for i in range(5000)}  # ~250 KiB of replies
    r.mset(values)
    conn = Connection(Endpoint("127.0.0.1", redis_clean.port))
    try:
        assert conn.execute([(b"GET", k) for k in values]) == list(values.values())
    finally:
        conn.close()


def test_exec_replies_are_arrays_and_a_refused_command_aborts_the_transaction(redis_clean):
    conn = Connection(Endpoint("127.0.0.1", redis_clean.port))
    try:
        replies = conn.execute([(b"MULTI",), (b"SET", b"a", b"1"), (b"INCR", b"n"), (b"EXEC",), (b"GET", b"a")])
        assert replies == [b"OK", b"QUEUED", b"QUEUED", [b"OK", 1], b"1"]
        replies = conn.execute([(b"MULTI",), (b"SET", b"b", b"2"), (b"NOSUCHCOMMAND",), (b"EXEC",), (b"EXISTS", b"b")])
        assert replies[:2] == [b"OK", b"QUEUED"]
        assert isinstance(replies[2], ErrorReply) and isinstance(replies[3], ErrorReply)
        assert replies[3].code == "EXECABORT" and replies[4] == 0  # nothing of it was applied
    finally:
        conn.close()


def test_authentication_and_db():
    with redis_server("--requirepass", "pw") as server:
        conn = Connection(Endpoint("127.0.0.1", server.port, password="pw", db=2))
        try:
            assert conn.execute([(b"SET", b"k", b"v")]) == [b"OK"]
        finally:
            conn.close()
        assert redis.Redis(port=server.port, password="pw", db=2).get("k") == b"v"
        with pytest.raises(ConnectionRefusedError, match=r"WRONGPASS|invalid"):
            Connection(Endpoint("127.0.0.1", server.port, password="wrong"))


def test_pool_reconnects_once_after_the_server_restarted():
    with redis_server() as server:
        pool = Pool(Endpoint("127.0.0.1", server.port, timeout_s=5))
        try:
            assert pool.execute([(b"SET", b"k", b"1")]) == [b"OK"]
            server.stop()
            with pytest.raises(ConnectionError):
                pool.execute([(b"GET", b"k")])
            server.start()  # same port; the pooled socket is dead
            assert pool.execute([(b"GET", b"k")]) == [None]  # no persistence: empty, but answered
        finally:
            pool.close()
