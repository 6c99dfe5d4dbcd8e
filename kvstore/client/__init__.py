"""Clients of the sidecar: an asyncio client (:mod:`kvstore.client.aio`) and a blocking one
(:mod:`kvstore.client.sync`) with the same calls, building the same messages
(:mod:`kvstore.client.calls`), over gRPC (:mod:`kvstore.client.grpc_channel`) or, on the sidecar's
host, its local socket (:mod:`kvstore.client.local_channel`), where the blocking one also
pipelines calls (:mod:`kvstore.client.pipeline`)."""

from kvstore.client.aio import Allocation, KVStoreClient, Lease
from kvstore.client.calls import DEFAULT_TIMEOUT_S, LookupResult, PutResult, SlotRef, namespace_pb
from kvstore.client.pipeline import Pipeline
from kvstore.client.sync import SyncAllocation, SyncClient, SyncLease

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "Allocation",
    "KVStoreClient",
    "Lease",
    "LookupResult",
    "Pipeline",
    "PutResult",
    "SlotRef",
    "SyncAllocation",
    "SyncClient",
    "SyncLease",
    "namespace_pb",
]
