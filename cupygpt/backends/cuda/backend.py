"""The CUDA backend: the NumPy reference's interface over CuPy arrays, with our kernels
(kernels_cu/, compile.py) and cuBLASLt matmuls (cublaslt.py), in fp32 (TF32 is a
cuBLASLt compute type) or bf16 (llm.c's mainline: bf16 storage, fp32 math, GEMMs with fp32
compute); bf16 attention through cuDNN's fused sdpa where the run asks (cudnn.py).

Each kernel family's ops are a class of their own (encoder.py, layernorm.py, ...), and
CudaBackend is all of them over one state: nothing here allocates after the first step, so
a whole step can be captured as a CUDA graph.
"""
from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType

import cupy as cp
import numpy as np
from numpy.typing import DTypeLike

from ...precision import BF16
from ..protocol import StageShape
from .adamw import Adamw
from .attention import Attention, AttentionPlan
from .classifier import Classifier
from .compile import Kernels
from .cublaslt import LT_ALIGN, LT_WORKSPACE, Cublaslt
from .cudnn import SdpaGraphs
from .device import Device, stream_synchronize
from .elementwise import Elementwise
from .encoder import Encoder
from .kernels import GEOMETRY
from .layernorm import Layernorm
from .matmul import Matmul
from .profile import Profiler
from .reduce import COLUMN_BLOCKS, NORM_BLOCKS, Reduce

# Dense (no sparsity) TF32 tensor-core peak, TFLOP/s, from NVIDIA's data sheets; the most
# specific name first.
TF32_PEAK = MappingProxyType({"H100 SXM": 494.7, "H100 NVL": 417.5, "H100 PCIe": 378.0,
                              "H100": 494.7, "H200": 494.7, "A100": 156.0, "L40S": 183.0})
BF16_PEAK = MappingProxyType({k: 2 * v for k, v in TF32_PEAK.items()})  # twice TF32's


class CudaBackend(Device, Encoder, Layernorm, Matmul, Attention, Elementwise, Classifier,
                  Reduce, Adamw):
    """The CUDA backend (protocol.GraphBackend). All it keeps between calls is this
    object's, made here: the session makes one and every rank's stages share it."""

    name = "cuda"
    DTYPES = (np.float32, BF16)
    TRANSPORTS = ("nvshmem", "nccl", "mpi")  # preferred first
    supports_graphs = True
    asynchronous = True                      # launches return before the GPU is done
    DEFAULT_RUN = ("d12", 1024)              # -e, -t when not given: llm.c's GPT-2 124M run
    DEFAULT_DTYPE = "bf16"                   # --dtype when not given: llm.c's on a GPU
    memory_name = "the GPU"

    def __init__(self) -> None:
        self.tf32 = False                  # TF32 tensor-core matmuls (configure)
        self.stream = None                 # the compute stream (configure makes it current)
        self.profiler = Profiler()         # kernel_profile's trace
        self.workspaces = {}               # (name, dtype) -> a buffer kept for the process
        self.kernels = Kernels(self.profiler)            # compiled modules and kernels
        self.blas = Cublaslt(self.profiler, self._ws)    # cuBLASLt: handle, plans, fallbacks
        self.sdpa = SdpaGraphs()           # cuDNN's graphs
        self.attention = AttentionPlan()   # which attention bf16 runs take (use_attention)
        self.host_wait = stream_synchronize  # how the host waits for a stream
        self.origin = None                 # (event, host seconds) for stamp_seconds

    def configure(self, tf32: bool = False, device_of: Callable | None = None,
                  ranks_here: int = 1) -> None:
        """Uses GPU device_of(visible GPUs) (None: GPU 0); TF32 tensor-core matmuls on
        (training) or off (verify); all work goes to one non-blocking stream (the legacy
        default stream cannot be captured into a CUDA graph)."""
        self.tf32 = bool(tf32)
        self.kernels.optin.clear()  # (read again from the device now used)
        cp.cuda.Device(device_of(cp.cuda.runtime.getDeviceCount()) if device_of else 0).use()
        self.stream = cp.cuda.Stream(non_blocking=True).use()
        self.blas.reset(self.tf32)  # (the plans' compute type follows tf32)

    def numerics(self) -> str:
        """Which arithmetic this is, for verify's tolerances."""
        return "cuda-tf32" if self.tf32 else "cuda"

    def device_info(self) -> dict:
        props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
        return {"device": props["name"].decode(), "backend": self.name, "cupy": cp.__version__,
                "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(),
                "driver": cp.cuda.runtime.driverGetVersion()}

    def peak_flops(self, dtype: str = "fp32") -> float | None:
        """This GPU's dense TF32 (or bf16) peak FLOP/s (MFU's yardstick), None if not in the
        table."""
        dev = self.device_info()["device"]
        table = BF16_PEAK if dtype == "bf16" else TF32_PEAK
        return next((v * 1e12 for key, v in table.items() if key in dev), None)

    def kernel_profile(self, step: Callable, steps: int) -> tuple[list, list] | None:
        """Where the GPU time of `steps` calls of step() goes (eager steps only: the events
        would be captured into a graph): per op and per kernel within each op, each cuBLAS
        call named "gemm_{op flags} MxNxK[xbatch]". Returns (per_op, per_kernel) rows."""
        return self.profiler.profile(step, steps, self.synchronize)

    def fallbacks(self) -> list:
        """Each bias epilogue a matmul ran without (its term added by a kernel after the
        GEMM): which, why, and how many calls."""
        return self.blas.fallback_lines()

    def workspace_bytes(self, stage: StageShape, dtype: DTypeLike) -> int:
        """The most the kept workspaces (_ws) reach for such a stage: attention backward's
        float D (B, NH/tp, T), layernorm backward's float partials (two rows of C per
        ROW_WARPS rows), the column sums' (COLUMN_BLOCKS blocks of at most 256 columns, plus
        a row of 4C) and their counters, the norm's, and the embedding backward's three
        int32 arrays of B*T and its int64 keys (whole runs of SORT_KEYS), the bias
        gradients' scratch (4C, the widest; float at most), cuBLASLt's workspace and, where
        bf16 attention goes through cuDNN, the workspace its graphs ask."""
        s, rows = stage, stage.batch * stage.seq
        ln = -(-rows // GEOMETRY["ROW_WARPS"]) * 2 * s.C
        out = 4 * (rows * s.NH // s.tp + ln + COLUMN_BLOCKS * 256 + 5 * 4 * s.C
                   + 4 * s.C) + LT_WORKSPACE + LT_ALIGN
        keys = -(-rows // GEOMETRY["SORT_KEYS"]) * GEOMETRY["SORT_KEYS"]
        if self.attention.kind == "cudnn" and np.dtype(dtype) == BF16:  # (builds its graphs)
            out += self.sdpa.plan(s.batch, s.NH // s.tp, s.seq, s.C // s.NH,
                                  backward=self.attention.backward, replay=self.attention.replay)
        return out + 8 * NORM_BLOCKS + (12 * rows + 8 * keys if s.embed else 0)
