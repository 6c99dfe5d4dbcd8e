"""``connector/transfer/kernels/kv_copy.cu`` compiled for the host with g++ and a shim (kv_copy_host.cpp), and
launched the way ``connector/transfer/cuda.py`` launches it: the CPU tests run the kernel's own
index arithmetic, byte for byte, without a GPU."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from connector.transfer.cuda import KERNEL_SOURCE
from connector.transfer.plan import Piece, plan_tables

SHIM = Path(__file__).with_name("kv_copy_host.cpp")
_u64, _i64, _ptr = ctypes.c_uint64, ctypes.c_int64, ctypes.c_void_p


class HostKernel:
    """The compiled kernels: :meth:`launch` is one launch of ``kv_gather`` or ``kv_scatter``."""

    def __init__(self, folder: Path) -> None:
        cxx = shutil.which("g++") or shutil.which("c++")
        if cxx is None:  # scripts/setup_env.sh installs build-essential where it is missing
            raise RuntimeError("no C++ compiler (g++): run scripts/setup_env.sh")
        lib = folder / "kv_copy_host.so"
        subprocess.run([cxx, "-O1", "-std=c++14", "-shared", "-fPIC", "-Wall", "-Werror", f"-I{KERNEL_SOURCE.parent}",
                        str(SHIM), "-o", str(lib)], check=True, capture_output=True, text=True)
        self._lib = ctypes.CDLL(str(lib))
        self._lib.run.argtypes = [ctypes.c_int, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, ctypes.c_uint,
                                  ctypes.c_uint, ctypes.c_uint]
        self._lib.moved_by.restype = _u64

    def launch(self, gather: bool, plan: Sequence[Piece], ids: np.ndarray, stage: int, pitch: int, threads: int,
               parts: int) -> None:
        """``kv_gather``/``kv_scatter`` over ``ids`` (int64, the chunk's block ids) and the staging
        buffer at address ``stage``, grid (pieces x parts, blocks), ``threads`` a thread block."""
        src, stride, nbytes, off = plan_tables(plan)
        assert ids.dtype == np.int64 and ids.flags.c_contiguous
        self._lib.run(int(gather), src.ctypes.data, stride.ctypes.data, nbytes.ctypes.data, off.ctypes.data,
                      ids.ctypes.data, stage, pitch, parts, len(plan) * parts, len(ids), threads)

    def moved_by(self, width: int) -> int:
        """Bytes moved by words of ``width`` (16 or 8) since :meth:`reset`."""
        return int(self._lib.moved_by(width))

    def reset(self) -> None:
        self._lib.reset_moved()
