"""The gRPC sidecar: a grpc.aio servicer over the block store.

Errors become status codes in exactly one place, :func:`_rpc`: a :class:`KVStoreError` maps to
its own code with its message; anything else is logged and answered INTERNAL, and the server
keeps running. Request bodies are decoded here too (:func:`method_handlers`), so one that is not
the method's message is answered INVALID_ARGUMENT, as on the local socket, and counted.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import operator
from collections.abc import Awaitable, Callable
from time import perf_counter
from typing import Any, TypeVar

import grpc
from google.protobuf import json_format, unknown_fields
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvstore.config import Config
from kvstore.dram.slab import Slab, Slot
from kvstore.errors import MAX_MESSAGE_CHARS, InvalidArgument, KVStoreError, shown
from kvstore.keys import Namespace, prefix_keys
from kvstore.routing import prefix_score, rank
from kvstore.stats.counters import check_decision, document_json
from kvstore.store.block_store import BlockSpec, BlockStore, CommitSpec
from kvstore.store.books.index import Block, Lease, NsEntry
from kvstore.store.remote import MAX_HOLDERS, PeerBlock
from kvstore.tier_table import LOWER, TOP_PROTO, all_bits
from kvstore.util.logs import Throttled
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVStore"].full_name
# placement mask -> the proto value of its fastest tier (kvstore/tier_table.py's proto column)
_MASK_TO_PB = TOP_PROTO

_TIERS = operator.attrgetter("tiers")
_SIZE = operator.attrgetter("size")


def _pb_tiers(run: list[Block], masks: set[int]) -> bytes:
    if len(masks) == 1:  # the common case: one tier for the whole run
        return bytes((_MASK_TO_PB[next(iter(masks))],)) * len(run)
    return bytes(map(_MASK_TO_PB.__getitem__, map(_TIERS, run)))


MAX_SHARDS = 64  # further shards one Acquire names (AcquireRequest.shards): tensor x pipeline parallel ranks
MAX_ROUTE_NODES = 256  # nodes one Route answer lists (the best ones): its size and cost bounded by the members


def _cluster_lookup(
    run: list[Block], masks: set[int], lease: Lease | None, peers: list[PeerBlock]
) -> pb.LookupResponse:
    """A Lookup's answer whose run goes on through other nodes' blocks (``peers``). The run ends
    before the block of a holder past the :data:`MAX_HOLDERS` th (a miss from there on)."""
    nodes: dict[str, int] = {}
    for i, p in enumerate(peers):
        if nodes.setdefault(p.node, len(nodes)) >= MAX_HOLDERS:
            del nodes[p.node]
            peers = peers[:i]
            break
    sizes = [*map(_SIZE, run), *(p.size for p in peers)]
    uniform = sizes[0] if sizes and sizes.count(sizes[0]) == len(sizes) else 0
    return pb.LookupResponse(
        matched=len(sizes),
        local=len(run),
        tiers=_pb_tiers(run, masks) + bytes((pb.TIER_PEER,)) * len(peers),
        sizes=() if uniform else sizes,
        uniform_size=uniform,
        lease_id=lease.id if lease else "",
        nodes=list(nodes),
        holders=bytes(nodes[p.node] for p in peers),
        peer_tiers=bytes(_MASK_TO_PB[p.tiers & all_bits()] for p in peers),
    )


Req = TypeVar("Req")
Resp = TypeVar("Resp")
Context = grpc.aio.ServicerContext[Any, Any]
Handler = Callable[["KVStoreServicer", Req, Context], Awaitable[Resp]]


def _rpc(method: Handler[Req, Resp]) -> Handler[Req, Resp]:
    """The method, its errors answered as status codes and its time in the ``rpc`` latency
    histogram by transport (the context's ``transport``: the local socket's says "local"),
    method and outcome: one clock read at each end, one bucket increment."""
    name = method.__name__

    @functools.wraps(method)
    async def wrapper(self: KVStoreServicer, request: Req, context: Context) -> Resp:
        start = perf_counter()
        outcome = "ok"
        try:
            return await method(self, request, context)
        except KVStoreError as exc:
            outcome = exc.code.name
            self.store.stats.errors[outcome] += 1
            await context.abort(exc.code, str(exc)[:MAX_MESSAGE_CHARS])  # (values in it are shown())
        except asyncio.CancelledError:
            outcome = "CANCELLED"
            raise
        except Exception as exc:  # a bug: keep serving, say so loudly
            if isinstance(exc, grpc.aio.AbortError):
                outcome = "ABORTED"
                raise
            outcome = "INTERNAL"
            log.exception("internal error in %s", name)
            self.store.stats.errors["INTERNAL"] += 1
            await context.abort(grpc.StatusCode.INTERNAL, f"{name}: internal error: {type(exc).__name__}: {exc}")
        finally:
            labels = (getattr(context, "transport", "grpc"), name, outcome)
            self.store.stats.latency.histogram("rpc", labels).since(start)
        raise AssertionError("unreachable")

    return wrapper


def _slot_pb(slab: Slab, block: Block) -> pb.SlotDescriptor:
    slot: Slot = block.slot  # type: ignore[assignment]  # Block.slot is typed object (kvstore/store/books/index.py)
    return pb.SlotDescriptor(segment=slab.name, offset=slot.offset, length=block.size, slot_id=slot.slot_id)


_OFFSET = operator.attrgetter("slot.offset")


def _packed_acquire(lease_id: str, slab: Slab, run: list[Block]) -> pb.AcquireResponse:
    """An Acquire's answer as arrays (``AcquireRequest.packed``): three lists, no message per block."""
    if not run:
        return pb.AcquireResponse(lease_id=lease_id)
    return pb.AcquireResponse(
        lease_id=lease_id,
        segment=slab.name,
        offsets=list(map(_OFFSET, run)),
        lengths=list(map(_SIZE, run)),
        checksums=[b.checksum or 0 for b in run],
    )


