from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_DRAM: _ClassVar[Tier]
    TIER_SSD: _ClassVar[Tier]
    TIER_REDIS: _ClassVar[Tier]
    TIER_S3: _ClassVar[Tier]
    TIER_PEER: _ClassVar[Tier]
TIER_UNSPECIFIED: Tier
TIER_DRAM: Tier
TIER_SSD: Tier
TIER_REDIS: Tier
TIER_S3: Tier
TIER_PEER: Tier

class Namespace(_message.Message):
    __slots__ = ("model", "revision", "kv_layout", "dtype", "block_size", "rank", "world_size", "adapter", "cache_salt")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    model: str
    revision: str
    kv_layout: str
    dtype: str
    block_size: int
    rank: int
    world_size: int
    adapter: str
    cache_salt: str
    def __init__(self, model: _Optional[str] = ..., revision: _Optional[str] = ..., kv_layout: _Optional[str] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., adapter: _Optional[str] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class SlotDescriptor(_message.Message):
    __slots__ = ("segment", "offset", "length", "slot_id")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    SLOT_ID_FIELD_NUMBER: _ClassVar[int]
    segment: str
    offset: int
    length: int
    slot_id: int
    def __init__(self, segment: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., slot_id: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("namespace", "keys", "lease_ttl_ms")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    namespace: Namespace
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    lease_ttl_ms: int
    def __init__(self, namespace: _Optional[_Union[Namespace, _Mapping]] = ..., keys: _Optional[_Iterable[bytes]] = ..., lease_ttl_ms: _Optional[int] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("matched", "tiers", "sizes", "lease_id", "uniform_size", "local", "nodes", "holders", "peer_tiers")
    MATCHED_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    UNIFORM_SIZE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    PEER_TIERS_FIELD_NUMBER: _ClassVar[int]
    matched: int
    tiers: bytes
    sizes: _containers.RepeatedScalarFieldContainer[int]
    lease_id: str
    uniform_size: int
    local: int
    nodes: _containers.RepeatedScalarFieldContainer[str]
    holders: bytes
    peer_tiers: bytes
    def __init__(self, matched: _Optional[int] = ..., tiers: _Optional[bytes] = ..., sizes: _Optional[_Iterable[int]] = ..., lease_id: _Optional[str] = ..., uniform_size: _Optional[int] = ..., local: _Optional[int] = ..., nodes: _Optional[_Iterable[str]] = ..., holders: _Optional[bytes] = ..., peer_tiers: _Optional[bytes] = ...) -> None: ...

class BlockSpec(_message.Message):
    __slots__ = ("key", "parent", "size")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    parent: bytes
    size: int
    def __init__(self, key: _Optional[bytes] = ..., parent: _Optional[bytes] = ..., size: _Optional[int] = ...) -> None: ...

class AllocateRequest(_message.Message):
    __slots__ = ("namespace", "blocks", "ttl_ms")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    namespace: Namespace
    blocks: _containers.RepeatedCompositeFieldContainer[BlockSpec]
    ttl_ms: int
    def __init__(self, namespace: _Optional[_Union[Namespace, _Mapping]] = ..., blocks: _Optional[_Iterable[_Union[BlockSpec, _Mapping]]] = ..., ttl_ms: _Optional[int] = ...) -> None: ...

class AllocatedBlock(_message.Message):
    __slots__ = ("key", "present", "slot")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    present: bool
    slot: SlotDescriptor
    def __init__(self, key: _Optional[bytes] = ..., present: _Optional[bool] = ..., slot: _Optional[_Union[SlotDescriptor, _Mapping]] = ...) -> None: ...

class AllocateResponse(_message.Message):
    __slots__ = ("allocation_id", "blocks")
    ALLOCATION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    allocation_id: str
    blocks: _containers.RepeatedCompositeFieldContainer[AllocatedBlock]
    def __init__(self, allocation_id: _Optional[str] = ..., blocks: _Optional[_Iterable[_Union[AllocatedBlock, _Mapping]]] = ...) -> None: ...

class CommitBlock(_message.Message):
    __slots__ = ("key", "slot_id", "has_checksum", "checksum")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SLOT_ID_FIELD_NUMBER: _ClassVar[int]
    HAS_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    slot_id: int
    has_checksum: bool
    checksum: int
    def __init__(self, key: _Optional[bytes] = ..., slot_id: _Optional[int] = ..., has_checksum: _Optional[bool] = ..., checksum: _Optional[int] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("allocation_id", "blocks", "wait_write_through", "wait_published", "retain_ms", "retain_priority")
    ALLOCATION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WAIT_WRITE_THROUGH_FIELD_NUMBER: _ClassVar[int]
    WAIT_PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    RETAIN_MS_FIELD_NUMBER: _ClassVar[int]
    RETAIN_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    allocation_id: str
    blocks: _containers.RepeatedCompositeFieldContainer[CommitBlock]
    wait_write_through: bool
    wait_published: bool
    retain_ms: int
    retain_priority: int
    def __init__(self, allocation_id: _Optional[str] = ..., blocks: _Optional[_Iterable[_Union[CommitBlock, _Mapping]]] = ..., wait_write_through: _Optional[bool] = ..., wait_published: _Optional[bool] = ..., retain_ms: _Optional[int] = ..., retain_priority: _Optional[int] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("committed", "written_through")
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_THROUGH_FIELD_NUMBER: _ClassVar[int]
    committed: int
    written_through: int
    def __init__(self, committed: _Optional[int] = ..., written_through: _Optional[int] = ...) -> None: ...

class RetainRequest(_message.Message):
    __slots__ = ("namespace", "keys", "retain_ms", "retain_priority")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    RETAIN_MS_FIELD_NUMBER: _ClassVar[int]
    RETAIN_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    namespace: Namespace
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    retain_ms: int
    retain_priority: int
    def __init__(self, namespace: _Optional[_Union[Namespace, _Mapping]] = ..., keys: _Optional[_Iterable[bytes]] = ..., retain_ms: _Optional[int] = ..., retain_priority: _Optional[int] = ...) -> None: ...

class RetainResponse(_message.Message):
    __slots__ = ("retained", "retained_bytes")
    RETAINED_FIELD_NUMBER: _ClassVar[int]
    RETAINED_BYTES_FIELD_NUMBER: _ClassVar[int]
    retained: int
    retained_bytes: int
    def __init__(self, retained: _Optional[int] = ..., retained_bytes: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("allocation_id",)
    ALLOCATION_ID_FIELD_NUMBER: _ClassVar[int]
    allocation_id: str
    def __init__(self, allocation_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("namespace", "keys", "lease_ttl_ms", "packed", "retain_ms", "retain_priority", "shards")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    RETAIN_MS_FIELD_NUMBER: _ClassVar[int]
    RETAIN_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    namespace: Namespace
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    lease_ttl_ms: int
    packed: bool
    retain_ms: int
    retain_priority: int
    shards: _containers.RepeatedCompositeFieldContainer[Shard]
    def __init__(self, namespace: _Optional[_Union[Namespace, _Mapping]] = ..., keys: _Optional[_Iterable[bytes]] = ..., lease_ttl_ms: _Optional[int] = ..., packed: _Optional[bool] = ..., retain_ms: _Optional[int] = ..., retain_priority: _Optional[int] = ..., shards: _Optional[_Iterable[_Union[Shard, _Mapping]]] = ...) -> None: ...

class Shard(_message.Message):
    __slots__ = ("namespace", "keys")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace: Namespace
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[_Union[Namespace, _Mapping]] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class AcquiredBlock(_message.Message):
    __slots__ = ("key", "slot", "checksum")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    slot: SlotDescriptor
    checksum: int
    def __init__(self, key: _Optional[bytes] = ..., slot: _Optional[_Union[SlotDescriptor, _Mapping]] = ..., checksum: _Optional[int] = ...) -> None: ...

class AcquireResponse(_message.Message):
    __slots__ = ("lease_id", "blocks", "segment", "offsets", "lengths", "checksums", "shards")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    blocks: _containers.RepeatedCompositeFieldContainer[AcquiredBlock]
    segment: str
    offsets: _containers.RepeatedScalarFieldContainer[int]
    lengths: _containers.RepeatedScalarFieldContainer[int]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    shards: _containers.RepeatedCompositeFieldContainer[AcquireResponse]
    def __init__(self, lease_id: _Optional[str] = ..., blocks: _Optional[_Iterable[_Union[AcquiredBlock, _Mapping]]] = ..., segment: _Optional[str] = ..., offsets: _Optional[_Iterable[int]] = ..., lengths: _Optional[_Iterable[int]] = ..., checksums: _Optional[_Iterable[int]] = ..., shards: _Optional[_Iterable[_Union[AcquireResponse, _Mapping]]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("namespace", "keys", "all_keys")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    ALL_KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace: Namespace
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    all_keys: bool
    def __init__(self, namespace: _Optional[_Union[Namespace, _Mapping]] = ..., keys: _Optional[_Iterable[bytes]] = ..., all_keys: _Optional[bool] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted", "skipped_leased")
    DELETED_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_LEASED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    skipped_leased: int
    def __init__(self, deleted: _Optional[int] = ..., skipped_leased: _Optional[int] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("namespace", "keys")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace: Namespace
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[_Union[Namespace, _Mapping]] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PrefetchResponse(_message.Message):
    __slots__ = ("ready",)
    READY_FIELD_NUMBER: _ClassVar[int]
    ready: int
    def __init__(self, ready: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("json",)
    JSON_FIELD_NUMBER: _ClassVar[int]
    json: str
    def __init__(self, json: _Optional[str] = ...) -> None: ...

class Decision(_message.Message):
    __slots__ = ("namespace", "prompt_blocks", "cached_blocks", "loaded_blocks", "tier", "predicted_load_s", "predicted_recompute_s", "actual_s", "outcome")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOADED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_LOAD_S_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_RECOMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    ACTUAL_S_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    prompt_blocks: int
    cached_blocks: int
    loaded_blocks: int
    tier: str
    predicted_load_s: float
    predicted_recompute_s: float
    actual_s: float
    outcome: str
    def __init__(self, namespace: _Optional[str] = ..., prompt_blocks: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., loaded_blocks: _Optional[int] = ..., tier: _Optional[str] = ..., predicted_load_s: _Optional[float] = ..., predicted_recompute_s: _Optional[float] = ..., actual_s: _Optional[float] = ..., outcome: _Optional[str] = ...) -> None: ...

class ReportRequest(_message.Message):
    __slots__ = ("decisions",)
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    decisions: _containers.RepeatedCompositeFieldContainer[Decision]
    def __init__(self, decisions: _Optional[_Iterable[_Union[Decision, _Mapping]]] = ...) -> None: ...

class ReportResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HelloRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HelloResponse(_message.Message):
    __slots__ = ("local_socket", "segment")
    LOCAL_SOCKET_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    local_socket: str
    segment: str
    def __init__(self, local_socket: _Optional[str] = ..., segment: _Optional[str] = ...) -> None: ...

class RouteRequest(_message.Message):
    __slots__ = ("namespace", "keys", "loads")
    class LoadsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    LOADS_FIELD_NUMBER: _ClassVar[int]
    namespace: Namespace
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    loads: _containers.ScalarMap[str, float]
    def __init__(self, namespace: _Optional[_Union[Namespace, _Mapping]] = ..., keys: _Optional[_Iterable[bytes]] = ..., loads: _Optional[_Mapping[str, float]] = ...) -> None: ...

class RouteNode(_message.Message):
    __slots__ = ("node", "prefix", "dram", "ssd", "peer", "score", "load")
    NODE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    DRAM_FIELD_NUMBER: _ClassVar[int]
    SSD_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    node: str
    prefix: int
    dram: int
    ssd: int
    peer: int
    score: float
    load: float
    def __init__(self, node: _Optional[str] = ..., prefix: _Optional[int] = ..., dram: _Optional[int] = ..., ssd: _Optional[int] = ..., peer: _Optional[int] = ..., score: _Optional[float] = ..., load: _Optional[float] = ...) -> None: ...

class RouteResponse(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[RouteNode]
    def __init__(self, nodes: _Optional[_Iterable[_Union[RouteNode, _Mapping]]] = ...) -> None: ...

class EchoRequest(_message.Message):
    __slots__ = ("payload", "keys")
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, payload: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class EchoResponse(_message.Message):
    __slots__ = ("payload",)
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    def __init__(self, payload: _Optional[bytes] = ...) -> None: ...
