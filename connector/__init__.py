"""Engine-side connector: moves KV blocks between an engine's cache and the kvstore sidecar.

Modules, one concept each:

* :mod:`connector.transfer.layout` -- KV layouts (``vllm_cpu``, ``vllm_gpu``, ``hf``) and the slot byte order.
* :mod:`connector.transfer.engines` -- gather/scatter between paged KV and DRAM slots (numpy; cupy on GPU).
* :mod:`connector.cost` -- reload-or-recompute cost model and its calibration.
* :mod:`connector.roles` -- framework-neutral scheduler side and worker side, with the metadata
  that flows from one to the other each step.
* :mod:`connector.hf` -- transformers adapter (DynamicCache) and the prefill/decode handoff.
"""
