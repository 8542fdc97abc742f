"""The CUDA backend: the NumPy reference's interface over CuPy arrays, with our kernels
(kernels_cu/, cupy.RawModule) and cuBLASLt matmuls (nvmath-python's bindings), in fp32
(TF32 is a cuBLASLt compute type) or bf16 (llm.c's mainline: bf16 storage, fp32 math,
GEMMs with fp32 compute). Each kernel file is compiled once per storage type; a launch
takes the bf16 build when any of its arrays is bf16.

Matmuls go through cuBLASLt, not CuPy's cuBLAS wrappers: those set the handle's stream on
every call, which CuPy refuses while a stream captures a CUDA graph. Everything cuBLASLt
needs but a capture may not do (the handle, the workspace, each shape's descriptor,
layouts and heuristic-chosen algorithm) is made on a matmul's first call, in the eager
first step; a captured step only calls cublasLtMatmul. Biases are the GEMMs' epilogues:
forward BIAS (added before the output is rounded), backward BGRADB (the bias gradient
from the weight-gradient GEMM, into a scratch of the gradient's type added into the
gradient buffer: cuBLASLt takes no other bias type for bf16 or fp32 products).

Attention keeps q, k, v and its other temporaries in backend workspaces (reused by every
layer; backward re-permutes qkv, so the interface stays the reference's). Nothing here
allocates after the first step, so a whole step can be captured as a CUDA graph.

One module, as each backend is: its public functions are the interface, and cudasim
loads this file whole against its stand-in CuPy (harness.load_cudasim); modules imported
beside it would keep whichever CuPy they were first imported with.
"""
from __future__ import annotations

import functools
import math
import os
import re
import socket
import time
from collections.abc import Callable

import cupy as cp
import numpy as np
from nvmath.bindings import cublasLt as lt
from numpy.typing import DTypeLike

from .. import CupyGPTError
# (names, not the module: cudasim's harness puts its own build of it in sys.modules)
from .cudnn_attention import (execute as _sdpa_execute, graph as _sdpa_graph,
                              missing as _sdpa_missing, plan as _sdpa_plan,
                              refuses as _sdpa_refuses, workspace_bytes as _sdpa_workspace)
from .kernels import (FLASH_HEAD_SIZES, GEOMETRY, flash_fp32_doubled, flash_smem_bytes,
                      kernels_in, options, sources)
from ..model.layout import Part
from ..model.shape import GPT2Config
from ..precision import BF16, dtype_name

name = "cuda"
# Capabilities (backends/__init__.py lists them)
DTYPES = (np.float32, BF16)
TRANSPORTS = ("nvshmem", "nccl", "mpi")  # preferred first
supports_graphs = True
asynchronous = True                      # launches return before the GPU is done
DEFAULT_RUN = ("d12", 1024)              # -e, -t when not given: llm.c's GPT-2 124M run
DEFAULT_DTYPE = "bf16"                   # --dtype when not given: llm.c's on a GPU
# Dense (no sparsity) TF32 tensor-core peak, TFLOP/s, from NVIDIA's data sheets; the most
# specific name first.
TF32_PEAK = {"H100 SXM": 494.7, "H100 NVL": 417.5, "H100 PCIe": 378.0, "H100": 494.7,
             "H200": 494.7, "A100": 156.0, "L40S": 183.0}
BF16_PEAK = {k: 2 * v for k, v in TF32_PEAK.items()}  # the same tables: twice TF32's

# cudaDataType (library_types.h) and cublasComputeType_t (cublas_api.h): fp32 math, exact or
# with TF32 tensor cores
CUDA_TYPE = {np.dtype(np.float32): 0, BF16: 14}
COMPUTE_32F, COMPUTE_32F_FAST_TF32 = 68, 77
tf32 = False
_modules, _functions, _workspace, _optin = {}, {}, {}, {}
_trace = None     # while kernel_profile runs: {"op": current op, "ops": [...], "kernels": [...]}
_ONE, _ZERO = np.array(1.0, np.float32), np.array(0.0, np.float32)
# which attention bf16 runs take ("cudnn" or "own") and what the run asks of cuDNN's:
# {"backward": its graph too, "replay": a captured step} (use_attention)
_attention = ["own", {"backward": True, "replay": False}]


def device_name() -> str:
    """The run table's name of the GPU this rank computes on."""
    return f"GPU {cp.cuda.Device().id} ({cp.cuda.Device().pci_bus_id})"


def configure(tf32: bool = False, device_of: Callable | None = None, ranks_here: int = 1) -> None:
    """Uses GPU device_of(visible GPUs) (None: GPU 0); TF32 tensor-core matmuls on
    (training) or off (verify); all work goes to one non-blocking stream (the legacy
    default stream cannot be captured into a CUDA graph)."""
    globals()["tf32"] = bool(tf32)
    _optin.clear()  # (read again from the device now used)
    cp.cuda.Device(device_of(cp.cuda.runtime.getDeviceCount()) if device_of else 0).use()
    cp.cuda.Stream(non_blocking=True).use()
    _plans.clear()  # (their compute type follows tf32)


_files = {}  # kernel name: its .cu file


