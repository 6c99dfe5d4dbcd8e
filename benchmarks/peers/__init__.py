"""Peer systems measured on the same servers and payloads as ``benchmarks.tiers``.

* :mod:`benchmarks.peers.lmcache_backends` — LMCache 0.5.6's ``LocalDiskBackend`` and
  ``RemoteBackend`` (``redis://`` and ``redis-cluster://`` connectors), driven standalone on CPU.

LMCache is not a dependency of kvstore (nor of CI): install it by hand, without its CUDA
dependencies, to run these::

    pip download --no-deps lmcache==0.5.6 -d /tmp/x          # the cp311 manylinux wheel
    pip install --no-deps /tmp/x/lmcache-0.5.6-*.whl
    pip install aiofile                                      # the one import it lacked here

or, leaving the environment as it is, into a side directory used for the run only::

    pip install --no-deps --target /tmp/lmc-site /tmp/x/lmcache-0.5.6-*.whl aiofile caio
    PYTHONPATH=/tmp/lmc-site kvstore bench tiers --peers --json

Everything else its storage backends import (torch — the installed CPU build is used as is —
redis, msgspec, numba, psutil, prometheus_client, opentelemetry, pyzmq, sortedcontainers,
blake3, aiofiles, ...) was already present in this environment. ``lmcache/cuda_ops*.so``
needs libtorch_cuda and is never loaded by these backends.
"""
