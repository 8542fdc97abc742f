"""cuDNN's fused attention (its sdpa graphs, through nvidia-cudnn-frontend's `cudnn`) for
the CUDA backend's bf16 runs, in place of the own flash kernels.

q, k and v are read straight from the packed qkv (B, T, 3, NH, HS) by strides (no permute
copy), the output is written as (B, T, NH, HS), the softmax stats (cuDNN's: the natural-log
logsumexp of each row, float) into the model's lse buffer (B, NH, T), and the backward
writes dq, dk, dv straight into the packed dqkv. The mask is causal (top-left diagonal).

Everything cuDNN needs but a CUDA graph capture may not do (the handle, each shape's graph:
validate, plans, support check, build, its workspace size) is made by plan (the memory
plan: the graphs the run needs, no more), or on a shape's first use: a shape first met
while the stream captures raises, naming it. A captured step only calls execute, on the
step's stream. A graph cuDNN will not run (cudnnGraphNotSupportedError from any stage)
is an Unsupported from plan, which --attention turns into auto's fallback or a refusal.

The handle, the graphs and their workspace sizes are a SdpaGraphs, the CudaBackend's.
"""
from __future__ import annotations

import math
from collections import OrderedDict

import cupy as cp

from .. import FusedAttentionUnsupported

try:
    import cudnn
    FRONTEND = True
except ImportError:  # the frontend is an extra (setup.cfg's cudnn); (the name cudnn is
    FRONTEND = False  # left unbound, not None: the conformance check follows it to cudnn)

# Head sizes (C/NH) every cuDNN 9 sdpa runs forward and backward on Ampere and Hopper:
# multiples of 8 (its 16-byte rows) up to 128 (its backward's limit before Blackwell)
HEAD_MULTIPLE, MAX_HEAD = 8, 128
# Graphs kept, but those a capture executed (a replay runs their plans' kernels, which go
# with the graph): a process meeting many shapes (runners of several sizes, as tests and
# gpucheck make) keeps the last few, not every one
CACHED = 8


def missing() -> str | None:
    """What of cuDNN is not installed here (its frontend, or the library it loads), or
    None."""
    if not FRONTEND:
        return "cuDNN's frontend is not installed (pip install '.[cudnn]')"
    try:
        cudnn.backend_version()
    except Exception:  # (the frontend finds no libcudnn: RuntimeError, its symbol missing)
        return ("the cuDNN library is not installed (pip install '.[cudnn]' brings "
                "nvidia-cudnn-cu13)")
    return None


def refuses(bf16: bool, head_size: int) -> str | None:
    """Why cuDNN's fused attention cannot run a run of this type and head size here, or
    None: cuDNN missing, fp32 (cuDNN's sdpa is bf16 and fp16 only; fp32 runs keep the own
    kernels), or a head size its sdpa does not run."""
    if missing():
        return missing()
    if not bf16:
        return "cuDNN's fused attention runs bf16 only (fp32 runs take the own kernels)"
    if head_size % HEAD_MULTIPLE or head_size > MAX_HEAD:
        return (f"cuDNN's sdpa runs head sizes (C/NH) that are multiples of {HEAD_MULTIPLE} "
                f"up to {MAX_HEAD}; this model's is {head_size}")
    return None


def _layouts(B, NH, T, HS):
    """Dims (B, NH, T, HS) and the strides (elements) of each buffer the graphs read: the
    packed qkv (and dqkv), the (B, T, NH, HS) output (and its gradient), the stats."""
    C = NH * HS
    return ([B, NH, T, HS], {"packed": [T * 3 * C, HS, 3 * C, 1], "rows": [T * C, HS, C, 1],
                             "stats": [NH * T, T, 1, 1]})


def _declare(t, dims, stride, dtype):
    return t.set_output(True).set_dim(dims).set_stride(stride).set_data_type(dtype)


