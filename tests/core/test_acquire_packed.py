"""The packed Acquire answer (``AcquireRequest.packed``): the same run as one ``AcquiredBlock`` per
block, as arrays; the clients read either form (:func:`kvstore.client.calls.acquired`), and an
answer whose arrays disagree is refused, naming the field. The Allocate answer's writable slots are
checked by the same function as the Acquire answer's (:func:`kvstore.client.calls.mapped_views`)."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from kvstore.client import KVStoreClient, SlotRef, namespace_pb
from kvstore.client.calls import acquired
from kvstore.errors import KVStoreError
from kvstore.keys import Namespace, prefix_keys
from kvstore.server.sidecar import Sidecar
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc


async def test_both_forms_say_the_same_and_the_clients_read_either(
    sidecar: Sidecar, client: KVStoreClient, ns: Namespace,
) -> None:
    keys = prefix_keys(ns, list(range(16 * 4)))
    blocks = [np.full(4096 - 64 * i, i + 1, np.uint8) for i in range(3)]  # sizes differ block to block
    await client.put_blocks(ns, keys[:3], blocks, checksums=True)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.grpc_port}") as ch:
        stub = pb_grpc.KVStoreStub(ch)
        answers = {}
        for packed in (False, True):
            r = await stub.Acquire(pb.AcquireRequest(namespace=namespace_pb(ns), keys=keys, packed=packed))
            answers[packed] = r
            await stub.Release(pb.ReleaseRequest(lease_id=r.lease_id))
        old, new = answers[False], answers[True]
        assert len(old.blocks) == 3 and not old.offsets and not old.segment
        assert not new.blocks and len(new.offsets) == len(new.lengths) == len(new.checksums) == 3
        assert new.segment == sidecar.store.slab.name and list(new.lengths) == [b.size for b in blocks]
        assert all(new.checksums)  # sealed by the Commit's checksums
        assert acquired(new, len(keys)) == acquired(old, len(keys))
        assert acquired(new, len(keys))[0] == [
            SlotRef(b.slot.segment, b.slot.offset, b.slot.length) for b in old.blocks]
        assert [b.key for b in old.blocks] == keys[:3]
        miss = await stub.Acquire(pb.AcquireRequest(namespace=namespace_pb(ns), keys=keys[3:], packed=True))
        assert (miss.lease_id, miss.segment, len(miss.offsets)) == ("", "", 0)
        assert acquired(miss, 1) == ([], [])
    async with client.acquire(ns, keys) as lease:  # the client asks for the packed form
        assert lease.request.packed and lease.keys == keys[:3]
        assert [v.tobytes() for v in lease.views] == [b.tobytes() for b in blocks]
        assert not any(v.flags.writeable for v in lease.views)
        assert lease.verify() == 3


def _packed(n: int, **fields: object) -> pb.AcquireResponse:
    base: dict[str, object] = {"lease_id": "l", "segment": "/kvstore-x", "offsets": [4096 * i for i in range(n)],
                               "lengths": [4096] * n, "checksums": [7] * n}
    return pb.AcquireResponse(**{**base, **fields})


@pytest.mark.parametrize(("answer", "asked", "field"), [
    (_packed(3, lengths=[4096] * 2), 3, "lengths has 2 entries for 3 offsets"),
    (_packed(3, checksums=[7] * 4), 3, "checksums has 4 entries for 3 offsets"),
    (_packed(3, checksums=[]), 3, "checksums has 0 entries for 3 offsets"),
    (_packed(3), 2, "offsets has 3 entries for 2 keys asked"),
    (_packed(2, segment=""), 2, "segment: empty"),
])
def test_a_packed_answer_whose_arrays_disagree_is_refused_naming_the_field(
    answer: pb.AcquireResponse, asked: int, field: str,
) -> None:
    wire = pb.AcquireResponse.FromString(answer.SerializeToString())  # as it arrives
    with pytest.raises(KVStoreError, match=field) as info:
        acquired(wire, asked)
    assert info.value.code == grpc.StatusCode.INTERNAL  # the server's fault, as gRPC says of an unreadable answer


def test_a_slot_past_its_segments_end_is_refused_by_the_client_and_the_connector(sidecar: Sidecar) -> None:
    """A packed answer's ``offsets``/``lengths`` are checked against the segment they name: a
    slice past the mapping's end (or from a negative offset) would silently come back shorter
    than the block, and the caller would read or copy a truncated block as a whole one. Both
    readers of a run's places (the client's lease and the connector's held lease) refuse it."""
    from connector.roles.finders import HeldLease
    from connector.roles.ops import _read_held
    from kvstore.client.calls import LeaseState
    from kvstore.dram.slab import attach

    seg = sidecar.store.slab.name
    size = len(attach(seg))
    whole = _packed(2, segment=seg, offsets=[0, size - 4096], lengths=[4096, 4096])
    lease = LeaseState(pb.AcquireRequest(keys=[b"k" * 32] * 2, packed=True))
    lease._fill(whole)  # ends exactly at the segment's end: fine
    assert [len(v) for v in lease.views] == [4096, 4096]
    bad = [(0, size + 1), (size - 4095, 4096), (size, 1)]
    for off, n in bad:
        answer = _packed(2, segment=seg, offsets=[0, off], lengths=[4096, n])
        with pytest.raises(KVStoreError, match=r"offsets\[1\] .* lengths\[1\] .* not within") as info:
            LeaseState(pb.AcquireRequest(keys=[b"k" * 32] * 2, packed=True))._fill(answer)
        assert info.value.code == grpc.StatusCode.INTERNAL
    for off, n in [*bad, (-1, 4096)]:
        held = HeldLease("l", slots=(SlotRef(seg, 0, 4096), SlotRef(seg, off, n)), checksums=(0, 0))
        with pytest.raises(KVStoreError, match=r"offsets\[1\] .* lengths\[1\] .* not within") as info, \
                _read_held(held):
            pass
        assert info.value.code == grpc.StatusCode.INTERNAL