class KVStoreServicer(pb_grpc.KVStoreServicer):
    def __init__(self, store: BlockStore) -> None:
        self.store = store
        self.local_socket = ""  # set once the local transport (kvstore.server.local_server) listens
        self._ns_cache: dict[bytes, Namespace] = {}  # wire form -> validated namespace
        self._bad_warning = Throttled(log)  # undecodable bodies: one line per 10 s at most

    def _namespace(self, request: Any) -> NsEntry:
        """The namespace entry of a request that carries one (Lookup, Allocate, Acquire, ...)."""
        if not request.HasField("namespace"):
            raise InvalidArgument("namespace: required")
        msg = request.namespace
        raw = msg.SerializeToString(deterministic=True)
        ns = self._ns_cache.get(raw)
        if ns is not None:
            return self.store.namespace(ns)
        unknown = unknown_fields.UnknownFieldSet(msg)
        if len(unknown):
            numbers = sorted({unknown[i].field_number for i in range(len(unknown))})
            raise InvalidArgument(f"namespace: unknown field number(s) {numbers}; this server speaks kvstore.v1")
        ns = Namespace(
            model=msg.model,
            revision=msg.revision,
            kv_layout=msg.kv_layout,
            dtype=msg.dtype,
            block_size=msg.block_size,
            rank=msg.rank,
            world_size=msg.world_size or 1,
            adapter=msg.adapter,
            cache_salt=msg.cache_salt,
        )
        if len(self._ns_cache) > 4096:
            self._ns_cache.clear()
        self._ns_cache[raw] = ns
        return self.store.namespace(ns)

    @_rpc
    async def Lookup(self, request: pb.LookupRequest, context: Context) -> pb.LookupResponse:
        ns = self._namespace(request)
        keys = list(request.keys)
        if not self.store.remote.active:
            run, masks, lease = self.store.lookup(ns, keys, request.lease_ttl_ms)
            return pb.LookupResponse(
                matched=len(run),
                local=len(run),
                tiers=_pb_tiers(run, masks),
                sizes=() if (uniform := ns.uniform_size) else list(map(_SIZE, run)),
                uniform_size=uniform,
                lease_id=lease.id if lease else "",
            )
        run, masks, lease, peers = await self.store.lookup_cluster(ns, keys, request.lease_ttl_ms)
        return _cluster_lookup(run, masks, lease, peers)

    @_rpc
    async def Allocate(self, request: pb.AllocateRequest, context: Context) -> pb.AllocateResponse:
        ns = self._namespace(request)
        specs = [BlockSpec(b.key, b.parent, b.size) for b in request.blocks]
        alloc, slots = await self.store.allocate(ns, specs, request.ttl_ms)
        slab = self.store.slab
        out = []
        for spec, slot in zip(specs, slots):
            if slot is None:
                out.append(pb.AllocatedBlock(key=spec.key, present=True))
            else:
                out.append(
                    pb.AllocatedBlock(
                        key=spec.key,
                        slot=pb.SlotDescriptor(
                            segment=slab.name, offset=slot.offset, length=spec.size, slot_id=slot.slot_id
                        ),
                    )
                )
        return pb.AllocateResponse(allocation_id=alloc.id, blocks=out)

    @_rpc
    async def Commit(self, request: pb.CommitRequest, context: Context) -> pb.CommitResponse:
        if not request.allocation_id:
            raise InvalidArgument("allocation_id: required")
        specs = [CommitSpec(b.key, b.slot_id, b.checksum if b.has_checksum else None) for b in request.blocks]
        committed, written = await self.store.commit(
            request.allocation_id,
            specs,
            wait_write_through=request.wait_write_through,
            wait_published=request.wait_published,
            retain_ms=request.retain_ms,
            retain_priority=request.retain_priority,
        )
        return pb.CommitResponse(committed=committed, written_through=written)

    @_rpc
    async def Abort(self, request: pb.AbortRequest, context: Context) -> pb.AbortResponse:
        if not request.allocation_id:
            raise InvalidArgument("allocation_id: required")
        return pb.AbortResponse(released=self.store.abort(request.allocation_id))

    @_rpc
    async def Acquire(self, request: pb.AcquireRequest, context: Context) -> pb.AcquireResponse:
        ns = self._namespace(request)
        if request.shards:
            return await self._acquire_shards(ns, request)
        lease, blocks = await self.store.acquire(
            ns, request.keys, request.lease_ttl_ms, request.retain_ms, request.retain_priority
        )
        return self._acquired(request, lease.id if lease else "", blocks)

    def _acquired(self, request: pb.AcquireRequest, lease_id: str, blocks: list[Block]) -> pb.AcquireResponse:
        slab = self.store.slab
        if request.packed:
            return _packed_acquire(lease_id, slab, blocks)
        return pb.AcquireResponse(
            lease_id=lease_id,
            blocks=[pb.AcquiredBlock(key=b.key, slot=_slot_pb(slab, b), checksum=b.checksum or 0) for b in blocks],
        )

    async def _acquire_shards(self, ns: NsEntry, request: pb.AcquireRequest) -> pb.AcquireResponse:
        """An Acquire over several shards of the same blocks (``AcquireRequest.shards``): each
        shard asks only for the run the shards before it hold; every run is cut to the shortest.
        Checked whole before anything is leased."""
        if len(request.shards) > MAX_SHARDS:
            raise InvalidArgument(f"shards: {len(request.shards)} shards exceed the limit of {MAX_SHARDS}")
        n = len(request.keys)
        for i, shard in enumerate(request.shards):
            if len(shard.keys) != n:
                raise InvalidArgument(f"shards[{i}].keys: {len(shard.keys)} keys, expected {n} (one per block as keys)")
        entries = [ns]
        for i, shard in enumerate(request.shards):
            try:
                entries.append(self._namespace(shard))
            except InvalidArgument as exc:
                raise InvalidArgument(f"shards[{i}].{exc}") from exc
        keys = [list(request.keys), *(list(s.keys) for s in request.shards)]
        runs: list[tuple[str, list[Block]]] = []
        try:
            for entry, shard_keys in zip(entries, keys):
                lease, blocks = await self.store.acquire(
                    entry, shard_keys[:n], request.lease_ttl_ms, request.retain_ms, request.retain_priority
                )
                runs.append((lease.id if lease else "", blocks))
                n = min(n, len(blocks))
                if n == 0:
                    break
        except BaseException:
            n = 0
            raise
        finally:
            if n == 0:  # nothing every shard holds (or an error): no lease outlives the call
                for lease_id, _ in runs:
                    if lease_id:
                        self.store.release(lease_id)
                runs = [("", [])] * len(entries)
        runs += [("", [])] * (len(entries) - len(runs))
        answers = [self._acquired(request, lease_id, blocks[:n]) for lease_id, blocks in runs]
        top = answers[0]
        top.shards.extend(answers[1:])
        return top

    @_rpc
    async def Release(self, request: pb.ReleaseRequest, context: Context) -> pb.ReleaseResponse:
        if not request.lease_id:
            raise InvalidArgument("lease_id: required")
        return pb.ReleaseResponse(released=self.store.release(request.lease_id))

    @_rpc
    async def Delete(self, request: pb.DeleteRequest, context: Context) -> pb.DeleteResponse:
        ns = self._namespace(request)
        deleted, skipped = await self.store.delete(ns, request.keys, request.all_keys)
        return pb.DeleteResponse(deleted=deleted, skipped_leased=skipped)

    @_rpc
    async def Retain(self, request: pb.RetainRequest, context: Context) -> pb.RetainResponse:
        ns = self._namespace(request)
        found, nbytes = self.store.retain(ns, list(request.keys), request.retain_ms, request.retain_priority)
        return pb.RetainResponse(retained=found, retained_bytes=nbytes)

    @_rpc
    async def Prefetch(self, request: pb.PrefetchRequest, context: Context) -> pb.PrefetchResponse:
        ns = self._namespace(request)
        ready = await self.store.prefetch(ns, list(request.keys))
        return pb.PrefetchResponse(ready=ready)

    @_rpc
    async def Stats(self, request: pb.StatsRequest, context: Context) -> pb.StatsResponse:
        return pb.StatsResponse(json=document_json(self.store.snapshot()))

    @_rpc
    async def Report(self, request: pb.ReportRequest, context: Context) -> pb.ReportResponse:
        if len(request.decisions) > 1024:
            raise InvalidArgument(f"decisions: {len(request.decisions)} records exceed the limit of 1024")
        records = [
            {
                "namespace": d.namespace,
                "prompt_blocks": d.prompt_blocks,
                "cached_blocks": d.cached_blocks,
                "loaded_blocks": d.loaded_blocks,
                "tier": d.tier,
                "predicted_load_s": d.predicted_load_s,
                "predicted_recompute_s": d.predicted_recompute_s,
                "actual_s": d.actual_s,
                "outcome": d.outcome,
            }
            for d in request.decisions
        ]
        for i, record in enumerate(records):  # all checked before any is kept
            check_decision(record, f"decisions[{i}]")
        for record in records:
            self.store.stats.decision({**record, "outcome": record["outcome"] or "unknown"})
        return pb.ReportResponse()

    @_rpc
    async def Hello(self, request: pb.HelloRequest, context: Context) -> pb.HelloResponse:
        return pb.HelloResponse(local_socket=self.local_socket, segment=self.store.slab.name)

    @_rpc
    async def Route(self, request: pb.RouteRequest, context: Context) -> pb.RouteResponse:
        return await self.route(request)

    async def route(self, request: pb.RouteRequest) -> pb.RouteResponse:
        """The live nodes, best first for this request, at most :data:`MAX_ROUTE_NODES` of them
        (the Route RPC and ``/route``)."""
        ns = self._namespace(request)
        for node, load in request.loads.items():
            if not math.isfinite(load) or load < 0:
                raise InvalidArgument(f"loads[{shown(node)}]: must be a finite number >= 0, got {load!r}")
        prefixes = await self.store.prefixes(ns, list(request.keys))
        names = list(prefixes)
        loads = [request.loads.get(n, 0.0) for n in names]
        counts = [prefixes[n] for n in names]
        order = rank(counts, loads)[:MAX_ROUTE_NODES]
        return pb.RouteResponse(nodes=[
            pb.RouteNode(
                node=names[i],
                prefix=sum(counts[i].values()),
                dram=counts[i].get("dram", 0),
                ssd=sum(counts[i].get(t, 0) for t in LOWER),
                peer=counts[i].get("peer", 0),
                score=prefix_score(counts[i]),
                load=loads[i],
            )
            for i in order
        ])

    async def route_json(self, body: dict[str, Any]) -> dict[str, Any]:
        """``/route``: a RouteRequest as JSON, the block keys as hex strings (``keys``) or the
        prompt's token ids (``tokens``, cut into the namespace's blocks); the answer as JSON."""
        keys, tokens = body.pop("keys", None), body.pop("tokens", None)
        try:
            request = json_format.ParseDict(body, pb.RouteRequest())
        except (json_format.ParseError, ValueError, TypeError, OverflowError) as exc:
            raise InvalidArgument(f"request: {exc}") from None
        if tokens is not None:
            if not isinstance(tokens, list) or not all(
                type(t) is int and 0 <= t < 2**32 for t in tokens  # (not a bool: True is an int)
            ):
                raise InvalidArgument("tokens: a list of token ids (0 <= id < 2^32)")
            ns = self._namespace(request).namespace
            if ns is None or ns.block_size <= 0:
                raise InvalidArgument("namespace.block_size: required with tokens")
            limit = self.store.config.server.max_batch_blocks  # (checked before any block is hashed)
            if len(tokens) // ns.block_size > limit:
                raise InvalidArgument(f"tokens: {len(tokens)} token ids make more than {limit} blocks "
                                      "(server.max_batch_blocks)")
            request.keys.extend(prefix_keys(ns, tokens))
        elif isinstance(keys, list):
            try:
                request.keys.extend(bytes.fromhex(k) for k in keys)
            except (TypeError, ValueError):
                raise InvalidArgument("keys: a list of hex strings") from None
        else:
            raise InvalidArgument("keys: required (hex block keys), or tokens")
        answer = await self.route(request)
        return json_format.MessageToDict(answer, always_print_fields_with_no_presence=True)

    async def Echo(self, request: pb.EchoRequest, context: Context) -> pb.EchoResponse:
        # (not timed: the benchmarks' bare call, the baseline the others are measured against)
        return pb.EchoResponse(payload=request.payload)

    def bad_request(self, method: str, request_type: type[Message], exc: Exception) -> str:
        """Count a request body that is not its method's message; the status message to answer."""
        stats = self.store.stats
        stats.bad_requests += 1
        stats.errors[grpc.StatusCode.INVALID_ARGUMENT.name] += 1
        self._bad_warning.warning("undecodable %s request (%d since start): %s", method, stats.bad_requests, exc)
        return f"request: not a {request_type.__name__}: {exc}"


