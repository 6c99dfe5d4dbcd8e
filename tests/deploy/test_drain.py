"""A planned stop keeps the hot set: on SIGTERM a real ``kvstore serve`` writes the blocks only DRAM
holds to the SSD (``server.drain_s``), and the sidecar restarted on the same data directory finds
every one of them byte-exact; a drain_s too short for them all counts the rest in its log line,
and the restart finds exactly the ones it says it wrote."""

from __future__ import annotations

import asyncio
import json
import signal

import numpy as np
import pytest

from kvstore.client import SyncClient
from kvstore.keys import Namespace, prefix_keys
from kvstore.tiers.base import decode_header
from kvstore.tiers.segments.tier import SegmentTier

NS = Namespace(model="tiny-llama", kv_layout="raw", dtype="float16", block_size=16)
SMALL_DRAM = {  # 32 slots of 8 KiB
    "KVSTORE_DRAM__CAPACITY_BYTES": str(4 * 65536),
    "KVSTORE_DRAM__PAGE_BYTES": "65536",
    "KVSTORE_DRAM__MIN_SLOT_BYTES": "4096",
}


def _put(sc) -> tuple[dict[bytes, np.ndarray], set[bytes]]:
    """48 blocks in three prompts of 16 (the first pushed down to the SSD by the others); every
    block's bytes, and the keys only DRAM holds."""
    rng = np.random.default_rng(3)
    data: dict[bytes, np.ndarray] = {}
    with SyncClient(sc.grpc) as c:
        for p in range(3):
            ks = prefix_keys(NS, list(range(p * 100_000, p * 100_000 + 16 * 16)))
            blocks = [rng.integers(0, 256, 8192, dtype=np.uint8) for _ in ks]
            c.put_blocks(NS, ks, blocks, checksums=True)
            data.update(zip(ks, blocks))
        tiers = {k: {t for t, _ in c.lookup(NS, [k]).blocks} for k in data}
    return data, {k for k, t in tiers.items() if t == {"dram"}}


def _found(sc, data: dict[bytes, np.ndarray]) -> set[bytes]:
    """The keys the sidecar finds, each read back and checked byte for byte."""
    found = set()
    with SyncClient(sc.grpc) as c:
        for k, want in data.items():
            if c.lookup(NS, [k]).matched:
                (got,) = c.get_blocks(NS, [k], verify=True)
                assert np.array_equal(got, want)
                found.add(k)
    return found


def _drain_line(sc) -> dict:
    events = [json.loads(line) for line in sc.logs().splitlines() if line.startswith("{")]
    (line,) = [e for e in events if e["msg"].startswith("drain:")]
    return line


@pytest.mark.parametrize("layout", ["files", "segments"])
def test_a_planned_stop_keeps_every_block_dram_held(serve_process, tmp_path, layout):
    args = ["--grpc-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0", "--data-dir", str(tmp_path / "d")]
    env = {**SMALL_DRAM, "KVSTORE_SSD__LAYOUT": layout}
    sc = serve_process(args, env)  # drain_s: its default
    data, dram_only = _put(sc)
    assert len(dram_only) == 32  # DRAM full of blocks no other tier holds
    assert sc.stop(signal.SIGTERM) == 0

    again = serve_process(args, env)
    assert _found(again, data) == set(data)  # the 32 DRAM held, and the 16 the SSD held already
    assert again.stop(signal.SIGTERM) == 0
    line = _drain_line(sc)
    assert (line["drain_blocks"], line["drain_written"], line["drain_left"]) == (32, 32, 0)


def test_a_drain_too_short_counts_the_blocks_it_left(serve_process, tmp_path):
    args = ["--grpc-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0", "--data-dir", str(tmp_path / "d")]
    env = {**SMALL_DRAM, "KVSTORE_SERVER__DRAIN_S": "0.000001"}  # over before the first batch starts
    sc = serve_process(args, env)
    data, dram_only = _put(sc)
    assert sc.stop(signal.SIGTERM) == 0
    line = _drain_line(sc)
    assert line["drain_blocks"] == len(dram_only) == 32
    assert line["drain_left"] == 32 - line["drain_written"] > 0

    again = serve_process(args, env)
    found = _found(again, data)
    assert found >= set(data) - dram_only  # what the SSD held before the stop
    assert len(found & dram_only) == line["drain_written"]  # the rest, as counted, is gone
    assert again.stop(signal.SIGTERM) == 0


@pytest.mark.parametrize("layout", ["files", "segments"])
def test_an_ssd_too_small_for_dram_keeps_the_hottest_blocks(serve_process, tmp_path, layout):
    """An SSD for 16 blocks: the drain writes the prompt read last (the hottest) first, its oldest
    blocks giving way, and leaves the other prompt, counted; the restart finds exactly the hot one."""
    args = ["--grpc-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0", "--data-dir", str(tmp_path / "d")]
    block = 4096 + 8192 if layout == "files" else 8192  # (files: a header page + the bytes; segments: a slot)
    env = {**SMALL_DRAM, "KVSTORE_SSD__LAYOUT": layout, "KVSTORE_SSD__CAPACITY_BYTES": str(16 * block)}
    sc = serve_process(args, env)
    data, dram_only = _put(sc)
    keys = list(data)
    hot = keys[32:]  # the third prompt, read again: DRAM's hottest
    with SyncClient(sc.grpc) as c:
        assert c.lookup(NS, hot).matched == 16
    assert set(hot) <= dram_only and len(dram_only) == 32
    assert sc.stop(signal.SIGTERM) == 0

    again = serve_process(args, env)
    assert _found(again, data) == set(hot)
    assert again.stop(signal.SIGTERM) == 0
    line = _drain_line(sc)
    assert (line["drain_blocks"], line["drain_written"], line["drain_left"]) == (32, 16, 16)


