"""The connector's two roles, framework-neutral, split as vLLM's ``KVConnectorBase_V1`` is.

* :class:`SchedulerConnector` (role ``SCHEDULER``): lookups, reload-or-recompute decisions,
  save scheduling; emits one :class:`ConnectorMetadata` per step.
* :class:`WorkerConnector` (role ``WORKER``): executes the metadata against the engine's KV cache,
  asynchronously, and reports completions and blocks that failed to load.
* :mod:`connector.roles.ops`: the single-request load/save transfers both build on.
"""

from connector.roles.metadata import (
    ConnectorMetadata,
    Failure,
    LoadResult,
    LoadSpec,
    Role,
    SaveResult,
    SaveSpec,
)
from connector.roles.ops import load_blocks, save_blocks
from connector.roles.scheduler import SchedulerConnector
from connector.roles.stats import ConnectorStats
from connector.roles.worker import WorkerConnector

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