def _decoding(servicer: KVStoreServicer, method: str, request_type: type[Message]) -> Callable[..., Awaitable[Any]]:
    """The servicer's method behind a handler that takes the request's bytes."""
    handle: Callable[[Message, Context], Awaitable[Message]] = getattr(servicer, method)

    async def decode_and_handle(body: bytes, context: Context) -> Message:
        try:
            request = request_type.FromString(body)
        except DecodeError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, servicer.bad_request(method, request_type, exc))
        return await handle(request, context)

    return decode_and_handle


def method_handlers(servicer: KVStoreServicer) -> dict[str, grpc.RpcMethodHandler[Any, Any]]:
    """The KVStore service's handlers. grpc decodes nothing itself (its failure to would be an
    UNKNOWN status and a logged traceback): each handler gets the body and decodes it."""
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
    for method in pb.DESCRIPTOR.services_by_name["KVStore"].methods:
        request_type = getattr(pb, method.input_type.name)
        response_type = getattr(pb, method.output_type.name)
        handlers[method.name] = grpc.unary_unary_rpc_method_handler(
            _decoding(servicer, method.name, request_type), response_serializer=response_type.SerializeToString
        )
    return handlers


def grpc_options(config: Config) -> list[tuple[str, int]]:
    limit = config.server.max_message_bytes
    return [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]


async def start_grpc(
    servicer: KVStoreServicer, config: Config
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    interceptors = []
    if config.server.auth_token:
        from kvstore.server.auth import TokenInterceptor

        interceptors.append(TokenInterceptor(config.server.auth_token))
    server = grpc.aio.server(options=grpc_options(config), interceptors=interceptors)
    handlers = method_handlers(servicer)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    address = config.server.grpc_address
    if config.server.tls_cert:
        with open(config.server.tls_cert, "rb") as f:
            cert = f.read()
        with open(config.server.tls_key, "rb") as f:
            key = f.read()
        port = server.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)]))
    else:
        port = server.add_insecure_port(address)
    if not address.startswith("unix:") and port == 0:
        raise KVStoreError(f"server.grpc_address: cannot bind {address}")
    await server.start()
    await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, port, health_servicer