class SdpaGraphs:
    """cuDNN's handle (made with the first graph) and the graphs built, by shape."""

    def __init__(self) -> None:
        self.handle = None
        # (kind, B, NH, T, HS) -> (graph, its tensors by name, workspace bytes), least
        # recently used first; at most CACHED of them but those in captured
        self.graphs = OrderedDict()
        self.captured = set()
        self.sizes = {}  # (B, NH, T, HS) -> the workspace its built graphs ask, the most

    def _build(self, kind, B, NH, T, HS, replay):
        if self.handle is None:
            self.handle = cudnn.create_handle()
        bf16, f32 = cudnn.data_type.BFLOAT16, cudnn.data_type.FLOAT
        # (replay: the run captures its step once and replays it, so the frontend may rank
        # plans by their GPU time alone; a hint only, no numerics change)
        g = cudnn.pygraph(io_data_type=bf16, intermediate_data_type=f32, compute_data_type=f32,
                          handle=self.handle, is_cuda_graph_replay_expected=replay)
        dims, st = _layouts(B, NH, T, HS)
        t = {n: g.tensor(dims, st["packed"], bf16, name=n) for n in ("q", "k", "v")}
        # causal as 1.32's preferred masking args (its docstrings list use_causal_mask among
        # the deprecated ones, undefined when mixed with these): row i sees keys 0..i
        causal = dict(attn_scale=1.0 / math.sqrt(HS), diagonal_band_right_bound=0,
                      diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT)
        if kind == "forward":
            t["o"], t["stats"] = g.sdpa(t["q"], t["k"], t["v"], generate_stats=True, **causal)
            _declare(t["o"], dims, st["rows"], bf16)
            _declare(t["stats"], dims[:3] + [1], st["stats"], f32)
        else:
            t["o"], t["do"] = (g.tensor(dims, st["rows"], bf16, name=n) for n in ("o", "do"))
            t["stats"] = g.tensor(dims[:3] + [1], st["stats"], f32, name="stats")
            # deterministic: cuDNN's default backward may sum dQ with atomics, in an order that
            # changes from run to run; the project's attention backward is bitwise repeatable
            grads = g.sdpa_backward(t["q"], t["k"], t["v"], t["o"], t["do"], t["stats"],
                                    use_deterministic_algorithm=True, **causal)
            for n, d in zip(("dq", "dk", "dv"), grads):
                t[n] = _declare(d, dims, st["packed"], bf16)
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        # (no handle: in 1.32 the handle overload sizes the backend's current candidate plan,
        # which need not be the plan build_plans built)
        return g, t, g.get_workspace_size()


    def graph(self, kind: str, B: int, NH: int, T: int, HS: int, replay: bool = False):
        """The built graph of kind ("forward" | "backward") for this shape, its tensors and the
        workspace it asks: built on first use (replay: the hint it is built with), which a
        capturing stream refuses."""
        key = (kind, B, NH, T, HS)
        if key in self.graphs:
            self.graphs.move_to_end(key)
            return self.graphs[key]
        if cp.cuda.get_current_stream().is_capturing():
            raise RuntimeError(f"cuDNN attention {kind} of a shape first seen while the stream "
                               f"captures a CUDA graph (B={B} NH={NH} T={T} HS={HS}): its "
                               f"graph must be built in an eager step first")
        self.graphs[key] = built = self._build(kind, B, NH, T, HS, replay)
        self.sizes[key[1:]] = max(self.sizes.get(key[1:], 0), built[2])
        evictable = [k for k in self.graphs if k not in self.captured]
        for old in evictable[:max(0, len(self.graphs) - CACHED)]:
            del self.graphs[old]
            if not any(k[1:] == old[1:] for k in self.graphs):
                del self.sizes[old[1:]]
        return built


    def plan(self, B: int, NH: int, T: int, HS: int, backward: bool, replay: bool) -> int:
        """Builds the graphs a run of this shape needs (the forward; the backward where it
        trains), before any capture, and returns the workspace the shape's graphs ask (one
        buffer serves both: they run one after the other on one stream). Raises
        FusedAttentionUnsupported where cuDNN will not run one of them."""
        try:
            for kind in ("forward", "backward") if backward else ("forward",):
                self.graph(kind, B, NH, T, HS, replay)
        except cudnn.cudnnGraphNotSupportedError as e:
            # (its sentence's full stop dropped: the caller goes on after it)
            raise FusedAttentionUnsupported(f"cuDNN does not run this run's attention (B={B} "
                                            f"NH={NH} T={T} HS={HS}): {str(e).rstrip('.')}"
                                            ) from None
        return self.sizes[B, NH, T, HS]


    def workspace_bytes(self, B: int, NH: int, T: int, HS: int) -> int:
        """The workspace kept for this shape's graphs: the most any of them built so far asks
        (after plan, what the memory plan counted)."""
        return self.sizes[B, NH, T, HS]


    def execute(self, kind: str, NH: int, qkv, arrays, workspace) -> None:
        """Runs kind's graph on the current stream: q, k, v at their offsets into qkv (and dq,
        dk, dv into arrays["dqkv"]), the other tensors from arrays by name."""
        B, T, C3 = qkv.shape
        C = C3 // 3
        key = (kind, B, NH, T, C // NH)
        g, t, size = self.graph(*key)
        if cp.cuda.get_current_stream().is_capturing():
            self.captured.add(key)  # (a replay will run its plan's kernels: kept from eviction)
        item = qkv.dtype.itemsize
        pack = {t[n]: qkv.data.ptr + i * C * item for i, n in enumerate("qkv")}
        if kind == "backward":
            pack.update({t[n]: arrays["dqkv"].data.ptr + i * C * item
                         for i, n in enumerate(("dq", "dk", "dv"))})
        pack.update({t[n]: arrays[n].data.ptr for n in ("o", "stats", "do") if n in arrays})
        cudnn.set_stream(self.handle, cp.cuda.get_current_stream().ptr)
        g.execute(pack, workspace.data.ptr if size else None, handle=self.handle)
