"""The encrypted peer data path (``cluster.peer_encryption``, kvstore/cluster/peer_frames.py):
whoever is on the path between two nodes sees no block, namespace root or key, and a frame changed
on the way is a miss, caught by its tag (never by luck of the checksum, never wrong data). Real
sidecars in-process on loopback, a real redis-server and a real 3-node Redis Cluster as the
directory, a real TCP relay between the nodes. (A replayed request frame: test_cluster_auth.py::
test_a_party_on_the_path_cannot_send_a_request_of_its_own_on_a_relayed_connection[encrypted-*].)
On 66d9839 (no encryption) each test fails: the relay saw every block in the clear, and a flipped
byte was caught by the xxh3 checksum only."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvstore.cluster import peer_hello
from kvstore.cluster.cluster_key import MAC_BYTES, NONCE_BYTES, PROOF_BYTES
from kvstore.keys import Namespace
from kvstore.server.sidecar import Sidecar
from kvstore.wire import peer as w
from tests.cluster.directories import KINDS, DirectoryServer, directory_server
from tests.cluster.nodes import BLOCK, blocks, client_of, keys_for
from tests.cluster.relay import Relay

# which node has cluster.peer_encryption on: a connection is encrypted when either has it
SIDES = {"both": (True, True), "holder only": (True, False), "fetcher only": (False, True)}


@pytest.fixture(scope="module", params=KINDS)
def directory(request: pytest.FixtureRequest) -> Iterator[DirectoryServer]:
    with directory_server(request.param) as d:
        yield d


def pieces(data: list[np.ndarray], step: int = 512, size: int = 24) -> list[bytes]:
    """Slices of every block, ``size`` bytes every ``step``: none may cross the wire in the clear."""
    return [bytes(d[i : i + size]) for d in data for i in range(0, d.nbytes - size, step)]


@pytest.mark.parametrize("on", list(SIDES))
async def test_an_observer_on_an_encrypted_path_sees_no_block_root_or_key(
    tmp_path: Path, directory: DirectoryServer, ns: Namespace, on: str
) -> None:
    holder_on, fetcher_on = SIDES[on]
    keys, data = keys_for(ns, 6, seed=70), blocks(6, seed=70)
    relay = Relay()
    await relay.start()
    try:
        via = {"cluster.advertise_address": f"127.0.0.1:{relay.port}"}  # B reaches A through the relay
        async with Sidecar(directory.config(tmp_path, "a", **via, **{"cluster.peer_encryption": holder_on})) as a, \
                Sidecar(directory.config(tmp_path, "b", **{"cluster.peer_encryption": fetcher_on})) as b, \
                client_of(a) as ca, client_of(b) as cb:
            assert a.cluster is not None
            relay.target = a.cluster.server.port
            await ca.put_blocks(ns, keys, data, wait_published=True)
            got = await cb.get_blocks(ns, keys, verify=True)
            assert [bytes(g) for g in got] == [bytes(d) for d in data]  # fetched, through the relay
            assert relay.connections == 1 and len(relay.back) > sum(d.nbytes for d in data)
            seen = bytes(relay.sent) + bytes(relay.back)
            assert not any(p in seen for p in pieces(data)), "block bytes crossed the path in the clear"
            root = a.store.namespace(ns).root
            assert root[:16] not in seen and not any(k[:16] in seen for k in keys), "a root or key in the clear"
    finally:
        await relay.close()


async def test_a_byte_flipped_on_the_wire_is_a_miss_caught_by_the_frame_not_the_checksum(
    tmp_path: Path, directory: DirectoryServer, ns: Namespace
) -> None:
    """A relay flips one byte inside the first block's frame of A's answer: B's fetch is a miss
    (nothing served, the connection dropped), its checksum never had a say (the frame's tag failed
    first), and a fetch after it, on a new connection the relay leaves alone, gets every block."""
    keys, data = keys_for(ns, 3, seed=71), blocks(3, seed=71)
    relay = Relay()
    await relay.start()
    try:
        via = {"cluster.advertise_address": f"127.0.0.1:{relay.port}"}
        async with Sidecar(directory.config(tmp_path, "a", **via)) as a, \
                Sidecar(directory.config(tmp_path, "b")) as b, client_of(a) as ca, client_of(b) as cb:
            assert a.cluster is not None
            relay.target = a.cluster.server.port
            greeting = peer_hello.GREETING.size + NONCE_BYTES + len(b"a") + peer_hello.INCARNATION.size
            hello = greeting + PROOF_BYTES + len(w.WELCOME)  # A's side of the hello
            head = w.COUNT.size + len(keys) * w.ENTRY.size + MAC_BYTES  # the answer's head
            relay.flip_back = hello + head + BLOCK // 2  # in the first block's frame
            await ca.put_blocks(ns, keys, data, wait_published=True)
            assert await cb.get_blocks(ns, keys, verify=True) == [], "B served a block whose frame was changed"
            stats = (await cb.stats())["cluster"]
            assert len(relay.back) > relay.flip_back, "the relay flipped nothing: the test shows nothing"
            assert stats["fetch_failures"] >= 1 and stats["checksum_failures"] == 0
            assert stats["blocks_fetched"] == 0
            got = await cb.get_blocks(ns, keys, verify=True)  # a new connection, left alone
            assert [bytes(g) for g in got] == [bytes(d) for d in data]
            assert relay.connections == 2
    finally:
        await relay.close()


async def test_a_block_frame_dropped_on_the_way_is_a_miss_caught_by_the_next_frame_not_the_checksum(
    tmp_path: Path, directory: DirectoryServer, ns: Namespace
) -> None:
    """A relay drops the second block's frame of A's answer whole (tag and all) and passes the rest:
    B reads the third block's frame where the second's should be, and it does not open (its nonce
    is the count of frames: a frame out of its place fails as a changed one does). B serves the
    first block, received whole, and nothing of the second or third; the checksum never had a say.
    (On 66d9839, in the clear, the third block's bytes were read as the second's and caught by the
    xxh3 checksum only.)"""
    keys, data = keys_for(ns, 3, seed=72), blocks(3, seed=72)
    relay = Relay()
    await relay.start()
    try:
        via = {"cluster.advertise_address": f"127.0.0.1:{relay.port}"}
        async with Sidecar(directory.config(tmp_path, "a", **via)) as a, \
                Sidecar(directory.config(tmp_path, "b")) as b, client_of(a) as ca, client_of(b) as cb:
            assert a.cluster is not None
            relay.target = a.cluster.server.port
            hello = peer_hello.GREETING.size + NONCE_BYTES + len(b"a") + peer_hello.INCARNATION.size + PROOF_BYTES
            head = w.COUNT.size + len(keys) * w.ENTRY.size + MAC_BYTES  # the answer's head
            frame = BLOCK + MAC_BYTES  # a block of 8 KiB: one frame and its tag
            second = hello + len(w.WELCOME) + head + frame
            relay.drop_back = range(second, second + frame)
            await ca.put_blocks(ns, keys, data, wait_published=True)
            got = await cb.get_blocks(ns, keys, verify=True)
            stats = (await cb.stats())["cluster"]
            assert len(relay.back) >= second + 2 * frame, "the relay dropped nothing: the test shows nothing"
            assert [bytes(g) for g in got] == [bytes(data[0])], "B served a block after the frame dropped"
            assert stats["fetch_failures"] >= 1 and stats["checksum_failures"] == 0
            assert stats["blocks_fetched"] == 1
    finally:
        await relay.close()


async def test_a_relay_that_strips_the_fetchers_wish_for_encryption_gets_no_clear_connection(
    tmp_path: Path, directory: DirectoryServer, ns: Namespace
) -> None:
    """A (the holder) has encryption off, B (the fetcher) on: a relay clears B's flag in B's opening
    on its way to A, so that A would take the connection for a clear one. A's proof covers the
    flags as A read them, B checks it against the flags B sent: it fails, and B closes before it
    sends its proof or a request (were the flags not under the proofs, B would go on and send A an
    encrypted request A reads as a clear one). No connection in the clear, no root or block through
    the relay: a miss (and B's next fetch, the relay left alone, is encrypted and gets every block)."""
    keys, data = keys_for(ns, 3, seed=73), blocks(3, seed=73)
    relay = Relay()
    await relay.start()
    try:
        via = {"cluster.advertise_address": f"127.0.0.1:{relay.port}"}
        async with Sidecar(directory.config(tmp_path, "a", **via, **{"cluster.peer_encryption": False})) as a, \
                Sidecar(directory.config(tmp_path, "b")) as b, client_of(a) as ca, client_of(b) as cb:
            assert a.cluster is not None and b.config.cluster.peer_encryption
            relay.target = a.cluster.server.port
            relay.flip_sent = peer_hello.GREETING.size - 1  # the flags byte of B's opening: ENCRYPT cleared
            await ca.put_blocks(ns, keys, data, wait_published=True)
            got = await cb.get_blocks(ns, keys, verify=True)
            assert got == [], "B fetched over a connection stripped of encryption"
            stats = (await cb.stats())["cluster"]
            assert relay.sent[peer_hello.GREETING.size - 1] == peer_hello.ENCRYPT, "B did not ask for encryption"
            assert stats["fetch_failures"] >= 1 and stats["blocks_fetched"] == 0
            assert a.cluster.server.served_blocks == 0
            root = a.store.namespace(ns).root
            opening = peer_hello.GREETING.size + NONCE_BYTES + len(b"b")
            assert len(relay.sent) == opening, "B sent more than its opening (its proof, a request)"
            assert root[:16] not in relay.sent and a.cluster.server.refused == 0
            relay.flip_sent = None
            got = await cb.get_blocks(ns, keys, verify=True)
            assert [bytes(g) for g in got] == [bytes(d) for d in data]
            assert not any(p in bytes(relay.back) for p in pieces(data)), "the next connection went in the clear"
    finally:
        await relay.close()
