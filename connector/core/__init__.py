"""Framework-neutral connector core, split by role as vLLM's ``KVConnectorBase_V1`` is.

* :class:`SchedulerConnector` (role ``SCHEDULER``): lookups, reload-or-recompute decisions,
  save scheduling; emits one :class:`ConnectorMetadata` per step.
* :class:`WorkerConnector` (role ``WORKER``): executes the metadata against the engine's KV cache,
  asynchronously, and reports completions and blocks that failed to load.
* :mod:`connector.core.ops`: the single-request load/save transfers both build on.
"""

from connector.core.counters import ConnectorStats
from connector.core.metadata import (
    ConnectorMetadata,
    Failure,
    LoadResult,
    LoadSpec,
    Role,
    SaveResult,
    SaveSpec,
)
from connector.core.ops import load_blocks, save_blocks
from connector.core.scheduler import SchedulerConnector
from connector.core.worker import WorkerConnector

__all__ = [
    "ConnectorMetadata",
    "ConnectorStats",
    "Failure",
    "LoadResult",
    "LoadSpec",
    "Role",
    "SaveResult",
    "SaveSpec",
    "SchedulerConnector",
    "WorkerConnector",
    "load_blocks",
    "save_blocks",
]
