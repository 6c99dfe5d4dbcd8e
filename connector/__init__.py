"""Engine-side connector: moves KV blocks between an engine's cache and the kvstore sidecar.

The top level reads engines, roles, bytes, cost:

* engines -- :mod:`connector.vllm` (the vLLM adapter, a facade vLLM loads as
  ``connector.vllm.KVStoreConnector``) and :mod:`connector.hf` (transformers' DynamicCache).
* roles -- :mod:`connector.roles`: the framework-neutral scheduler side and worker side, with the
  metadata that flows from one to the other each step.
* bytes -- :mod:`connector.transfer`: KV layouts and the slot byte order (``layout``), the copy plan
  (``plan``), the engines that run it (``engines``: CPU; ``cuda``: GPU) and their kernels
  (``native``, ``kernels/``).
* cost -- :mod:`connector.cost`: the reload-or-recompute model and its calibration.
"""
