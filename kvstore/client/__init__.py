"""Clients of the sidecar: an asyncio client and a blocking one with the same calls, over gRPC or,
on the sidecar's host, the local socket (:mod:`kvstore.client.local_channel`)."""

from kvstore.client.clients import (
    DEFAULT_TIMEOUT_S,
    Allocation,
    KVStoreClient,
    Lease,
    LookupResult,
    PutResult,
    SlotRef,
    SyncAllocation,
    SyncClient,
    SyncLease,
    namespace_pb,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "Allocation",
    "KVStoreClient",
    "Lease",
    "LookupResult",
    "PutResult",
    "SlotRef",
    "SyncAllocation",
    "SyncClient",
    "SyncLease",
    "namespace_pb",
]
