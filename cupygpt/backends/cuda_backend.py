"""The CUDA backend: the NumPy reference's interface over CuPy arrays, with our kernels
(kernels_cu/, cupy.RawModule) and cuBLAS matmuls. fp32 only; TF32 is a cuBLAS math mode.

Attention keeps q, k, v and its other temporaries in backend workspaces (reused by every
layer; backward re-permutes qkv, so the interface stays the reference's). Nothing here
allocates after the first step, so a whole step can be captured as a CUDA graph.

One module, as each backend is: its public functions are the interface, and cudasim
loads this file whole against its stand-in CuPy (conftest.load_cudasim); modules imported
beside it would keep whichever CuPy they were first imported with.
"""
import functools
import math
import socket
import time

import cupy as cp
import numpy as np
from cupy_backends.cuda.libs import cublas

from .. import CupyGPTError
from ..kernels import GEOMETRY, OPTIONS, kernels_in, sources

name = "cuda"
# Capabilities (backends/__init__.py lists them)
DTYPES = (np.float32,)
TRANSPORTS = ("nvshmem", "nccl", "mpi")  # preferred first
supports_graphs = True
asynchronous = True                      # launches return before the GPU is done
DEFAULT_RUN = ("d12", 1024)              # -e, -t when not given: llm.c's GPT-2 124M run
DEFAULT_DTYPE = "fp32"                   # --dtype when not given (bf16 kernels: not yet)
# Dense (no sparsity) TF32 tensor-core peak, TFLOP/s, from NVIDIA's data sheets; the most
# specific name first.
TF32_PEAK = {"H100 SXM": 494.7, "H100 NVL": 417.5, "H100 PCIe": 378.0, "H100": 494.7,
             "H200": 494.7, "A100": 156.0, "L40S": 183.0}

CUBLAS_TF32_TENSOR_OP_MATH = 3  # cublas_api.h; CuPy's cublas module does not export it
tf32 = False
_modules, _functions, _workspace = {}, {}, {}
_trace = None     # while kernel_profile runs: {"op": current op, "ops": [...], "kernels": [...]}
_ONE, _ZERO = np.array(1.0, np.float32), np.array(0.0, np.float32)


def configure(tf32=False, device_of=None, ranks_here=1):
    """Uses GPU device_of(visible GPUs) (None: GPU 0); TF32 tensor-core matmuls on
    (training) or off (verify), on CuPy's cuBLAS handle; all work goes to one non-blocking
    stream (the legacy default stream cannot be captured into a CUDA graph)."""
    globals()["tf32"] = bool(tf32)
    cp.cuda.Device(device_of(cp.cuda.runtime.getDeviceCount()) if device_of else 0).use()
    cp.cuda.Stream(non_blocking=True).use()
    h = cp.cuda.device.get_cublas_handle()
    cublas.setPointerMode(h, cublas.CUBLAS_POINTER_MODE_HOST)
    cublas.setMathMode(h, CUBLAS_TF32_TENSOR_OP_MATH if tf32 else cublas.CUBLAS_DEFAULT_MATH)


def _k(fn):
    """A kernel by name, compiling its .cu file on first use (CuPy caches it on disk)."""
    if not _functions:
        for path in sources():
            for kernel in kernels_in(open(path).read()):
                _functions[kernel] = path
    f = _functions[fn]
    if isinstance(f, str):
        if f not in _modules:
            _modules[f] = cp.RawModule(code=open(f).read(), options=OPTIONS)
        f = _functions[fn] = _modules[f].get_function(fn)
    return f


def _launch(fn, grid, block, *args):
    if _trace is None:
        _k(fn)(grid, block, args)
    else:
        _traced(fn, _k(fn), grid, block, args)


def _timed(f, *args, **kw):
    """(start, end) CUDA events around f(*args, **kw)."""
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    f(*args, **kw)
    end.record()
    return start, end


def _traced(name, f, *args):
    _trace["kernels"].append((_trace["op"], name, *_timed(f, *args)))


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


def kernel_profile(step, steps):
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


