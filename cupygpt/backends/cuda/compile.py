"""The kernels of kernels_cu/ compiled (CuPy's RawModule: NVRTC, CuPy's disk cache), kept,
and launched: each .cu file is compiled once per storage type, and a launch takes the
bf16 build when any of its arrays is bf16. The launch geometry's helpers too."""
from __future__ import annotations

import os

import cupy as cp
import numpy as np
from numpy.typing import DTypeLike

from ... import CupyGPTError
from ...precision import BF16
from .kernels import GEOMETRY, flash_fp32_doubled, kernels_in, options, sources
from .profile import Profiler


class Kernels:
    """The compiled modules and their kernels, and what the device allows them (its
    per-block shared memory, read once after configure picks the device)."""

    def __init__(self, profiler: Profiler) -> None:
        self.profiler = profiler
        self.files = {}      # kernel name -> its .cu file
        self.modules = {}    # (file, dtype, doubled) -> its RawModule
        self.functions = {}  # (kernel name, dtype, doubled) -> its RawKernel
        self.optin = {}      # "optin": bytes, "doubled": FLASH_FP32_DOUBLED for them

    def get(self, fn: str, dtype: str = "fp32"):
        """A kernel by name, from its .cu file compiled for dtype's storage type on first
        use (CuPy caches it on disk)."""
        if not self.files:
            for path in sources():
                for kernel in kernels_in(open(path).read()):
                    self.files[kernel] = path
        doubled = self.fp32_doubled()  # (a -D of every module: part of every key)
        key = (fn, dtype, doubled)
        if key not in self.functions:
            mod = (self.files[fn], dtype, doubled)
            try:  # (CuPy compiles here, and reads and writes its kernel cache)
                if mod not in self.modules:
                    self.modules[mod] = cp.RawModule(code=open(mod[0]).read(),
                                                     options=options(dtype, doubled))
                self.functions[key] = self.modules[mod].get_function(fn)
            except OSError as e:
                raise CupyGPTError(f"cannot compile or cache the CUDA kernels of "
                                   f"{os.path.basename(mod[0])} ({e.strerror or e}): CuPy's "
                                   f"kernel cache (CUPY_CACHE_DIR, else ~/.cupy/kernel_cache) "
                                   f"must be a directory this user can write") from None
        return self.functions[key]

    def smem_optin(self) -> int:
        """The device's shared memory a block may opt in to (bytes): 227 KiB on sm_90, 163
        on sm_80, 99 on sm_86/89/120, where fp32 flash heads above 64 cannot double-buffer
        (kernels.flash_fp32_doubled). Read once after configure (which picks the device and
        clears it), as every launch's get asks."""
        if not self.optin:
            optin = int(cp.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"])
            self.optin.update(optin=optin, doubled=flash_fp32_doubled(optin))
        return self.optin["optin"]

    def fp32_doubled(self) -> int:
        self.smem_optin()
        return self.optin["doubled"]

    def launch(self, fn: str, grid: tuple, block: tuple, *args, shared_mem: int = 0) -> None:
        """Launches kernel fn, its bf16 build when an argument is a bf16 array."""
        k = self.get(fn, "bf16" if any(getattr(a, "dtype", None) == BF16 for a in args)
                     else "fp32")
        if self.profiler.trace is None:
            k(grid, block, args, shared_mem=shared_mem)
        else:
            self.profiler.traced(fn, k, grid, block, args, shared_mem=shared_mem)

    def ew(self, fn: str, n: int, *args, per_thread: int = 1) -> None:
        """An elementwise kernel over n elements, per_thread of them per thread."""
        threads = GEOMETRY["EW_THREADS"]
        n = (n + per_thread - 1) // per_thread
        self.launch(fn, ((n + threads - 1) // threads,), (threads,), *args)

    def packed(self, fn: str, out, *args) -> None:
        """An elementwise kernel over out's elements, PACK (16 bytes of out's dtype: 128-bit
        accesses) per thread."""
        self.ew(fn, out.size, out, *args, np.int64(out.size), per_thread=16 // out.dtype.itemsize)

    def rows(self, fn: str, rows: int, *args) -> None:
        """A row kernel: a warp per row, ROW_WARPS rows per block."""
        warps = GEOMETRY["ROW_WARPS"]
        self.launch(fn, ((rows + warps - 1) // warps,), (warps * GEOMETRY["WARP"],), *args)


def row_packs(rows: int, C: int, dtype: DTypeLike) -> int:
    """Threads for rows of C elements, PACK (16 bytes of dtype) columns each."""
    return rows * -(-C // (16 // np.dtype(dtype).itemsize))


def whole_packs(fn: str, C: int, *arrays) -> str:
    """fn, or its _v entry where every row's packs of these arrays are whole aligned 16-byte
    runs (C a multiple of a pack, each array 16-byte aligned): decided here, once per
    launch, so the kernel's loads are straight-line code, several in flight."""
    pack = 16 // arrays[0].dtype.itemsize
    return fn + "_v" if C % pack == 0 and all(a.data.ptr % 16 == 0 for a in arrays) else fn


def i32(x: int) -> np.int32:
    return np.int32(x)