async def test_an_allocate_answer_with_a_bad_slot_is_refused_before_any_view_is_written(sidecar: Sidecar) -> None:
    """The slots an Allocate answer hands out to be written are checked as the Acquire answer's are
    (one function), and more, since a write through them lands in the sidecar's slab: a slot not
    whole within its segment, a slot that overlaps another (a second block written over the first's
    bytes, served to its readers), a length other than the size asked, a key other than asked (one
    block's bytes committed under another's key), or a block count other than asked is refused with
    INTERNAL naming the field, before any view is handed out."""
    from kvstore.client.calls import AllocationState
    from kvstore.dram.slab import attach

    ns = Namespace(model="m", kv_layout="raw", dtype="uint8", block_size=4)
    keys = prefix_keys(ns, list(range(4 * 2)))
    request = pb.AllocateRequest(namespace=namespace_pb(ns), blocks=[
        pb.BlockSpec(key=keys[0], size=4096), pb.BlockSpec(key=keys[1], parent=keys[0], size=4096)])
    async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.grpc_port}") as ch:
        answer = await pb_grpc.KVStoreStub(ch).Allocate(request)
    good = AllocationState(request)
    good._fill(answer)
    assert [(i, len(v), v.flags.writeable) for i, v in good.writable()] == [(0, 4096, True), (1, 4096, True)]
    size = len(attach(answer.blocks[0].slot.segment))
    first = answer.blocks[0].slot.offset

    def bad(**slot: int) -> pb.AllocateResponse:
        changed = pb.AllocateResponse.FromString(answer.SerializeToString())
        for name, value in slot.items():
            setattr(changed.blocks[1].slot, name, value)
        return changed

    short = pb.AllocateResponse.FromString(answer.SerializeToString())
    del short.blocks[1]
    swapped = pb.AllocateResponse.FromString(answer.SerializeToString())
    swapped.blocks[0].key, swapped.blocks[1].key = keys[1], keys[0]
    for changed, field in [
        (bad(offset=size - 4095), r"blocks\[1\]\.slot\.offset \d+ \+ blocks\[1\]\.slot\.length 4096 is not within"),
        (bad(offset=size), r"blocks\[1\]\.slot\.offset \d+ \+ blocks\[1\]\.slot\.length 4096 is not within"),
        (bad(offset=first + 1024), r"blocks\[1\]\.slot\.offset \d+ lies inside blocks\[0\]\.slot\.offset's slot"),
        (bad(offset=first), r"blocks\[1\]\.slot\.offset \d+ lies inside blocks\[0\]\.slot\.offset's slot"),
        (bad(length=8192), r"blocks\[1\]\.slot\.length 8192 is not the size asked \(4096\)"),
        (bad(length=1024), r"blocks\[1\]\.slot\.length 1024 is not the size asked \(4096\)"),
        (short, r"blocks has 1 entries for 2 blocks asked"),
        (swapped, r"blocks\[0\]\.key is not the key asked"),
    ]:
        state = AllocationState(request)
        with pytest.raises(KVStoreError, match=field) as info:
            state._fill(changed)
        assert info.value.code == grpc.StatusCode.INTERNAL
        assert list(state.writable()) == [] and state.slot_refs() == {}