def _k(fn, dtype="fp32"):
    """A kernel by name, from its .cu file compiled for dtype's storage type on first use
    (CuPy caches it on disk)."""
    if not _files:
        for path in sources():
            for kernel in kernels_in(open(path).read()):
                _files[kernel] = path
    doubled = _fp32_doubled()  # (a -D of every module: part of every key)
    key = (fn, dtype, doubled)
    if key not in _functions:
        mod = (_files[fn], dtype, doubled)
        try:  # (CuPy compiles here, and reads and writes its kernel cache)
            if mod not in _modules:
                _modules[mod] = cp.RawModule(code=open(mod[0]).read(),
                                             options=options(dtype, doubled))
            _functions[key] = _modules[mod].get_function(fn)
        except OSError as e:
            raise CupyGPTError(f"cannot compile or cache the CUDA kernels of "
                               f"{os.path.basename(mod[0])} ({e.strerror or e}): CuPy's kernel "
                               f"cache (CUPY_CACHE_DIR, else ~/.cupy/kernel_cache) must be a "
                               f"directory this user can write") from None
    return _functions[key]


def _smem_optin():
    """The device's shared memory a block may opt in to (bytes): 227 KiB on sm_90, 163 on
    sm_80, 99 on sm_86/89/120, where fp32 flash heads above 64 cannot double-buffer
    (kernels.flash_fp32_doubled). Read once after configure (which picks the device), as
    every launch's _k asks."""
    if not _optin:
        optin = int(cp.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"])
        _optin.update(optin=optin, doubled=flash_fp32_doubled(optin))
    return _optin["optin"]


def _fp32_doubled():
    _smem_optin()
    return _optin["doubled"]


def _launch(fn, grid, block, *args, shared_mem=0):
    """Launches kernel fn, its bf16 build when an argument is a bf16 array."""
    k = _k(fn, "bf16" if any(getattr(a, "dtype", None) == BF16 for a in args) else "fp32")
    if _trace is None:
        k(grid, block, args, shared_mem=shared_mem)
    else:
        _traced(fn, k, grid, block, args, shared_mem=shared_mem)


def _timed(f, *args, **kw):
    """(start, end) CUDA events around f(*args, **kw)."""
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    f(*args, **kw)
    end.record()
    return start, end


def _traced(name, f, *args, **kw):
    _trace["kernels"].append((_trace["op"], name, *_timed(f, *args, **kw)))


def _op(fn):
    """A public op: under kernel_profile it is timed whole, and the kernels and cuBLAS
    calls inside it are counted as its own."""
    @functools.wraps(fn)
    def op(*args, **kw):
        if _trace is None:
            return fn(*args, **kw)
        _trace["op"] = fn.__name__
        _trace["ops"].append((fn.__name__, *_timed(fn, *args, **kw)))
    return op


def kernel_profile(step: Callable, steps: int) -> tuple[list, list] | None:
    """Where the GPU time of `steps` calls of step() goes (eager steps only: the events
    would be captured into a graph): per op and per kernel within each op, each cuBLAS call
    named "sgemm_{op flags} MxNxK[xbatch]". Returns (per_op, per_kernel) rows."""
    global _trace
    _trace = {"op": None, "ops": [], "kernels": []}
    try:
        for _ in range(steps):
            step()
        synchronize()
        ops, kernels = _trace["ops"], _trace["kernels"]
    finally:
        _trace = None
    ms = lambda s, e: cp.cuda.get_elapsed_time(s, e) / steps  # noqa: E731
    per_op, per_kernel, calls = {}, {}, {}
    for op, s, e in ops:
        per_op[op] = per_op.get(op, 0.0) + ms(s, e)
    for op, kernel, s, e in kernels:
        per_kernel[op, kernel] = per_kernel.get((op, kernel), 0.0) + ms(s, e)
        calls[op, kernel] = calls.get((op, kernel), 0) + 1
    whole, inside = sum(per_op.values()), sum(per_kernel.values())
    return ([{"op": op, "ms_per_step": t, "share": t / whole}
             for op, t in sorted(per_op.items(), key=lambda kv: -kv[1])],
            [{"op": op, "kernel": k, "calls_per_step": calls[op, k] // steps,
              "ms_per_step": t, "share": t / inside}
             for (op, k), t in sorted(per_kernel.items(), key=lambda kv: -kv[1])])


def _ew(fn, n, *args, per_thread=1):
    threads = GEOMETRY["EW_THREADS"]
    n = (n + per_thread - 1) // per_thread
    _launch(fn, ((n + threads - 1) // threads,), (threads,), *args)


def _packed(fn, out, *args):
    """An elementwise kernel over out's elements, PACK (16 bytes of out's dtype: 128-bit
    accesses) per thread."""
    _ew(fn, out.size, out, *args, np.int64(out.size), per_thread=16 // out.dtype.itemsize)


def _row_packs(rows, C, dtype):
    """Threads for rows of C elements, PACK (16 bytes of dtype) columns each."""
    return rows * -(-C // (16 // np.dtype(dtype).itemsize))


def _whole_packs(fn, C, *arrays):
    """fn, or its _v entry where every row's packs of these arrays are whole aligned 16-byte
    runs (C a multiple of a pack, each array 16-byte aligned): decided here, once per
    launch, so the kernel's loads are straight-line code, several in flight."""
    pack = 16 // arrays[0].dtype.itemsize
    return fn + "_v" if C % pack == 0 and all(a.data.ptr % 16 == 0 for a in arrays) else fn


def _rows(fn, rows, *args):
    warps = GEOMETRY["ROW_WARPS"]
    _launch(fn, ((rows + warps - 1) // warps,), (warps * GEOMETRY["WARP"],), *args)


def _ws(key, n, dtype=np.float32, zeroed=False):
    """A workspace buffer of at least n elements of dtype, kept for the process (zeroed:
    made with zeros, for a user that leaves it zeroed)."""
    buf = _workspace.get((key, np.dtype(dtype)))
    if buf is None or buf.size < n:
        buf = _workspace[key, np.dtype(dtype)] = (cp.zeros if zeroed else cp.empty)(n, dtype)
    return buf[:n]


# --- matmuls (cuBLASLt) ----------------------------------------------------------------

LT_WORKSPACE = 32 * 2**20  # cuBLAS's recommended workspace on Hopper; one for every matmul
LT_ALIGN = 256             # the workspace's alignment (what cuBLAS asks of one)
BIAS_ALIGN = 16            # an epilogue's bias vector: 16-byte aligned, else the fallback
_lt = {}                   # "handle", "workspace": made on the first matmul, before a capture
_plans = {}                # a matmul's shape, types, epilogue and alignments -> its plan
epilogue_fallbacks = {}    # (epilogue, why) -> calls made without it (bench reports them)


def _lt_ready():
    if not _lt:
        _lt["handle"] = lt.create()
        raw = _ws("cublaslt", LT_WORKSPACE + LT_ALIGN, np.uint8)
        start = -raw.data.ptr % LT_ALIGN
        _lt["workspace"] = raw[start:start + LT_WORKSPACE]
    return _lt["handle"]


def _set(setter, obj, attr, value, dtype_of):
    v = np.array(value, dtype_of(attr))
    setter(obj, attr, v.ctypes.data, v.nbytes)


def _alignment(ptr):
    """The alignment a plan asks of a matrix at ptr: 16 bytes (what Hopper's TMA loads want;
    cuBLASLt assumes 256 unless told), or less where ptr has less. Capped so that the views
    of one shape (micro-batch slots, chunks) share one plan: a shape first met inside a
    capture cannot be planned there."""
    return min(16, ptr & -ptr) if ptr else 16


def _layout(dtype, rows, cols, ld, batch, stride):
    layout = lt.matrix_layout_create(CUDA_TYPE[np.dtype(dtype)], rows, cols, ld)
    if batch > 1:
        _set(lt.matrix_layout_set_attribute, layout, lt.MatrixLayoutAttribute.BATCH_COUNT,
             batch, lt.get_matrix_layout_attribute_dtype)
        _set(lt.matrix_layout_set_attribute, layout,
             lt.MatrixLayoutAttribute.STRIDED_BATCH_OFFSET, stride,
             lt.get_matrix_layout_attribute_dtype)
    return layout


def _plan(key, epilogue, bias_ptr):
    """The descriptor, layouts and algorithm of a column-major D (m,n) = alpha op(A) op(B)
    + beta C: made once (never while a stream captures: cuBLASLt's setup is not graph
    work). The heuristic's first algorithm, split-K only with a reduction pass over the
    workspace, never in place in the output (a run must repeat its bits, and the in-place
    scheme's order rests on counters between blocks); None when no algorithm takes the
    epilogue."""
    h = _lt_ready()
    (ta, tb, m, n, k, lda, ldb, ldc, batch, sA, sB, sC, at, bt, ct, aligns) = key
    desc = lt.matmul_desc_create(COMPUTE_32F_FAST_TF32 if tf32 and at == np.float32 else
                                 COMPUTE_32F, CUDA_TYPE[np.dtype(np.float32)])
    d = lt.get_matmul_desc_attribute_dtype
    _set(lt.matmul_desc_set_attribute, desc, lt.MatmulDescAttribute.TRANSA, ta, d)
    _set(lt.matmul_desc_set_attribute, desc, lt.MatmulDescAttribute.TRANSB, tb, d)
    if epilogue != lt.Epilogue.DEFAULT:
        _set(lt.matmul_desc_set_attribute, desc, lt.MatmulDescAttribute.EPILOGUE, epilogue, d)
        _set(lt.matmul_desc_set_attribute, desc, lt.MatmulDescAttribute.BIAS_POINTER,
             bias_ptr, d)
    # (the bias type stays D's: an H100's cuBLASLt 13.1 refuses a float bias vector, for
    # BGRADB as for BIAS, on a bf16 product with INVALID_VALUE)
    layouts = (_layout(at, *((m, k) if ta == N_ else (k, m)), lda, batch, sA),
               _layout(bt, *((k, n) if tb == N_ else (n, k)), ldb, batch, sB),
               _layout(ct, m, n, ldc, batch, sC))
    pref = lt.matmul_preference_create()
    p = lt.get_matmul_preference_attribute_dtype
    _set(lt.matmul_preference_set_attribute, pref,
         lt.MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES, LT_WORKSPACE, p)
    _set(lt.matmul_preference_set_attribute, pref,
         lt.MatmulPreferenceAttribute.REDUCTION_SCHEME_MASK,
         lt.ReductionScheme.MASK & ~lt.ReductionScheme.INPLACE, p)
    for attr, align in zip(("A", "B", "C", "D"), aligns + aligns[2:]):
        _set(lt.matmul_preference_set_attribute, pref,
             getattr(lt.MatmulPreferenceAttribute, f"MIN_ALIGNMENT_{attr}_BYTES"), align, p)
    found = np.zeros(1, lt.matmul_heuristic_result_dtype)
    count = np.zeros(1, np.int32)
    refused = "cuBLASLt has no algorithm with it for this shape and these types"
    try:
        lt.matmul_algo_get_heuristic(h, desc, layouts[0], layouts[1], layouts[2], layouts[2],
                                     pref, 1, found.ctypes.data, count.ctypes.data)
    except lt.cuBLASLtError as e:  # (how a cuBLASLt refuses an epilogue it lacks here)
        if epilogue == lt.Epilogue.DEFAULT:
            raise
        status = re.search(r"CUBLAS_STATUS_\w+", str(e))
        refused = ("cuBLASLt refuses it for this shape and these types"
                   + (f" ({status.group()})" if status else ""))
    finally:
        lt.matmul_preference_destroy(pref)
    if count[0] == 0 or found["state"][0] != 0:
        lt.matmul_desc_destroy(desc)
        for layout in layouts:
            lt.matrix_layout_destroy(layout)
        if epilogue == lt.Epilogue.DEFAULT:
            raise CupyGPTError(f"cuBLASLt has no algorithm for the matmul {key}")
        return {"refused": refused}
    return {"desc": desc, "layouts": layouts, "algo": found, "bias": bias_ptr}


def _gemm(ta, tb, M, N, K, A, lda, B, ldb, C, ldc, beta=0.0, batch=1, sA=0, sB=0, sC=0,
          alpha=1.0, bias=None, bias_grad=None):
    """Row-major C (M,N) = alpha op(A) @ op(B) + beta * C (+ bias (N)), batched with element
    strides, through cuBLASLt: fp32 (TF32 tensor cores when tf32), or bf16 A and B with fp32
    compute and C bf16 (rounded once, the bias in first; beta's C read in) or float.
    bias_grad (N, C's type): the column sums of op(A), written (BGRADB's, not added).
    Returns the epilogue that could not run (the caller adds its term), or None.

    cuBLASLt is column-major: a row-major matrix is its transpose there, so we ask for
    C^T = op(B)^T op(A)^T, i.e. swap the operands and keep each one's transpose flag (the
    bias runs along C^T's rows; op(A)^T is the k x N operand B there, so its bias gradient
    is BGRADB's)."""
    vec = bias if bias is not None else bias_grad
    key = (tb, ta, N, M, K, ldb, lda, ldc, batch, sB, sA, sC, B.dtype, A.dtype, C.dtype,
           tuple(_alignment(x.data.ptr) for x in (B, A, C)))
    plan, missing = None, None
    if vec is not None:
        epilogue = lt.Epilogue.BIAS if bias is not None else lt.Epilogue.BGRADB
        if vec.data.ptr % BIAS_ALIGN:
            why = f"its vector is not {BIAS_ALIGN}-byte aligned"
        elif vec.dtype != C.dtype:
            why = "its vector and output types differ"
        else:
            plan = _cached(key, epilogue, vec.data.ptr)
            why = plan.get("refused")
            plan = None if why else plan
        if plan is None:
            missing = epilogue
            epilogue_fallbacks[epilogue.name, why] = \
                epilogue_fallbacks.get((epilogue.name, why), 0) + 1
        elif plan["bias"] != vec.data.ptr:  # (host memory only: allowed in a capture, and
            plan["bias"] = vec.data.ptr      # the captured call keeps the pointer it saw)
            _set(lt.matmul_desc_set_attribute, plan["desc"],
                 lt.MatmulDescAttribute.BIAS_POINTER, plan["bias"],
                 lt.get_matmul_desc_attribute_dtype)
    plan = plan or _cached(key, lt.Epilogue.DEFAULT, 0)
    args = (_lt_ready(), plan["desc"], _scalar(alpha).ctypes.data,
            B.data.ptr, plan["layouts"][0], A.data.ptr, plan["layouts"][1],
            (_ONE if beta else _ZERO).ctypes.data, C.data.ptr, plan["layouts"][2],
            C.data.ptr, plan["layouts"][2], plan["algo"].ctypes.data,
            _lt["workspace"].data.ptr, LT_WORKSPACE, cp.cuda.get_current_stream().ptr)
    if _trace is None:
        lt.matmul(*args)
    else:
        shape = f"{'NT'[ta]}{'NT'[tb]} {M}x{N}x{K}" + (f"x{batch}" if batch > 1 else "")
        _traced("gemm_" + shape, lt.matmul, *args)
    return missing


def _cached(key, epilogue, bias_ptr):
    """The plan of key with this epilogue (its bias pointer first set to bias_ptr): made
    on first use, refused while the stream captures (cuBLASLt's setup is no graph work)."""
    full = (key, epilogue)
    if full not in _plans:
        if cp.cuda.get_current_stream().is_capturing():
            raise RuntimeError(f"a matmul first seen while the stream captures a CUDA graph "
                               f"({key}, {epilogue.name}): its cuBLASLt plan must be made in "
                               f"an eager step first")
        _plans[full] = _plan(key, epilogue, bias_ptr)
    return _plans[full]


_scalars = {}  # alpha values by value: cuBLAS reads them through a host pointer


def _scalar(x):
    return _scalars.setdefault(float(x), np.array(x, np.float32))


N_, T_ = 0, 1  # cuBLAS operation flags: no transpose, transpose


def _i(x):
    return np.int32(x)


# --- memory ------------------------------------------------------------------------------

def zeros(n: int, dtype: DTypeLike = np.float32):
    try:
        return cp.zeros(n, dtype)
    except cp.cuda.memory.OutOfMemoryError:
        free, total = cp.cuda.runtime.memGetInfo()
        raise CupyGPTError(f"out of GPU memory allocating {n * np.dtype(dtype).itemsize / 2**30:.2f} "
                           f"GiB ({free / 2**30:.2f} GiB free of {total / 2**30:.2f}); lower the batch "
                           f"size or sequence length, or use more pipeline stages") from None


# Copies name the stream: before CuPy 14 a copy without one went through the legacy
# default stream, which does not wait for work on our non-blocking stream.

def upload(dst, host: np.ndarray) -> None:
    """Copies a host array into an existing device array (no allocation), in stream order."""
    dst.set(np.ascontiguousarray(host, dtype=dst.dtype), stream=cp.cuda.get_current_stream())


# How the host waits for a stream: CUDA's synchronize, unless a transport whose peers'
# signals the stream waits on bounded it (bound_host_waits): a stream waiting on a stopped
# peer never finishes, and a synchronize (or a copy to pageable host memory) never gives up.
_host_wait = [lambda stream: stream.synchronize()]


def bound_host_waits(wait: Callable) -> None:
    """wait(stream): returns once the stream's work has run, or raises; every host wait of
    this backend goes through it from now on."""
    _host_wait[0] = wait


def to_host(a) -> np.ndarray:
    """A host copy of a, once the work queued before it has finished: the stream is waited
    for first, so the copy itself has nothing left to wait on."""
    stream = cp.cuda.get_current_stream()
    _host_wait[0](stream)
    out = a.get(stream=stream)
    stream.synchronize()
    return out


def synchronize() -> None:
    _host_wait[0](cp.cuda.get_current_stream())


_origin = []  # (event, host seconds) taken together once, for stamp_seconds


def stamp():
    """A CUDA event recorded on the compute stream (--trace): when the GPU got there."""
    if not _origin:
        synchronize()
        e = cp.cuda.Event()
        e.record()
        synchronize()
        _origin.append((e, time.perf_counter()))
    e = cp.cuda.Event()
    e.record()
    return e


def stamp_seconds(marks: list) -> list[float]:
    """Host-clock seconds of recorded events: the origin's host time plus GPU elapsed."""
    synchronize()
    e0, h0 = _origin[0]
    return [h0 + cp.cuda.get_elapsed_time(e0, m) / 1e3 for m in marks]


def capture(fn: Callable):
    """Records fn's launches on the current stream as a CUDA graph (nothing runs yet).
    Every matmul in fn must have run eagerly once (its cuBLASLt plan is made then; the
    workspace is our own, allocated with the first); a step is captured only once."""
    stream = cp.cuda.get_current_stream()
    stream.begin_capture()
    try:
        fn()
    finally:
        graph = stream.end_capture()
    return graph


def replay(graph) -> None:
    graph.launch(cp.cuda.get_current_stream())


def memory_in_use() -> int:
    return cp.get_default_memory_pool().total_bytes()


def device_memory() -> int | None:
    """Free device memory, bytes (the driver's free plus what CuPy's pool holds unused)."""
    return cp.cuda.runtime.memGetInfo()[0] + cp.get_default_memory_pool().free_bytes()


memory_name = "the GPU"


def workspace_bytes(shape: GPT2Config, batch: int, seq: int, part: Part, dtype: DTypeLike) -> int:
    """The most the kept workspaces (_ws) reach for a stage holding part, micro-batches of
    batch x seq: attention backward's float D (B, NH/tp, T), layernorm backward's float
    partials (two rows of C per ROW_WARPS rows), the column sums' (COLUMN_BLOCKS blocks of
    at most 256 columns, plus a row of 4C) and their counters, the norm's, and the embedding
    backward's three int32 arrays of B*T and its int64 keys (whole runs of SORT_KEYS), the
    bias gradients' scratch (4C, the widest; float at most), cuBLASLt's workspace and, where bf16
    attention goes through cuDNN, the workspace its graphs ask."""
    ln = -(-batch * seq // GEOMETRY["ROW_WARPS"]) * 2 * shape.C
    out = 4 * (batch * seq * shape.NH // part.tp + ln + COLUMN_BLOCKS * 256 + 5 * 4 * shape.C
               + 4 * shape.C) + LT_WORKSPACE + LT_ALIGN
    keys = -(-batch * seq // GEOMETRY["SORT_KEYS"]) * GEOMETRY["SORT_KEYS"]
    if _attention[0] == "cudnn" and np.dtype(dtype) == BF16:  # (builds the run's graphs)
        out += _sdpa_plan(batch, shape.NH // part.tp, seq, shape.C // shape.NH,
                          **_attention[1])
    return out + 8 * NORM_BLOCKS + (12 * batch * seq + 8 * keys if part.embed else 0)


def fallbacks() -> list:
    """Each bias epilogue a matmul ran without (its term added by a kernel after the GEMM):
    which, why, and how many calls."""
    return [f"{epilogue} epilogue: {why}; a kernel added its term instead ({n} calls)"
            for (epilogue, why), n in sorted(epilogue_fallbacks.items())]


def attention_refuses(head_size: int, dtype: DTypeLike | None = None) -> str | None:
    """Why the flash kernels cannot run heads of head_size (in dtype, when given), or None:
    they are built for FLASH_HEAD_SIZES and run any multiple of 8 up to the largest, whose
    shared memory (one buffer per walked tile where two do not fit) fits the device's."""
    top = FLASH_HEAD_SIZES[-1]
    if head_size % 8 or head_size > top:
        return (f"the cuda backend's attention runs head sizes (C/NH) that are multiples of "
                f"8 up to {top}; this model's is {head_size}")
    if dtype is None:
        return None
    x, optin = np.dtype(dtype).itemsize, _smem_optin()
    hsp = next(n for n in FLASH_HEAD_SIZES if n >= head_size)
    need = max(flash_smem_bytes(k, hsp, x, x == 4 and not tf32, _fp32_doubled())
               for k in ("forward", "dq", "dkdv"))
    if need > optin:
        return (f"the cuda backend's {dtype_name(dtype)} attention for head size {head_size} "
                f"needs {need:,} bytes of shared memory per block; this GPU allows "
                f"{optin:,}")
    return None


def fused_attention_refuses(dtype: DTypeLike, head_size: int) -> str | None:
    """Why cuDNN's fused attention cannot run a run of dtype with heads of head_size
    here, or None."""
    return _sdpa_refuses(np.dtype(dtype) == BF16, head_size)


def use_attention(kind: str, backward: bool = True, replay: bool = False) -> None:
    """Which attention the bf16 runs' attention_forward/backward take from now on:
    "cudnn" (cuDNN's fused sdpa) or "own" (the flash kernels; fp32 runs always do). The
    config has checked the run's dtype and head size (fused_attention_refuses). backward,
    replay: whether the run takes attention's backward and replays a captured step, so the
    memory plan builds cuDNN's backward graph only for a run that trains, and hints replay
    only to one that captures."""
    why = _sdpa_missing() if kind == "cudnn" else None
    if why or kind not in ("cudnn", "own"):
        raise CupyGPTError(why or "unknown; use cudnn or own", "attention", kind)
    _attention[:] = [kind, {"backward": bool(backward), "replay": bool(replay)}]


def _fused(kind, NH, qkv, **arrays):
    """cuDNN's graph of kind for this shape, run on the step's stream with the kept
    workspace: one buffer of the shape's size (the most its graphs ask; what the memory
    plan counted), not one per kind, so the forward's smaller ask allocates no second."""
    shape = (qkv.shape[0], NH, qkv.shape[1], qkv.shape[2] // 3 // NH)
    _sdpa_graph(kind, *shape, replay=_attention[1]["replay"])  # (built by the plan, else now)
    size = _sdpa_workspace(*shape)
    ws = _ws("cudnn", size, np.uint8) if size else None
    if _trace is None:
        _sdpa_execute(kind, NH, qkv, arrays, ws)
    else:
        _traced(f"cudnn_sdpa_{kind}", _sdpa_execute, kind, NH, qkv, arrays, ws)


def memory_domain() -> str:
    """What ranks with the same answer allocate from: this rank's GPU, by its PCI bus id
    (a device index counts only the GPUs this process is shown)."""
    return socket.gethostname(), cp.cuda.Device().pci_bus_id


def numerics() -> str:
    """Which arithmetic this is, for verify's tolerances."""
    return "cuda-tf32" if tf32 else "cuda"


def device_info() -> dict:
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    return {"device": props["name"].decode(), "backend": name, "cupy": cp.__version__,
            "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(),
            "driver": cp.cuda.runtime.driverGetVersion()}


def peak_flops(dtype: str = "fp32") -> float | None:
    """This GPU's dense TF32 (or bf16) peak FLOP/s (MFU's yardstick), None if not in the
    table."""
    dev = device_info()["device"]
    table = BF16_PEAK if dtype == "bf16" else TF32_PEAK
    return next((v * 1e12 for key, v in table.items() if key in dev), None)


def all_finite(a) -> bool:
    if a.dtype == BF16:  # a bf16 is finite when its exponent bits are not all ones
        return bool(to_host(((a.view(cp.uint16) & 0x7F80) != 0x7F80).all()))
    return bool(to_host(cp.isfinite(a).all()))


# --- forward -----------------------------------------------------------------------------

@_op
def encoder_forward(out, inp, wte, wpe, v0: int = 0) -> None:
    B, T = inp.shape
    rows, C = wte.shape
    _ew("encoder_forward", _row_packs(B * T, C, out.dtype), out, inp, wte,
        wte if wpe is None else wpe, _i(B), _i(T), _i(C), _i(v0), _i(rows), _i(wpe is not None))


@_op
def layernorm_forward(out, mean, rstd, inp, w, b) -> None:
    C = inp.shape[-1]
    N = inp.size // C
    _rows(_whole_packs("layernorm_forward", C, out, inp, w, b), N, out, mean, rstd, inp, w, b,
          _i(N), _i(C))


@_op
def matmul_forward(out, inp, w, bias=None) -> None:
    OC, C = w.shape
    if _gemm(N_, T_, inp.size // C, OC, C, inp, C, w, C, out, OC, bias=bias):
        _ew("bias_forward", out.size, out, bias, np.int64(out.size), _i(OC),
            per_thread=16 // out.dtype.itemsize)


def _qkv_split(qkv, NH):
    B, T, C3 = qkv.shape
    C = C3 // 3
    n = B * T * C
    q, k, v = (_ws(key, n, qkv.dtype) for key in ("q", "k", "v"))
    _ew("permute_qkv", n, q, k, v, qkv, _i(B), _i(T), _i(NH), _i(C // NH))
    return B, T, C, C // NH, q, k, v


def _flash(kind, qkv, NH, *args):
    """Launches flash_{kind}: a block per 16 * FLASH_WARPS rows of each (b, h), the kernel
    built for the smallest head size of FLASH_HEAD_SIZES that holds HS. The grid is (b·h,
    row tile): blocks go out x fastest, so every head's longest tile (the first y) starts
    before any head's shorter ones, not head after head with the last head's long tiles
    last (the H200 profile's critical path: 38/44/54 tiles against 20/25/33 so ordered)."""
    B, T, C3 = qkv.shape
    HS = C3 // 3 // NH
    why = attention_refuses(HS, qkv.dtype)
    # a head size it lacks (its 16-byte accesses would reach into the next head's columns)
    # or shared memory the GPU lacks: refused in a line, before CUDA fails setting it
    if why:
        raise CupyGPTError(why)
    hsp = next(n for n in FLASH_HEAD_SIZES if n >= HS)
    x, warps, name = qkv.dtype.itemsize, GEOMETRY["FLASH_WARPS"], f"flash_{kind}_{hsp}"
    smem = flash_smem_bytes(kind, hsp, x, x == 4 and not tf32, _fp32_doubled())
    k = _k(name, "bf16" if qkv.dtype == BF16 else "fp32")
    if k.max_dynamic_shared_size_bytes < smem:  # above 48 KiB, CUDA asks for an opt-in
        k.max_dynamic_shared_size_bytes = smem
    _launch(name, (B * NH, -(-T // (16 * warps))), (32 * warps,), *args,
            np.float32(1.0 / math.sqrt(HS)), _i(T), _i(NH), _i(HS), _i(tf32), shared_mem=smem)


@_op
def attention_forward(out, lse, qkv, NH: int) -> None:
    if _attention[0] == "cudnn" and qkv.dtype == BF16:
        _fused("forward", NH, qkv, o=out, stats=lse)
    else:
        _flash("forward", qkv, NH, out, lse, qkv)


@_op
def attention_decode(out, qkv, NH: int) -> None:
    """Generation's step: the attention of the last of n positions over all n. qkv (1,n,3C)
    holds every earlier position's q, k, v (the KV cache) and the new one's; out (1,1,C)."""
    _, n, C, HS, q, k, v = _qkv_split(qkv, NH)
    scores, att = _ws("dec_scores", NH * n), _ws("dec_att", NH * n, qkv.dtype)
    # per head: the last query row (1, HS) @ k^T (HS, n); heads are n*HS apart in q, k, v
    _gemm(N_, T_, 1, n, HS, q[(n - 1) * HS:], HS, k, HS, scores, n, batch=NH, sA=n * HS,
          sB=n * HS, sC=n, alpha=1.0 / math.sqrt(HS))
    _rows("softmax_decode", NH, att, scores, _i(NH), _i(n))
    # (1, n) @ v (n, HS) per head, straight into out: for one position (NH, HS) is (C,)
    _gemm(N_, N_, 1, HS, n, att, n, v, HS, out, HS, batch=NH, sA=n, sB=n * HS, sC=HS)


@_op
def gelu_forward(out, inp) -> None:
    _packed("gelu_forward", out, inp)


@_op
def residual_forward(out, a, b) -> None:
    _packed("residual_forward", out, a, b)


@_op
def residual_layernorm_forward(res, a, b, out, mean, rstd, w, lnb) -> None:
    C = res.shape[-1]
    N = res.size // C
    _rows(_whole_packs("residual_layernorm_forward", C, res, a, b, out, w, lnb), N, res, a, b,
          out, mean, rstd, w, lnb, _i(N), _i(C))


@_op
def classifier_stats(stats, logits, targets, v0: int, valid: int) -> None:
    Vs = logits.shape[-1]
    _launch(_whole_packs("classifier_stats", Vs, logits), (logits.size // Vs,),
            (GEOMETRY["CLS_THREADS"],), stats, logits, targets, _i(v0), _i(valid), _i(Vs))


@_op
def classifier(logits, losses, stats, targets, v0: int, valid: int,
               dloss: float | None = None) -> None:
    Vs = logits.shape[-1]
    N = logits.size // Vs
    _launch(_whole_packs("classifier", Vs, logits), (N,), (GEOMETRY["CLS_THREADS"],), logits,
            losses, stats, targets, np.float32(dloss or 0.0), _i(dloss is not None), _i(v0),
            _i(valid), _i(Vs), _i(stats.shape[0]), _i(N))


@_op
def cross_entropy(logits, losses, targets, valid: int, dloss: float | None = None) -> None:
    Vs = logits.shape[-1]
    _launch(_whole_packs("cross_entropy", Vs, logits), (logits.size // Vs,),
            (GEOMETRY["CLS_THREADS"],), logits, losses, targets, np.float32(dloss or 0.0),
            _i(dloss is not None), _i(valid), _i(Vs))


@_op
def loss_accumulate(acc, losses) -> None:
    """acc (1,) float64 += sum of losses, on the device (no sync; graph-safe)."""
    _launch("loss_accumulate", (1,), (GEOMETRY["CLS_THREADS"],), acc, losses, _i(losses.size))


# --- backward ----------------------------------------------------------------------------

COLUMN_BLOCKS = 528  # column sums: at least this many blocks (4 per SM of an H100) where
                     # the rows allow, each chunk of rows at least ROW_LANES long


def _column_sum(out, inp, N, OC, out_b=None, split=None):
    """out (OC) += column sums of inp (N, OC), deterministically, in one launch (reduce.cu);
    with out_b, columns [split, OC) go to out_b instead. inp float: layernorm's partials
    (column_sum_f32), else a gradient of the run's type where a bias gradient's epilogue
    could not run (column_sum_x)."""
    per_thread = 16 // inp.dtype.itemsize
    tiles = -(-OC // (GEOMETRY["COL_TILE"] * per_thread))
    R = max(1, min(-(-COLUMN_BLOCKS // tiles), N // GEOMETRY["ROW_LANES"]))
    per = -(-N // R)
    R = -(-N // per)  # (no empty chunk)
    _launch("column_sum_f32" if inp.dtype == np.float32 else "column_sum_x", (tiles, R),
            (GEOMETRY["COL_TILE"], GEOMETRY["ROW_LANES"]), out, out if out_b is None else out_b,
            _i(OC if split is None else split), inp, _i(N), _i(OC), _i(per), _ws("colsum", R * OC),
            _ws("colsum_done", tiles, np.int32, zeroed=True))


@_op
def encoder_backward(dwte, dwpe, dout, inp, v0: int = 0) -> None:
    B, T = inp.shape
    rows, C = dwte.shape
    n, warp, runs = B * T, GEOMETRY["WARP"], -(-B * T // GEOMETRY["SORT_KEYS"])
    order = [_ws(key, n, np.int32) for key in ("emb_sorted", "emb_first", "emb_start")]
    keys = _ws("emb_keys", runs * GEOMETRY["SORT_KEYS"], np.int64)
    _launch("encoder_sort_blocks", (runs,), (GEOMETRY["SORT_KEYS"] // 2,), keys, inp, _i(n))
    _ew("encoder_rank", n, *order, keys, inp, _i(n))
    _launch("encoder_backward_wte", (n, -(-C // (warp * 16 // dwte.dtype.itemsize))), (warp,),
            dwte, dout, inp, *order, _i(C), _i(v0), _i(rows))
    _ew("encoder_backward_wpe", _row_packs(T, C, dwpe.dtype), dwpe, dout, _i(B), _i(T), _i(C))


@_op
def layernorm_backward(dinp, dw, db, dout, inp, w, mean, rstd) -> None:
    C = inp.shape[-1]
    N = inp.size // C
    R = -(-N // GEOMETRY["ROW_WARPS"])
    partial = _ws("ln_partial", R * 2 * C)
    _rows(_whole_packs("layernorm_backward", C, dinp, dout, inp, w), N, dinp, partial, dout,
          inp, w, mean, rstd, _i(N), _i(C))
    _column_sum(dw, partial, R, 2 * C, db, C)


@_op
def matmul_backward_input(dinp, dout, w) -> None:
    OC, C = w.shape
    _gemm(N_, N_, dinp.size // C, C, OC, dout, OC, w, C, dinp, C)


@_op
def matmul_backward_weight(dw, db, dout, inp) -> None:
    """dw += dout^T inp; db += dout's column sums, from the GEMM's BGRADB epilogue (it
    writes them, rounded to dw's type: a scratch added into db once, as the column sums
    would add), or the column sums' kernel where the epilogue cannot run."""
    OC, C = dw.shape
    N = inp.size // C
    g = None if db is None else _ws("bias_grad", OC, dw.dtype)
    if _gemm(T_, N_, OC, C, N, dout, OC, inp, C, dw, C, beta=1.0, bias_grad=g):
        _column_sum(db, dout, N, OC)
    elif db is not None:
        _ew("bias_grad_add", OC, db, g, _i(OC))


@_op
def attention_backward(dqkv, dout, qkv, out, lse, NH: int) -> None:
    if _attention[0] == "cudnn" and qkv.dtype == BF16:
        return _fused("backward", NH, qkv, dqkv=dqkv, do=dout, o=out, stats=lse)
    D = _ws("flash_D", lse.size)  # rowsum(dout * out): flash_dq writes it, flash_dkdv reads
    _flash("dq", qkv, NH, dqkv, D, dout, qkv, out, lse)
    _flash("dkdv", qkv, NH, dqkv, D, dout, qkv, lse)


@_op
def gelu_backward(dinp, inp, dout) -> None:
    _packed("gelu_backward", dinp, inp, dout)


# --- optimizer ---------------------------------------------------------------------------

def adamw_schedule(sched: tuple) -> None:
    """Uploads sched = (lr, 1 - beta1^t, 1 - beta2^t, t) to the device, where the adamw
    kernel reads it: a captured step reads the new values on each replay (t, the rounding
    seed's, is exact in float up to 2^24 steps)."""
    upload(_ws("sched", 4), np.array(sched, np.float32))


NORM_BLOCKS = 528  # sum_squares' most blocks: 4 per SM of an H100 (132 SMs)


@_op
def sum_squares(acc, x, offset: int = 0) -> None:
    """acc (1,) float64 += the sum of x's squares (x[0]: element `offset` of its stage's
    flat buffer), float within each 16-byte group of that buffer and float64 across them
    (reduce.cu says why), in an order fixed by x.size, so a step's norm and its clipping
    repeat exactly."""
    threads, pack = GEOMETRY["EW_THREADS"], 16 // x.dtype.itemsize
    groups = (offset % pack + x.size + pack - 1) // pack
    R = max(1, min(NORM_BLOCKS, (groups + threads - 1) // threads))
    partial = _ws("norm_partial", R, np.float64)
    start = x.data.ptr - offset % pack * x.dtype.itemsize  # its first group's, in the buffer
    _launch("sum_squares_partial_v" if start % 16 == 0 else "sum_squares_partial", (R,),
            (threads,), partial, x, np.int64(x.size), np.int64(offset))
    _launch("sum_squares_finish", (1,), (threads,), acc, partial, _i(R))


@_op
def adamw(params, grads, m, v, sched: tuple, beta1: float, beta2: float, eps: float,
          weight_decay: float, norm_sq, clip: float, master=None, salt: int = 0,
          offset: int = 0) -> None:
    if not cp.cuda.get_current_stream().is_capturing():
        adamw_schedule(sched)
    _ew("adamw", params.size, params, params if master is None else master, grads, m, v,
        np.int64(params.size), np.int64(offset), _ws("sched", 4), np.float32(beta1),
        np.float32(beta2), np.float32(eps), np.float32(weight_decay), norm_sq,
        np.float32(clip), np.uint32(salt), per_thread=16 // params.dtype.itemsize)
