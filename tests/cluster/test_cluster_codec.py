"""The codec on the peer data path (kvstore.codec): each answer entry names the codec of the bytes
sent; the fetcher decodes them before it hashes them (the checksum is of the raw bytes), and an
entry naming a codec it does not know ends the fetch with an error that says so (a miss).

A holder on a real socket that says the hello right (a real PeerClient fetches from it), and a
throwaway codec registered from the test (tests/tiers/test_codec.py's XOR)."""

from __future__ import annotations

import numpy as np

from kvstore.checksum import checksum
from kvstore.cluster import peer_hello
from kvstore.cluster.peer_client import FetchResult
from kvstore.wire import peer as peer_wire
from tests.cluster.fake_holder import answering
from tests.cluster.nodes import BLOCK, blocks
from tests.tiers.test_codec import xor, xor_codec  # noqa: F401  # (a fixture)


async def fetch_from_holder(codec_id: int, raw: bytes, sent: bytes) -> tuple[FetchResult, np.ndarray]:
    """Fetch one block from a holder whose answer sends ``sent`` under an entry naming ``codec_id``
    (and the checksum of ``raw``)."""
    async with answering(peer_wire.Entry(BLOCK, checksum(raw), codec=codec_id), sent) as holder:
        return await holder.fetch(), holder.into


async def test_a_block_sent_through_a_codec_arrives_raw_and_its_checksum_holds(xor_codec) -> None:  # noqa: F811
    raw = blocks(1, seed=9)[0].tobytes()
    result, into = await fetch_from_holder(xor_codec.id, raw, xor(raw))
    assert result.error == ""
    assert into.tobytes() == raw and result.hashes == result.checksums == [checksum(raw)]


async def test_an_answer_naming_an_unknown_codec_is_refused_and_nothing_is_taken() -> None:
    raw = blocks(1, seed=10)[0].tobytes()
    result, into = await fetch_from_holder(201, raw, xor(raw))
    assert result.checksums == [] and result.hashes == []
    assert "unknown codec id 201" in result.error
    assert not into.any()


def test_the_answer_entry_carries_the_codec() -> None:
    assert peer_wire.ENTRY.size == 22 and peer_hello.MAGIC == b"KVP5"
    assert peer_wire.ENTRY.unpack(peer_wire.entries([peer_wire.Entry(8, 1, 0, 0, 200)]))[-1] == 200