def _ew(fn, n, *args):
    threads = GEOMETRY["EW_THREADS"]
    _launch(fn, ((n + threads - 1) // threads,), (threads,), *args)


def _rows(fn, rows, *args):
    warps = GEOMETRY["ROW_WARPS"]
    _launch(fn, ((rows + warps - 1) // warps,), (warps * GEOMETRY["WARP"],), *args)


def _ws(key, n, dtype=np.float32):
    """A workspace buffer of at least n elements of dtype, kept for the process."""
    buf = _workspace.get((key, np.dtype(dtype)))
    if buf is None or buf.size < n:
        buf = _workspace[key, np.dtype(dtype)] = cp.empty(n, dtype)
    return buf[:n]


def _gemm(ta, tb, M, N, K, A, lda, B, ldb, C, ldc, beta=0.0, batch=1, sA=0, sB=0, sC=0):
    """Row-major C (M,N) = op(A) @ op(B) + beta * C, batched with element strides.

    cuBLAS is column-major: a row-major matrix is its transpose there, so we ask for
    C^T = op(B)^T op(A)^T, i.e. swap the operands and keep each one's transpose flag.
    """
    h = cp.cuda.device.get_cublas_handle()
    cublas.setStream(h, cp.cuda.get_current_stream().ptr)
    args = (h, tb, ta, N, M, K, _ONE.ctypes.data, B.data.ptr, ldb, sB, A.data.ptr, lda, sA,
            (_ONE if beta else _ZERO).ctypes.data, C.data.ptr, ldc, sC, batch)
    if _trace is None:
        cublas.sgemmStridedBatched(*args)
    else:
        name = f"sgemm_{'NT'[ta]}{'NT'[tb]} {M}x{N}x{K}" + (f"x{batch}" if batch > 1 else "")
        _traced(name, cublas.sgemmStridedBatched, *args)


N_, T_ = 0, 1  # cuBLAS operation flags: no transpose, transpose


def _i(x):
    return np.int32(x)


# --- memory ------------------------------------------------------------------------------

def zeros(n, dtype=np.float32):
    try:
        return cp.zeros(n, dtype)
    except cp.cuda.memory.OutOfMemoryError:
        free, total = cp.cuda.runtime.memGetInfo()
        raise CupyGPTError(f"out of GPU memory allocating {n * np.dtype(dtype).itemsize / 2**30:.2f} "
                           f"GiB ({free / 2**30:.2f} GiB free of {total / 2**30:.2f}); lower the batch "
                           f"size or sequence length, or use more pipeline stages") from None


# Copies name the stream: before CuPy 14 a copy without one went through the legacy
# default stream, which does not wait for work on our non-blocking stream.

def upload(dst, host):
    """Copies a host array into an existing device array (no allocation), in stream order."""
    dst.set(np.ascontiguousarray(host, dtype=dst.dtype), stream=cp.cuda.get_current_stream())


def to_host(a):
    """A host copy of a, once the work queued before it has finished."""
    stream = cp.cuda.get_current_stream()
    out = a.get(stream=stream)
    stream.synchronize()
    return out


def synchronize():
    cp.cuda.get_current_stream().synchronize()


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


def stamp_seconds(marks):
    """Host-clock seconds of recorded events: the origin's host time plus GPU elapsed."""
    synchronize()
    e0, h0 = _origin[0]
    return [h0 + cp.cuda.get_elapsed_time(e0, m) / 1e3 for m in marks]


def capture(fn):
    """Records fn's launches on the current stream as a CUDA graph (nothing runs yet).
    cuBLAS needs no workspace set for this: since CUDA 12.2 it takes its workspace with
    cudaMallocAsync, which the capture records; and a step is captured only once."""
    stream = cp.cuda.get_current_stream()
    stream.begin_capture()
    try:
        fn()
    finally:
        graph = stream.end_capture()
    return graph


def replay(graph):
    graph.launch(cp.cuda.get_current_stream())


def memory_in_use():
    return cp.get_default_memory_pool().total_bytes()


def device_memory():
    """Free device memory, bytes (the driver's free plus what CuPy's pool holds unused)."""
    return cp.cuda.runtime.memGetInfo()[0] + cp.get_default_memory_pool().free_bytes()


memory_name = "the GPU"


def workspace_bytes(cfg, batch, seq, part, dtype):
    """The most the kept workspaces (_ws) reach for a stage holding part, micro-batches of
    batch x seq: attention's q, k, v, y and their gradients (B, T, C/tp each), layernorm
    backward's (B, T, C), the column sums' partials (up to 128 rows of 4C/tp) and the
    norm's."""
    n = batch * seq * cfg.C
    return (8 * n // part.tp + n + 128 * 4 * cfg.C // part.tp + NORM_BLOCKS) * \
        np.dtype(dtype).itemsize


def memory_domain():
    """What ranks with the same answer allocate from: this rank's GPU, by its PCI bus id
    (a device index counts only the GPUs this process is shown)."""
    return socket.gethostname(), cp.cuda.Device().pci_bus_id


def numerics():
    """Which arithmetic this is, for verify's tolerances."""
    return "cuda-tf32" if tf32 else "cuda"


def device_info():
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    return {"device": props["name"].decode(), "backend": name, "cupy": cp.__version__,
            "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(),
            "driver": cp.cuda.runtime.driverGetVersion()}


def peak_flops(dtype="fp32"):
    """This GPU's dense TF32 peak FLOP/s (MFU's yardstick), None if not in the table (no
    bf16 run yet: DTYPES)."""
    dev = device_info()["device"]
    return next((v * 1e12 for key, v in TF32_PEAK.items() if key in dev), None)


def all_finite(a):
    return bool(to_host(cp.isfinite(a).all()))


# --- forward -----------------------------------------------------------------------------

@_op
def encoder_forward(out, inp, wte, wpe, v0=0):
    B, T = inp.shape
    rows, C = wte.shape
    _ew("encoder_forward", B * T * C, out, inp, wte, wte if wpe is None else wpe, _i(B),
        _i(T), _i(C), _i(v0), _i(rows), _i(wpe is not None))


@_op
def layernorm_forward(out, mean, rstd, inp, w, b):
    C = inp.shape[-1]
    N = inp.size // C
    _rows("layernorm_forward", N, out, mean, rstd, inp, w, b, _i(N), _i(C))


@_op
def matmul_forward(out, inp, w, bias):
    OC, C = w.shape
    N = inp.size // C
    _gemm(N_, T_, N, OC, C, inp, C, w, C, out, OC)
    if bias is not None:
        _ew("add_bias", N * OC, out, bias, np.int64(N * OC), _i(OC))


def _qkv_split(qkv, NH):
    B, T, C3 = qkv.shape
    C = C3 // 3
    n = B * T * C
    q, k, v = (_ws(key, n) for key in ("q", "k", "v"))
    _ew("permute_qkv", n, q, k, v, qkv, _i(B), _i(T), _i(NH), _i(C // NH))
    return B, T, C, C // NH, q, k, v


@_op
def attention_forward(out, preatt, att, qkv, NH):
    B, T, C, HS, q, k, v = _qkv_split(qkv, NH)
    BH = B * NH
    _gemm(N_, T_, T, T, HS, q, HS, k, HS, preatt, T, batch=BH, sA=T * HS, sB=T * HS, sC=T * T)
    _rows("softmax_forward", BH * T, att, preatt, np.float32(1.0 / math.sqrt(HS)), _i(BH * T),
          _i(T))
    y = _ws("y", B * T * C)
    _gemm(N_, N_, T, HS, T, att, T, v, HS, y, HS, batch=BH, sA=T * T, sB=T * HS, sC=T * HS)
    _ew("unpermute", B * T * C, out, y, _i(B), _i(T), _i(NH), _i(HS))


@_op
def attention_decode(out, qkv, NH):
    """Generation's step: the attention of the last of n positions over all n. qkv (1,n,3C)
    holds every earlier position's q, k, v (the KV cache) and the new one's; out (1,1,C)."""
    _, n, C, HS, q, k, v = _qkv_split(qkv, NH)
    scores, att = _ws("dec_scores", NH * n), _ws("dec_att", NH * n)
    # per head: the last query row (1, HS) @ k^T (HS, n); heads are n*HS apart in q, k, v
    _gemm(N_, T_, 1, n, HS, q[(n - 1) * HS:], HS, k, HS, scores, n, batch=NH, sA=n * HS,
          sB=n * HS, sC=n)
    _rows("softmax_decode", NH, att, scores, np.float32(1.0 / math.sqrt(HS)), _i(NH), _i(n))
    # (1, n) @ v (n, HS) per head, straight into out: for one position (NH, HS) is (C,)
    _gemm(N_, N_, 1, HS, n, att, n, v, HS, out, HS, batch=NH, sA=n, sB=n * HS, sC=HS)


@_op
def gelu_forward(out, inp):
    _ew("gelu_forward", inp.size, out, inp, np.int64(inp.size))


@_op
def residual_forward(out, a, b):
    _ew("residual_forward", a.size, out, a, b, np.int64(a.size))


@_op
def classifier_stats(stats, logits, targets, v0, valid):
    Vs = logits.shape[-1]
    _launch("classifier_stats", (logits.size // Vs,), (GEOMETRY["CLS_THREADS"],), stats, logits,
            targets, _i(v0), _i(valid), _i(Vs))


@_op
def classifier(logits, losses, stats, targets, v0, valid, dloss=None):
    Vs = logits.shape[-1]
    N = logits.size // Vs
    _launch("classifier", (N,), (GEOMETRY["CLS_THREADS"],), logits, losses, stats, targets,
            np.float32(dloss or 0.0), _i(dloss is not None), _i(v0), _i(valid), _i(Vs),
            _i(stats.shape[0]), _i(N))


@_op
def loss_accumulate(acc, losses):
    """acc (1,) float64 += sum of losses, on the device (no sync; graph-safe)."""
    _launch("loss_accumulate", (1,), (GEOMETRY["CLS_THREADS"],), acc, losses, _i(losses.size))


# --- backward ----------------------------------------------------------------------------

def _column_sum(out, inp, N, OC):
    """out (OC) += column sums of inp (N, OC), deterministically in two stages."""
    R = max(1, min(128, N // 64))
    per = (N + R - 1) // R
    partial = _ws("colsum", R * OC)
    tile, lanes = GEOMETRY["COL_TILE"], GEOMETRY["ROW_LANES"]
    _launch("column_sum_partial", ((OC + tile - 1) // tile, R), (tile, lanes), partial, inp,
            _i(N), _i(OC), _i(per))
    _ew("column_sum_finish", OC, out, partial, _i(R), _i(OC))


@_op
def encoder_backward(dwte, dwpe, dout, inp, v0=0):
    B, T = inp.shape
    rows, C = dwte.shape
    _ew("encoder_backward_wte", B * T * C, dwte, dout, inp, _i(B), _i(T), _i(C), _i(v0),
        _i(rows))
    _ew("encoder_backward_wpe", T * C, dwpe, dout, _i(B), _i(T), _i(C))


@_op
def layernorm_backward(dinp, dw, db, dout, inp, w, mean, rstd):
    C = inp.shape[-1]
    N = inp.size // C
    dnorm = _ws("dnorm", N * C)
    _rows("layernorm_backward", N, dinp, dnorm, dout, inp, w, mean, rstd, _i(N), _i(C))
    _column_sum(dw, dnorm, N, C)
    _column_sum(db, dout, N, C)


@_op
def matmul_backward_input(dinp, dout, w):
    OC, C = w.shape
    _gemm(N_, N_, dinp.size // C, C, OC, dout, OC, w, C, dinp, C)


@_op
def matmul_backward_weight(dw, db, dout, inp):
    OC, C = dw.shape
    N = inp.size // C
    _gemm(T_, N_, OC, C, N, dout, OC, inp, C, dw, C, beta=1.0)
    if db is not None:
        _column_sum(db, dout, N, OC)


@_op
def attention_backward(dqkv, dpreatt, datt, dout, qkv, att, NH):
    B, T, C, HS, q, k, v = _qkv_split(qkv, NH)
    BH, n = B * NH, B * T * C
    dy, dq, dk, dv = (_ws(key, n) for key in ("dy", "dq", "dk", "dv"))
    _ew("unpermute_backward", n, dy, dout, _i(B), _i(T), _i(NH), _i(HS))
    _gemm(N_, T_, T, T, HS, dy, HS, v, HS, datt, T, batch=BH, sA=T * HS, sB=T * HS, sC=T * T)
    _gemm(T_, N_, T, HS, T, att, T, dy, HS, dv, HS, batch=BH, sA=T * T, sB=T * HS, sC=T * HS)
    _rows("softmax_backward", BH * T, dpreatt, datt, att, np.float32(1.0 / math.sqrt(HS)),
          _i(BH * T), _i(T))
    _gemm(N_, N_, T, HS, T, dpreatt, T, k, HS, dq, HS, batch=BH, sA=T * T, sB=T * HS, sC=T * HS)
    _gemm(T_, N_, T, HS, T, dpreatt, T, q, HS, dk, HS, batch=BH, sA=T * T, sB=T * HS, sC=T * HS)
    _ew("permute_qkv_backward", n, dqkv, dq, dk, dv, _i(B), _i(T), _i(NH), _i(HS))


@_op
def gelu_backward(dinp, inp, dout):
    _ew("gelu_backward", inp.size, dinp, inp, dout, np.int64(inp.size))


# --- optimizer ---------------------------------------------------------------------------

def adamw_schedule(sched):
    """Uploads sched = (lr, 1 - beta1^t, 1 - beta2^t, t) to the device, where the adamw
    kernel reads it: a captured step reads the new values on each replay."""
    upload(_ws("sched", 4), np.array(sched, np.float32))


NORM_BLOCKS = 128  # sum_squares' partial sums: a fixed count, so the order is too


@_op
def sum_squares(acc, x):
    """acc (1,) float64 += the sum of x's squares, in double, in two deterministic stages
    (a step's norm, and so its clipping, repeats exactly)."""
    threads = GEOMETRY["EW_THREADS"]
    R = max(1, min(NORM_BLOCKS, (x.size + threads - 1) // threads))
    partial = _ws("norm_partial", R, np.float64)
    _launch("sum_squares_partial", (R,), (threads,), partial, x, np.int64(x.size))
    _launch("sum_squares_finish", (1,), (1,), acc, partial, _i(R))


@_op
def adamw(params, grads, m, v, sched, beta1, beta2, eps, weight_decay, norm_sq, clip,
          master=None, salt=0, offset=0):
    """(DTYPES has no bf16 yet: master, salt and offset, a bf16 run's, are never given.)"""
    if not cp.cuda.get_current_stream().is_capturing():
        adamw_schedule(sched)
    _ew("adamw", params.size, params, grads, m, v, np.int64(params.size), _ws("sched", 4),
        np.float32(beta1), np.float32(beta2), np.float32(eps), np.float32(weight_decay),
        norm_sq, np.float32(clip))
