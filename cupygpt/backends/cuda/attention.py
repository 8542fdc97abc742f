"""Causal self-attention: the own flash kernels (kernels_cu/flash_attention.cu; fp32 runs
always, bf16 runs unless cuDNN's is chosen) or cuDNN's fused sdpa (cudnn.py), and
generation's one-position step over the KV cache (kernels_cu/attention.cu and two GEMMs).
q, k, v and the other temporaries are backend workspaces, reused by every layer."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import DTypeLike

from ... import CupyGPTError
from ...precision import BF16, dtype_name
from .compile import i32
from .cublaslt import N_, T_
from .cudnn import missing, refuses
from .kernels import FLASH_HEAD_SIZES, GEOMETRY, flash_smem_bytes
from .profile import op


@dataclass(frozen=True)
class AttentionPlan:
    """Which attention the bf16 runs take ("cudnn" or "own") and what the run asks of
    cuDNN's: its backward graph too, a captured step replayed (use_attention)."""
    kind: str = "own"
    backward: bool = True
    replay: bool = False


class Attention:
    def attention_refuses(self, head_size: int, dtype: DTypeLike | None = None) -> str | None:
        """Why the flash kernels cannot run heads of head_size (in dtype, when given), or
        None: they are built for FLASH_HEAD_SIZES and run any multiple of 8 up to the
        largest, whose shared memory (one buffer per walked tile where two do not fit) fits
        the device's."""
        top = FLASH_HEAD_SIZES[-1]
        if head_size % 8 or head_size > top:
            return (f"the cuda backend's attention runs head sizes (C/NH) that are multiples "
                    f"of 8 up to {top}; this model's is {head_size}")
        if dtype is None:
            return None
        x, optin = np.dtype(dtype).itemsize, self.kernels.smem_optin()
        hsp = next(n for n in FLASH_HEAD_SIZES if n >= head_size)
        need = max(flash_smem_bytes(k, hsp, x, x == 4 and not self.tf32,
                                    self.kernels.fp32_doubled())
                   for k in ("forward", "dq", "dkdv"))
        if need > optin:
            return (f"the cuda backend's {dtype_name(dtype)} attention for head size "
                    f"{head_size} needs {need:,} bytes of shared memory per block; this GPU "
                    f"allows {optin:,}")
        return None

    def fused_attention_refuses(self, dtype: DTypeLike, head_size: int) -> str | None:
        """Why cuDNN's fused attention cannot run a run of dtype with heads of head_size
        here, or None."""
        return refuses(np.dtype(dtype) == BF16, head_size)

    def use_attention(self, kind: str, backward: bool = True, replay: bool = False) -> None:
        """Which attention the bf16 runs' attention_forward/backward take from now on:
        "cudnn" (cuDNN's fused sdpa) or "own" (the flash kernels; fp32 runs always do). The
        config has checked the run's dtype and head size (fused_attention_refuses).
        backward, replay: whether the run takes attention's backward and replays a captured
        step, so the memory plan builds cuDNN's backward graph only for a run that trains,
        and hints replay only to one that captures."""
        why = missing() if kind == "cudnn" else None
        if why or kind not in ("cudnn", "own"):
            raise CupyGPTError(why or "unknown; use cudnn or own", "attention", kind)
        self.attention = AttentionPlan(kind, bool(backward), bool(replay))

    def _fused(self, kind, NH, qkv, **arrays) -> None:
        """cuDNN's graph of kind for this shape, run on the step's stream with the kept
        workspace: one buffer of the shape's size (the most its graphs ask; what the memory
        plan counted), not one per kind, so the forward's smaller ask allocates no second."""
        shape = (qkv.shape[0], NH, qkv.shape[1], qkv.shape[2] // 3 // NH)
        self.sdpa.graph(kind, *shape, replay=self.attention.replay)  # (the plan's, else now)
        size = self.sdpa.workspace_bytes(*shape)
        ws = self._ws("cudnn", size, np.uint8) if size else None
        if self.profiler.trace is None:
            self.sdpa.execute(kind, NH, qkv, arrays, ws)
        else:
            self.profiler.traced(f"cudnn_sdpa_{kind}", self.sdpa.execute, kind, NH, qkv,
                                 arrays, ws)

    def _flash(self, kind, qkv, NH, *args) -> None:
        """Launches flash_{kind}: a block per 16 * FLASH_WARPS rows of each (b, h), the
        kernel built for the smallest head size of FLASH_HEAD_SIZES that holds HS. The grid
        is (b·h, row tile): blocks go out x fastest, so every head's longest tile (the first
        y) starts before any head's shorter ones, not head after head with the last head's
        long tiles last (the H200 profile's critical path: 38/44/54 tiles against 20/25/33
        so ordered)."""
        B, T, C3 = qkv.shape
        HS = C3 // 3 // NH
        why = self.attention_refuses(HS, qkv.dtype)
        # a head size it lacks (its 16-byte accesses would reach into the next head's
        # columns) or shared memory the GPU lacks: refused in a line, before CUDA fails
        # setting it
        if why:
            raise CupyGPTError(why)
        hsp = next(n for n in FLASH_HEAD_SIZES if n >= HS)
        x, warps, name = qkv.dtype.itemsize, GEOMETRY["FLASH_WARPS"], f"flash_{kind}_{hsp}"
        smem = flash_smem_bytes(kind, hsp, x, x == 4 and not self.tf32,
                                self.kernels.fp32_doubled())
        k = self.kernels.get(name, "bf16" if qkv.dtype == BF16 else "fp32")
        if k.max_dynamic_shared_size_bytes < smem:  # above 48 KiB, CUDA asks for an opt-in
            k.max_dynamic_shared_size_bytes = smem
        self.kernels.launch(name, (B * NH, -(-T // (16 * warps))), (32 * warps,), *args,
                            np.float32(1.0 / math.sqrt(HS)), i32(T), i32(NH), i32(HS),
                            i32(self.tf32), shared_mem=smem)

    @op
    def attention_forward(self, out, lse, qkv, NH: int) -> None:
        if self.attention.kind == "cudnn" and qkv.dtype == BF16:
            self._fused("forward", NH, qkv, o=out, stats=lse)
        else:
            self._flash("forward", qkv, NH, out, lse, qkv)

    @op
    def attention_backward(self, dqkv, dout, qkv, out, lse, NH: int) -> None:
        if self.attention.kind == "cudnn" and qkv.dtype == BF16:
            return self._fused("backward", NH, qkv, dqkv=dqkv, do=dout, o=out, stats=lse)
        D = self._ws("flash_D", lse.size)  # rowsum(dout * out): flash_dq writes, flash_dkdv reads
        self._flash("dq", qkv, NH, dqkv, D, dout, qkv, out, lse)
        self._flash("dkdv", qkv, NH, dqkv, D, dout, qkv, lse)

    def _qkv_split(self, qkv, NH):
        B, T, C3 = qkv.shape
        C = C3 // 3
        n = B * T * C
        q, k, v = (self._ws(key, n, qkv.dtype) for key in ("q", "k", "v"))
        self.kernels.ew("permute_qkv", n, q, k, v, qkv, i32(B), i32(T), i32(NH), i32(C // NH))
        return B, T, C, C // NH, q, k, v

    @op
    def attention_decode(self, out, qkv, NH: int) -> None:
        """Generation's step: the attention of the last of n positions over all n. qkv
        (1,n,3C) holds every earlier position's q, k, v (the KV cache) and the new one's;
        out (1,1,C)."""
        _, n, C, HS, q, k, v = self._qkv_split(qkv, NH)
        scores, att = self._ws("dec_scores", NH * n), self._ws("dec_att", NH * n, qkv.dtype)
        # per head: the last query row (1, HS) @ k^T (HS, n); heads are n*HS apart in q, k, v
        self.blas.gemm(N_, T_, 1, n, HS, q[(n - 1) * HS:], HS, k, HS, scores, n, batch=NH,
                       sA=n * HS, sB=n * HS, sC=n, alpha=1.0 / math.sqrt(HS))
        self.kernels.rows("softmax_decode", NH, att, scores, i32(NH), i32(n))
        # (1, n) @ v (n, HS) per head, straight into out: for one position (NH, HS) is (C,)
        self.blas.gemm(N_, N_, 1, HS, n, att, n, v, HS, out, HS, batch=NH, sA=n, sB=n * HS,
                       sC=HS)
