"""Smoke test: ``benchmarks.tiers`` runs end to end with tiny sizes and returns its JSON shape.

No timed assertions: only that every figure and ratio it promises is there and well formed.
"""

from __future__ import annotations

import json
import os

from benchmarks import tiers


def test_tiers_bench_shape(tmp_path) -> None:
    args = tiers.parser().parse_args(
        ["--blocks", "2", "--block-mib", "0.0625", "--repeat", "1", "--tiers", "ssd,redis", "--ssd-dir", str(tmp_path)]
    )
    result = tiers.run(args)
    json.dumps(result)  # serialisable as the CLI prints it
    assert result["suite"] == "tiers"
    for tier in ("ssd", "redis"):
        for kind in ("tier", "service"):
            for op in ("put", "get"):
                assert result["ratios"][f"{kind}_{op}_{tier}"] > 0
                for side in ("ours", "raw"):
                    fig = result["figures"][f"{kind}.{tier}.{op}.{side}"]
                    assert fig["unit"] == "MiB/s" and fig["value"] > 0
    for side in ("ours", "raw"):  # Redis memory per block byte, each side holding the same blocks
        fig = result["figures"][f"tier.redis.memory.{side}"]
        assert fig["unit"] == "bytes per block byte" and fig["value"] >= 1
    assert result["ratios"]["memory_redis"] > 0
    assert result["figures"]["block_bytes"]["value"] == 65536
    assert result["figures"]["blocks"]["value"] == 2


def test_raw_baselines_match_the_tier(tmp_path) -> None:
    """Every raw baseline runs at the tier's concurrency (the SSD tier's io_threads, the Redis
    tier's pipelines), the single-stream raw figures sit beside them (never as a ratio), and the
    SSD put is measured on the same kind of file on both sides: overwriting (the tier recycles
    its files, as by default) and new files (recycling off)."""
    from kvstore.config import REDIS_PIPELINES, SSD_IO_THREADS

    args = tiers.parser().parse_args(
        ["--blocks", "4", "--block-mib", "0.0625", "--repeat", "2", "--tiers", "ssd,redis", "--no-service",
         "--ssd-dir", str(tmp_path)]
    )
    result = tiers.run(args)
    figures, ratios = result["figures"], result["ratios"]
    streams = result["notes"]["raw_streams"]
    assert streams["ssd"] == {"raw": SSD_IO_THREADS, tiers.SINGLE: 1}
    assert streams["ssd_fresh"] == {"raw": SSD_IO_THREADS, tiers.SINGLE: 1}
    assert streams["redis"] == {"raw": min(4, REDIS_PIPELINES), tiers.SINGLE: 1}  # 4 blocks: at most 4 pipelines
    assert streams["ssd_segments"] == {"raw": SSD_IO_THREADS, tiers.SINGLE: 1}
    for tier, ops in (("ssd", ("put", "get")), ("ssd_segments", ("put", "get")), ("ssd_fresh", ("put",)),
                      ("redis", ("put", "get"))):
        for op in ops:
            assert figures[f"tier.{tier}.{op}.{tiers.SINGLE}"]["value"] > 0
            assert ratios[f"tier_{op}_{tier}"] > 0
    assert "tier_get_ssd_fresh" not in ratios
    assert not [k for k in ratios if "single" in k]
    # (untimed warm-up + 2 rounds) x 4 blocks overwrote recycled files; the fresh tier never did
    assert figures["tier.ssd.files_reused"]["value"] >= 2 * 4
    assert figures["tier.ssd_fresh.files_reused"]["value"] == 0


def _resident_pages(path) -> int:
    """Pages of ``path`` in the page cache (mincore on a mapping of it)."""
    import ctypes
    import mmap
    import os

    size = os.path.getsize(path)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        vec = ctypes.create_string_buffer(-(-size // mmap.PAGESIZE))
        try:
            assert libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return sum(b & 1 for b in vec.raw)


def test_drop_page_cache_leaves_no_page_of_any_file_cached(tmp_path) -> None:
    """The cold get's set-up: every file under the given directories (nested too) leaves the page
    cache, written or read, so the next read goes to the device."""
    files = [tmp_path / "a.bin", tmp_path / "sub" / "b.bin"]
    files[1].parent.mkdir()
    for f in files:
        f.write_bytes(os.urandom(256 * 1024))
        f.read_bytes()
    assert all(_resident_pages(f) > 0 for f in files)
    tiers._drop_page_cache([tmp_path])
    assert [_resident_pages(f) for f in files] == [0, 0]


def test_peers_absent_says_why_and_the_run_goes_on(tmp_path, monkeypatch) -> None:
    """``--peers`` where LMCache cannot be imported (as in CI): kvstore's figures as usual, no
    LMCache figure or ratio, and ``notes.lmcache`` with the exact error."""
    from benchmarks.peers import lmcache_backends

    def missing():
        raise ModuleNotFoundError("No module named 'lmcache'")

    monkeypatch.setattr(lmcache_backends, "_import_lmcache", missing)
    args = tiers.parser().parse_args(
        [
            "--blocks",
            "2",
            "--block-mib",
            "0.0625",
            "--repeat",
            "1",
            "--tiers",
            "ssd",
            "--no-service",
            "--peers",
            "--ssd-dir",
            str(tmp_path),
        ]
    )
    result = tiers.run(args)
    assert result["notes"]["lmcache"] == "not run: ModuleNotFoundError: No module named 'lmcache'"
    assert not [k for k in result["ratios"] if k.startswith("vs_")]
    assert not [k for k in result["figures"] if k.startswith("lmcache")]
    for tier in ("ssd", "ssd_nofsync", "ssd_direct_nofsync"):  # the like-for-like modes still run
        assert result["ratios"][f"tier_put_{tier}"] > 0 and result["ratios"][f"tier_get_{tier}"] > 0
