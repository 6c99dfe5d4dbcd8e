import hashlib
import struct
import subprocess
import sys

import pytest

from kvstore.errors import InvalidArgument
from kvstore.keys import (
    Namespace,
    PrefixKeys,
    chain_key,
    engine_key,
    namespace_root,
    prefix_keys,
)

NS = Namespace(model="m", kv_layout="vllm_cpu", dtype="bfloat16", block_size=4, revision="r1", cache_salt="tenant-a")


def test_scheme_matches_the_written_spec():
    # Recompute h_0 and h_1 by hand from the module docstring, with no help from kvstore.keys.
    def field(n: str, v: str) -> bytes:
        return struct.pack("<I", len(n)) + n.encode() + struct.pack("<I", len(v)) + v.encode()

    fields = [("model", "m"), ("revision", "r1"), ("kv_layout", "vllm_cpu"), ("dtype", "bfloat16"), ("block_size", "4"),
              ("rank", "0"), ("world_size", "1"), ("adapter", ""), ("cache_salt", "tenant-a")]
    h0 = hashlib.sha256(b"kvstore/v1/namespace" + b"".join(field(n, v) for n, v in fields)).digest()
    assert namespace_root(NS) == h0
    toks = [1, 2, 3, 70000]
    h1 = hashlib.sha256(h0 + struct.pack("<I", 4) + struct.pack("<4I", *toks) + struct.pack("<I", 0)).digest()
    assert prefix_keys(NS, [*toks, 5, 6])[0] == h1
    assert len(prefix_keys(NS, [*toks, 5, 6])) == 1  # the partial block is not keyed


def test_keys_chain_so_one_key_certifies_the_prefix():
    a = prefix_keys(NS, [1, 2, 3, 4, 5, 6, 7, 8])
    b = prefix_keys(NS, [9, 2, 3, 4, 5, 6, 7, 8])
    assert a[1] != b[1]  # same second block, different first block
    assert chain_key(a[0], [5, 6, 7, 8]) == a[1]


def test_keys_of_a_list_an_array_and_one_block_at_a_time_agree():
    import numpy as np

    toks = [1, 2, 3, 70000, 2**32 - 1, 0, 7, 8, 9, 10, 11]
    by_hand = [chain_key(NS.root, toks[:4])]
    by_hand.append(chain_key(by_hand[0], toks[4:8]))
    assert prefix_keys(NS, toks) == prefix_keys(NS, np.array(toks, dtype=np.int64)) == by_hand


def test_prefix_keys_of_a_growing_sequence_hash_each_block_once_and_notice_changes():
    keys = PrefixKeys(NS)
    toks = list(range(100, 130))
    assert keys.of(toks[:9]) == prefix_keys(NS, toks[:9])  # 2 blocks
    assert keys.of(toks) == prefix_keys(NS, toks)  # 7 blocks: 5 more hashed
    assert keys.of(toks[:12]) == prefix_keys(NS, toks[:12])  # a prefix: served from what is known
    changed = [*toks[:5], 0, *toks[6:]]
    assert keys.of(changed) == prefix_keys(NS, changed)  # other tokens: keyed from scratch
    assert keys.of(toks) == prefix_keys(NS, toks)


@pytest.mark.parametrize(
    "field,value",
    [("model", "m2"), ("revision", "r2"), ("kv_layout", "vllm_gpu"), ("dtype", "float16"), ("block_size", 8),
     ("adapter", "lora1"), ("cache_salt", "tenant-b")],
)
def test_every_namespace_field_changes_the_root(field, value):
    import dataclasses

    other = dataclasses.replace(NS, **{field: value})
    assert namespace_root(other) != namespace_root(NS)


def test_rank_changes_the_root():
    import dataclasses

    assert namespace_root(dataclasses.replace(NS, rank=1, world_size=2)) != namespace_root(
        dataclasses.replace(NS, world_size=2)
    )


def test_keys_are_identical_in_another_process():
    code = (
        "from kvstore.keys import Namespace, prefix_keys;"
        "ns = Namespace(model='m', kv_layout='vllm_cpu', dtype='bfloat16', block_size=4, revision='r1',"
        " cache_salt='tenant-a');"
        "print(','.join(k.hex() for k in prefix_keys(ns, list(range(1000, 1013)))))"
    )
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": str(seed), "PATH": ""}).stdout.strip() for seed in (1, 2)}
    assert outs == {",".join(k.hex() for k in prefix_keys(NS, list(range(1000, 1013))))}


def test_engine_hashes_are_scoped_by_namespace():
    import dataclasses

    other = dataclasses.replace(NS, cache_salt="tenant-b")
    assert engine_key(NS, b"\x01" * 32) != engine_key(other, b"\x01" * 32)
    assert len(engine_key(NS, b"\x01" * 16)) == 32


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(model="", kv_layout="raw", dtype="float16", block_size=4), "namespace.model"),
        (dict(model="m", kv_layout="weird", dtype="float16", block_size=4), "namespace.kv_layout"),
        (dict(model="m", kv_layout="raw", dtype="float64", block_size=4), "namespace.dtype"),
        (dict(model="m", kv_layout="raw", dtype="float16", block_size=0), "namespace.block_size"),
        (dict(model="m", kv_layout="raw", dtype="float16", block_size=4, rank=2, world_size=2), "namespace.rank"),
    ],
)
def test_invalid_namespaces_name_the_field(kwargs, field):
    with pytest.raises(InvalidArgument, match=field):
        Namespace(**kwargs)