@pytest.mark.parametrize(("layout", "footprint"), [("files", 4096 + 8192), ("segments", 8192)])
def test_a_drain_batch_is_never_a_victim_of_its_own_room(serve_process, tmp_path, layout, footprint):
    """An SSD for 16 blocks: once it holds 16 drained blocks, the next batch finds nothing that may
    give way and is refused whole, without a tier error. (Before, the room made for a batch could
    evict the batch's own blocks, placed in the SSD's books but not written yet: eviction counted
    their bytes freed, the tier had never held them, and the put failed "ssd tier full", logged as a
    failed drain and counted as an SSD error -- or landed files the books no longer counted.)"""
    args = ["--grpc-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0", "--data-dir", str(tmp_path / "d")]
    env = {**SMALL_DRAM, "KVSTORE_SSD__LAYOUT": layout, "KVSTORE_SSD__CAPACITY_BYTES": str(16 * footprint)}
    sc = serve_process(args, env)
    data, dram_only = _put(sc)
    assert len(dram_only) == 32
    assert sc.stop(signal.SIGTERM) == 0
    events = [json.loads(line) for line in sc.logs().splitlines() if line.startswith("{")]
    assert [e["msg"] for e in events if e["msg"].startswith("drain of")] == []  # no drain batch failed
    line = _drain_line(sc)
    assert (line["drain_blocks"], line["drain_written"], line["drain_left"]) == (32, 16, 16)

    again = serve_process(args, env)
    assert len(_found(again, data)) == 16  # what the drain wrote, and nothing it did not count
    assert again.stop(signal.SIGTERM) == 0


# `kvstore serve` with the SSD level's codec a byte-wise XOR (registered by the wrapper, as
# tests/tiers/test_codec.py's): it stands for a compressing codec, the stored bytes unlike the raw ones.
XOR_SERVE = """
import sys
import numpy as np
from kvstore import codec
from kvstore.cli import main
from kvstore.movers.level import Level

class Xor:
    id = 200
    name = "xor-test"
    def stored_size(self, size):
        return size
    def encode(self, raw):
        return memoryview((np.frombuffer(raw, np.uint8) ^ 0x5A).tobytes())
    def decode(self, stored, into):
        np.frombuffer(into, np.uint8)[:] = np.frombuffer(stored, np.uint8) ^ 0x5A

XOR = Xor()
codec.register(XOR)
init = Level.__init__

def with_codec(self, name, *args, **kw):
    init(self, name, *args, **kw)
    if name == "ssd":
        self.codec = XOR

Level.__init__ = with_codec
sys.exit(main(["serve", *sys.argv[1:]]))
"""


@pytest.mark.parametrize("layout", ["files", "segments"])
def test_a_drained_block_goes_through_the_ssd_codec(serve_process, tmp_path, layout):
    """A drain writes a block as a demotion does, through the SSD level's codec: every block on the
    SSD after the stop (the 16 demoted, the 32 drained) names the codec and holds the encoded bytes,
    and the restart reads each back byte-exact. (Before, the drain wrote ``Level.meta`` and the raw
    bytes: the 32 drained blocks were stored as they are, past the codec.)"""
    args = ["--grpc-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0", "--data-dir", str(tmp_path / "d")]
    env = {**SMALL_DRAM, "KVSTORE_SSD__LAYOUT": layout}
    sc = serve_process(args, env, entry=("-c", XOR_SERVE))
    data, dram_only = _put(sc)
    assert len(dram_only) == 32
    assert sc.stop(signal.SIGTERM) == 0
    line = _drain_line(sc)
    assert (line["drain_blocks"], line["drain_written"], line["drain_left"]) == (32, 32, 0)

    stored = _stored(tmp_path / "d", layout)
    assert set(stored) == set(data)
    for k, want in data.items():
        codec_id, payload = stored[k]
        assert codec_id == 200, (k in dram_only, codec_id)
        assert payload == (want ^ 0x5A).tobytes()

    again = serve_process(args, env, entry=("-c", XOR_SERVE))
    assert _found(again, data) == set(data)  # decoded, byte-exact
    assert again.stop(signal.SIGTERM) == 0


def _stored(data_dir, layout: str) -> dict[bytes, tuple[int, bytes]]:
    """Each block the SSD directory holds: its key, the codec its record names, its stored bytes."""
    out: dict[bytes, tuple[int, bytes]] = {}
    if layout == "files":
        for path in data_dir.rglob("*.blk"):
            raw = path.read_bytes()
            meta = decode_header(raw)
            out[bytes(meta.ref.key)] = (meta.codec, raw[len(raw) - meta.size :])
        return out
    tier = SegmentTier(data_dir / "ssd", 1 << 30)  # (opened as a restart would, read here)

    async def read() -> None:
        try:
            async for meta in tier.scan():
                place = tier.locate(meta.ref)
                assert place is not None
                path, offset, size = place
                with open(path, "rb") as f:
                    f.seek(offset)
                    out[bytes(meta.ref.key)] = (meta.codec, f.read(size))
        finally:
            await tier.close()

    asyncio.run(read())
    return out
