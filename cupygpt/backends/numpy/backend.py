"""The reference backend: every op vectorized over B, T and C; float32, float64, or bf16
with llm.c's mixed-precision semantics (precision.py): an op on bf16 arrays reads them into
float32, computes there and rounds each output once, where a CUDA kernel stores it
(mixed.py). Each op family's module is named as the CUDA backend's, to read one against
the other."""
from __future__ import annotations

import math
import os
import socket
import time
from collections.abc import Callable, Hashable

import numpy as np
from numpy.typing import DTypeLike

from ...precision import BF16
from .. import host_memory
from ..protocol import StageShape
from .adamw import ADAM_CHUNK, Adamw
from .attention import Attention
from .classifier import Classifier
from .elementwise import Elementwise
from .encoder import Encoder
from .layernorm import Layernorm
from .matmul import Matmul
from .reduce import Reduce


class NumpyBackend(Encoder, Layernorm, Matmul, Attention, Elementwise, Classifier, Reduce,
                   Adamw):
    """The NumPy backend (protocol.Backend). All it keeps between calls is this object's."""

    name = "numpy"
    DTYPES = (np.float32, np.float64, BF16)
    DEFAULT_DTYPE = "fp32"           # --dtype when not given
    TRANSPORTS = ("mpi",)            # host arrays travel by MPI
    supports_graphs = False
    asynchronous = False             # an op returns when its work is done
    DEFAULT_RUN = ("tiny", 64)       # -e, -t when not given: a model that trains in seconds

    def __init__(self) -> None:
        self.threads = None   # BLAS threads of this process, set by configure()
        self.trace = None     # {op: seconds} while kernel_profile runs
        self.narrow = False   # inside an op on bf16 arrays: its stored intermediates round
        self.scratch = {}     # name -> a scratch array kept between calls (_ws)
        # Overflow shows up as a non-finite loss, which the training loop reports in one line.
        np.seterr(over="ignore", invalid="ignore")

    # --- memory ----------------------------------------------------------------------

    def zeros(self, n: int, dtype: DTypeLike = np.float32):
        return np.zeros(n, dtype=dtype)

    def to_host(self, a) -> np.ndarray:
        return np.asarray(a)

    def upload(self, dst, host: np.ndarray) -> None:
        """Copies host into the existing array dst (casting to its dtype)."""
        dst[...] = host

    def synchronize(self) -> None:
        pass

    def bound_host_waits(self, wait: Callable) -> None:
        """The host never waits for a device here."""

    def memory_in_use(self) -> int:
        """Peak resident memory of this process, bytes."""
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def all_finite(self, a) -> bool:
        return bool(np.isfinite(a).all())

    def device_memory(self) -> int | None:
        """Free memory where this backend allocates (the host's), bytes."""
        return host_memory.available()

    @property
    def memory_name(self) -> str:
        """The host's memory, or the limit (cgroup, ulimit -v) that leaves it less."""
        return host_memory.binding()[1]

    def workspace_bytes(self, stage: StageShape, dtype: DTypeLike) -> int:
        """The most the kept scratch arrays (_ws) reach for such a stage: GELU's two (B, T,
        4C/tp), the classifier's exponentials (a chunk of the head's logits) and AdamW's
        three chunks (two, and the clipped gradient's)."""
        n = 2 * stage.batch * stage.seq * 4 * stage.C // stage.tp if stage.blocks else 0
        n += stage.logits
        return (n + 3 * ADAM_CHUNK) * np.dtype(dtype).itemsize

    def _ws(self, key, shape, dtype):
        """A scratch array kept between calls: the large elementwise ops write their
        temporaries here instead of allocating (and page-faulting) fresh ones every step."""
        n, a = math.prod(shape), self.scratch.get(key)
        if a is None or a.size < n or a.dtype != dtype:  # grows to the largest asked for
            a = self.scratch[key] = np.empty(n, dtype)
        return a[:n].reshape(shape)

    def _stored(self, x) -> None:
        """x goes through memory in the run's dtype here (a kernel stores it, the next reads
        it): inside a bf16 op it is rounded to bf16 in place."""
        if self.narrow:
            x[...] = x.astype(BF16)

    # --- the machine -----------------------------------------------------------------

    def fallbacks(self) -> list:
        """Nothing here runs a slower way than planned."""
        return []

    def memory_domain(self) -> Hashable:
        """What ranks with the same answer allocate from: this host's memory."""
        return socket.gethostname()

    def device_name(self) -> str:
        """The run table's name of the device this rank computes on."""
        return "the CPU"

    def configure(self, tf32: bool = False, device_of: Callable | None = None,
                  ranks_here: int = 1) -> None:
        """BLAS threads: this rank's share of the machine's cores (ranks_here processes
        share them), at least one. More threads than cores in total is ruinous: a small
        matmul on two busy cores ran 25x slower with two threads than with one. No TF32 on
        the CPU."""
        from threadpoolctl import threadpool_limits
        self.threads = max(1, len(os.sched_getaffinity(0)) // ranks_here)
        threadpool_limits(self.threads, user_api="blas")

    def numerics(self) -> str:
        """Which arithmetic this is, for verify's tolerances."""
        return "numpy"

    def peak_flops(self, dtype: str = "fp32") -> float | None:
        """The device's dense peak FLOP/s for MFU; None: not meaningful for a CPU here."""
        return None

    def device_info(self) -> dict:
        import platform
        return {"device": platform.processor() or platform.machine(), "backend": self.name,
                "blas_threads": self.threads}

    def stamp(self):
        """A mark of this moment in the work's order (--trace); the CPU's is its clock."""
        return time.perf_counter()

    def stamp_seconds(self, marks: list) -> list[float]:
        """Host-clock seconds (time.perf_counter's, the same clock in every process) of
        marks."""
        return list(marks)

    def kernel_profile(self, step: Callable, steps: int) -> tuple[list, list] | None:
        """Where the time of `steps` calls of step() goes: per op (wall time; the CPU
        computes synchronously), and "(rest)" for what is outside every op (Python, the
        transport, slicing). Returns (per_op, per_kernel); the CPU has no kernels, so
        per_kernel is []."""
        self.trace = {}
        t0 = time.perf_counter()
        try:
            for _ in range(steps):
                step()
            whole, ops = time.perf_counter() - t0, self.trace
        finally:
            self.trace = None
        ops["(rest)"] = max(0.0, whole - sum(ops.values()))
        return ([{"op": op, "ms_per_step": 1e3 * t / steps, "share": t / whole}
                 for op, t in sorted(ops.items(), key=lambda kv: -kv[1])], [])
