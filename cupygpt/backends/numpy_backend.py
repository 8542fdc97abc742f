"""The reference backend: every op vectorized over B, T and C; float32, float64, or bf16
with llm.c's mixed-precision semantics (precision.py): an op on bf16 arrays reads them into
float32, computes there and rounds each output once, where a CUDA kernel stores it.

One module, as each backend is: its public functions are the interface
(backends/__init__.py), read against cuda_backend.py's function by function.
"""
from __future__ import annotations

import functools
import inspect
import math
import os
import socket
import time
from collections.abc import Callable

import numpy as np
from numpy.typing import DTypeLike

from . import host_memory
from ..model.layout import Part, logit_rows
from ..precision import BF16, step_seed, stochastic_round, wide
from ..model.shape import GPT2Config

name = "numpy"
# Capabilities (backends/__init__.py lists them)
DTYPES = (np.float32, np.float64, BF16)
DEFAULT_DTYPE = "fp32"           # --dtype when not given
TRANSPORTS = ("mpi",)            # host arrays travel by MPI
supports_graphs = False
asynchronous = False             # an op returns when its work is done
DEFAULT_RUN = ("tiny", 64)       # -e, -t when not given: a model that trains in seconds
threads = None                   # BLAS threads of this process, set by configure()
# Overflow shows up as a non-finite loss, which the training loop reports in one line.
np.seterr(over="ignore", invalid="ignore")
GELU_SCALE = math.sqrt(2.0 / math.pi)
LN_EPS = 1e-5


# --- memory ------------------------------------------------------------------------------

def zeros(n: int, dtype: DTypeLike = np.float32):
    return np.zeros(n, dtype=dtype)


def to_host(a) -> np.ndarray:
    return np.asarray(a)


def upload(dst, host: np.ndarray) -> None:
    """Copies host into the existing array dst (casting to its dtype)."""
    dst[...] = host


def synchronize() -> None:
    pass


def bound_host_waits(wait: Callable) -> None:
    """The host never waits for a device here."""


def memory_in_use() -> int:
    """Peak resident memory of this process, bytes."""
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def all_finite(a) -> bool:
    return bool(np.isfinite(a).all())


def device_memory() -> int | None:
    """Free memory where this backend allocates (the host's), bytes."""
    return host_memory.available()


memory_name = "this host's memory"


def workspace_bytes(shape: GPT2Config, batch: int, seq: int, part: Part, dtype: DTypeLike) -> int:
    """The most the kept scratch arrays (_ws) reach for a stage holding part, micro-batches
    of batch x seq: GELU's two (B, T, 4C/tp), the classifier's exponentials (a chunk of
    the head's logits) and AdamW's three chunks (two, and the clipped gradient's)."""
    n = 2 * batch * seq * 4 * shape.C // part.tp if part.l1 > part.l0 else 0
    vr = part.vocab(shape)[1]
    n += logit_rows(batch * seq, vr) * vr if part.head else 0
    return (n + 3 * ADAM_CHUNK) * np.dtype(dtype).itemsize


def fallbacks() -> list:
    """Nothing here runs a slower way than planned."""
    return []


def attention_refuses(head_size: int, dtype: DTypeLike | None = None) -> str | None:
    """Why this backend cannot run attention heads of head_size (in dtype), or None: it runs
    any."""
    return None


def fused_attention_refuses(dtype: DTypeLike, head_size: int) -> str | None:
    """Why a fused library attention cannot run here: the CPU has none (cuDNN is a GPU's)."""
    return "the numpy backend has no cuDNN (a GPU library): it runs with --backend cuda"


def use_attention(kind: str, backward: bool = True, replay: bool = False) -> None:
    """Which attention the model's attention ops take: this backend's own, the only one
    (backward, replay: what the run asks of it; the own ops need nothing prepared)."""
    if kind != "own":
        raise ValueError(f"attention {kind!r}: the numpy backend runs its own only")


def memory_domain() -> str:
    """What ranks with the same answer allocate from: this host's memory."""
    return socket.gethostname()


def device_name() -> str:
    """The run table's name of the device this rank computes on."""
    return "the CPU"


def configure(tf32: bool = False, device_of: Callable | None = None, ranks_here: int = 1) -> None:
    """BLAS threads: this rank's share of the machine's cores (ranks_here processes share
    them), at least one. More threads than cores in total is ruinous: a small matmul on two
    busy cores ran 25x slower with two threads than with one. No TF32 on the CPU."""
    from threadpoolctl import threadpool_limits
    global threads
    threads = max(1, len(os.sched_getaffinity(0)) // ranks_here)
    threadpool_limits(threads, user_api="blas")


def numerics() -> str:
    """Which arithmetic this is, for verify's tolerances."""
    return "numpy"


def peak_flops(dtype: str = "fp32") -> float | None:
    """The device's dense peak FLOP/s for MFU; None: not meaningful for a CPU here."""
    return None


def device_info() -> dict:
    import platform
    return {"device": platform.processor() or platform.machine(), "backend": name,
            "blas_threads": threads}


def stamp():
    """A mark of this moment in the work's order (--trace); the CPU's is its clock."""
    return time.perf_counter()


def stamp_seconds(marks: list) -> list[float]:
    """Host-clock seconds (time.perf_counter's, the same clock in every process) of marks."""
    return list(marks)


_trace = None  # {op: seconds} while kernel_profile runs
_narrow = False  # inside an op on bf16 arrays: its stored intermediates round (_stored)


def _op(*writes, mixed=True):
    """A public op writing the arrays named `writes` (accumulating into some). On bf16
    arrays it runs on float32 copies and rounds each written one back once (the inputs are
    exact in float32), unless not `mixed` (it rounds for itself); under kernel_profile its
    wall time is added to its name's."""
    def wrap(fn):
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def op(*args, **kw):
            t0 = time.perf_counter()
            if mixed and any(getattr(a, "dtype", None) == BF16 for a in (*args, *kw.values())):
                _mixed(fn, sig.bind(*args, **kw), writes)  # (fp32 calls skip the binding)
            else:
                fn(*args, **kw)
            if _trace is not None:
                _trace[fn.__name__] = _trace.get(fn.__name__, 0.0) + time.perf_counter() - t0
        return op
    return wrap


def _mixed(fn, bound, writes):
    global _narrow
    narrow = {k: a for k, a in bound.arguments.items()
              if isinstance(a, np.ndarray) and a.dtype == BF16}
    for k, a in narrow.items():
        bound.arguments[k] = a.astype(np.float32)
    _narrow = True
    try:
        fn(*bound.args, **bound.kwargs)
    finally:
        _narrow = False
    for k in writes:
        if k in narrow:
            narrow[k][...] = bound.arguments[k]


def _stored(x):
    """x goes through memory in the run's dtype here (a kernel stores it, the next reads
    it): inside a bf16 op it is rounded to bf16 in place."""
    if _narrow:
        x[...] = x.astype(BF16)


def kernel_profile(step: Callable, steps: int) -> tuple[list, list] | None:
    """Where the time of `steps` calls of step() goes: per op (wall time; the CPU computes
    synchronously), and "(rest)" for what is outside every op (Python, the transport,
    slicing). Returns (per_op, per_kernel); the CPU has no kernels, so per_kernel is []."""
    global _trace
    _trace = {}
    t0 = time.perf_counter()
    try:
        for _ in range(steps):
            step()
        whole, ops = time.perf_counter() - t0, _trace
    finally:
        _trace = None
    ops["(rest)"] = max(0.0, whole - sum(ops.values()))
    return ([{"op": op, "ms_per_step": 1e3 * t / steps, "share": t / whole}
             for op, t in sorted(ops.items(), key=lambda kv: -kv[1])], [])


def _rows(a):
    return a.reshape(-1, a.shape[-1])


_scratch = {}


def _ws(key, shape, dtype):
    """A scratch array kept between calls: the large elementwise ops write their
    temporaries here instead of allocating (and page-faulting) fresh ones every step."""
    n, a = math.prod(shape), _scratch.get(key)
    if a is None or a.size < n or a.dtype != dtype:  # grows to the largest asked for
        a = _scratch[key] = np.empty(n, dtype)
    return a[:n].reshape(shape)


# --- forward -----------------------------------------------------------------------------

def _held(inp, v0, rows):
    """Token ids as rows of a vocab shard holding [v0, v0 + rows), and which it holds."""
    r = inp - v0
    held = (r >= 0) & (r < rows)
    return np.where(held, r, 0), held


@_op("out")
def encoder_forward(out, inp, wte, wpe, v0: int = 0) -> None:
    """out (B,T,C) = wte[inp] + wpe[:T]; inp (B,T) int32. wte holds vocab rows v0.. (a
    tensor-parallel shard): tokens it does not hold get zeros; wpe None: no positions."""
    r, held = _held(inp, v0, wte.shape[0])
    x = wte[r] if held.all() else np.where(held[..., None], wte[r], 0)
    if wpe is None:
        out[...] = x
    else:
        np.add(x, wpe[: inp.shape[1]], out=out)


@_op("out", "mean", "rstd")
def layernorm_forward(out, mean, rstd, inp, w, b) -> None:
    """out (B,T,C); mean, rstd (B,T) saved for backward."""
    mean[...] = inp.mean(-1)
    xc = inp - mean[..., None]
    rstd[...] = 1.0 / np.sqrt((xc * xc).mean(-1) + LN_EPS)
    np.multiply(xc * rstd[..., None], w, out=out)
    out += b


@_op("out")
def matmul_forward(out, inp, w, bias=None) -> None:
    """out (B,T,OC) = inp (B,T,C) @ w (OC,C)^T (+ bias (OC)), the sum rounded once to out's
    type (the CUDA backend's GEMM epilogue adds the bias before it stores)."""
    np.matmul(_rows(inp), w.T, out=_rows(out))
    if bias is not None:
        out += bias


# Attention goes by blocks of ATT_ROWS queries, as flash attention does (no (T, T) tensor
# is kept; a block's scores against the keys it sees are the only temporary): forward keeps
# each row's log-sum-exp, backward makes the probabilities again from it.
ATT_ROWS = 128


def _heads(x, B, T, NH):
    """(B, T, NH*HS) -> the (B, NH, T, HS) view."""
    return x.reshape(B, T, NH, -1).transpose(0, 2, 1, 3)


def _qkv(qkv, NH):
    B, T, C3 = qkv.shape
    return (_heads(qkv.reshape(B, T, 3, C3 // 3)[:, :, i], B, T, NH) for i in range(3))


def _scores(q, k, t0, t1, scale):
    """The scaled scores of queries [t0, t1) over keys [0, t1) (B, NH, t1 - t0, t1);
    causal: -inf after the query's own position."""
    s = q[:, :, t0:t1] @ k[:, :, :t1].transpose(0, 1, 3, 2)
    s *= scale
    s[..., np.triu(np.ones((t1 - t0, t1), bool), t0 + 1)] = -np.inf
    return s


def _probs(q, k, lse, t0, t1, scale):
    """Backward's probabilities of those queries made again: exp(score - lse)."""
    s = _scores(q, k, t0, t1, scale)
    s -= lse[:, :, t0:t1, None]
    return np.exp(s, out=s)


@_op("out", "lse")
def attention_forward(out, lse, qkv, NH: int) -> None:
    """Causal self-attention. qkv (B,T,3C), its bias in -> out (B,T,C); lse (B,NH,T)
    float: each query row's log of its sum of exp(scores), all backward keeps."""
    B, T, C3 = qkv.shape
    q, k, v = _qkv(qkv, NH)
    scale = 1.0 / math.sqrt(q.shape[-1])
    y = _heads(out, B, T, NH)
    for t0 in range(0, T, ATT_ROWS):
        t1 = min(T, t0 + ATT_ROWS)
        s = _scores(q, k, t0, t1, scale)
        m = s.max(-1, keepdims=True)
        p = np.exp(s - m, out=s)
        total = p.sum(-1, keepdims=True)
        lse[:, :, t0:t1] = (m + np.log(total))[..., 0]
        p /= total
        _stored(p)  # the next matmul's input
        y[:, :, t0:t1] = p @ v[:, :, :t1]


@_op("out")
def attention_decode(out, qkv, NH: int) -> None:
    """Generation's step: the attention of the last of n positions over all n. qkv (1,n,3C)
    holds every earlier position's q, k, v (the KV cache) and the new one's; out (1,1,C)."""
    _, n, C3 = qkv.shape
    HS = C3 // 3 // NH
    x = qkv.reshape(n, 3, NH, HS)
    q, k, v = x[-1, 0][:, None, :], x[:, 1].transpose(1, 2, 0), x[:, 2].transpose(1, 0, 2)
    s = (q @ k) * (1.0 / math.sqrt(HS))       # (NH, 1, n)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    _stored(p)                                # the next matmul's input
    out.reshape(NH, HS)[...] = (p @ v)[:, 0]  # (NH, 1, HS)


@_op("out")
def gelu_forward(out, inp) -> None:
    """tanh approximation, as GPT-2: 0.5 x (1 + tanh(s (x + 0.044715 x^3))), s = sqrt(2/pi).
    x^3 is x*x*x: NumPy's float32 power is ~250x slower than two multiplies."""
    t = _gelu_tanh(inp)
    t += 1.0
    np.multiply(inp, 0.5, out=out)
    out *= t


def _gelu_tanh(inp):
    """tanh(s (x + 0.044715 x^3)) in the scratch "gelu_t"."""
    t = _ws("gelu_t", inp.shape, inp.dtype)
    np.multiply(inp, inp, out=t)
    t *= inp
    t *= 0.044715
    t += inp
    t *= GELU_SCALE
    return np.tanh(t, out=t)


@_op("out")
def residual_forward(out, a, b) -> None:
    """out = a + b."""
    np.add(a, b, out=out)


def residual_layernorm_forward(res, a, b, out, mean, rstd, w, lnb) -> None:
    """res = a + b, stored; out, mean, rstd: the layernorm of res as stored. The CUDA
    kernel fuses the two; here they are the two ops (and profile as such)."""
    residual_forward(res, a, b)
    layernorm_forward(out, mean, rstd, res, w, lnb)


@_op("stats")
def classifier_stats(stats, logits, targets, v0: int, valid: int) -> None:
    """Per position, over this vocab shard's first `valid` logits (its real tokens):
    stats (B,T,3) = max, sum of exp(logit - max), and the target's logit when the shard
    holds the target (0 elsewhere)."""
    if valid == 0:
        stats[...] = (-np.inf, 0, 0)
        return
    lg = logits[..., :valid]
    mx = lg.max(-1, keepdims=True)
    stats[..., 0] = mx[..., 0]
    e = _ws("cls_e", lg.shape, lg.dtype)
    np.subtract(lg, mx, out=e)
    np.exp(e, out=e)
    stats[..., 1] = e.sum(-1)
    r, held = _held(targets, v0, valid)
    stats[..., 2] = np.where(held, np.take_along_axis(lg, r[..., None], -1)[..., 0], 0)


@_op("logits", "losses")
def classifier(logits, losses, stats, targets, v0: int, valid: int,
               dloss: float | None = None) -> None:
    """Softmax + cross-entropy from every vocab shard's stats (tp,B,T,3), combined in shard
    order: max M, sum S = sum of s * exp(m - M), target logit t; losses (B,T) = log S + M - t.

    With dloss (the loss gradient each position gets, 1/(B*T) for a mean), this shard's
    logits are overwritten in place by dlogits, zero over its padding columns.
    """
    m, s, t = stats[..., 0], stats[..., 1], stats[..., 2]
    M = m.max(0)
    S, tgt = s[0] * np.exp(m[0] - M), t[0].copy()
    for k in range(1, len(stats)):
        S += s[k] * np.exp(m[k] - M)
        tgt += t[k]
    losses[...] = np.log(S) + M - tgt
    if dloss is not None and valid:
        lg = logits[..., :valid]
        np.subtract(lg, M[..., None], out=lg)
        np.exp(lg, out=lg)
        lg /= S[..., None]
        r, held = _held(targets, v0, valid)
        np.put_along_axis(lg, r[..., None], np.take_along_axis(lg, r[..., None], -1)
                          - held[..., None], -1)
        lg *= dloss
    if dloss is not None:
        logits[..., valid:] = 0


def cross_entropy(logits, losses, targets, valid: int, dloss: float | None = None) -> None:
    """classifier_stats and classifier for a head holding the whole vocab (no tensor
    parallelism: nothing to gather between them), which the CUDA kernel fuses; here they
    are the two ops (and profile as such)."""
    stats = _ws("ce_stats", (1, *targets.shape, 3), wide(logits.dtype))
    classifier_stats(stats[0], logits, targets, 0, valid)
    classifier(logits, losses, stats, targets, 0, valid, dloss)


@_op("acc")
def loss_accumulate(acc, losses) -> None:
    """acc (1,) float64 += sum of losses."""
    acc += losses.sum(dtype=np.float64)


# --- backward ----------------------------------------------------------------------------

@_op("dwte", "dwpe")
def encoder_backward(dwte, dwpe, dout, inp, v0: int = 0) -> None:
    """dwte[inp] += dout (for the tokens this vocab shard holds); dwpe[:T] += dout summed
    over B."""
    r, held = _held(inp, v0, dwte.shape[0])
    np.add.at(dwte, r[held], dout[held])
    dwpe[: inp.shape[1]] += dout.sum(0)


@_op("dinp", "dw", "db")
def layernorm_backward(dinp, dw, db, dout, inp, w, mean, rstd) -> None:
    norm = (inp - mean[..., None]) * rstd[..., None]
    dnorm = dout * w
    dinp += (dnorm - dnorm.mean(-1, keepdims=True)
             - norm * (dnorm * norm).mean(-1, keepdims=True)) * rstd[..., None]
    dw += _rows(dout * norm).sum(0)
    db += _rows(dout).sum(0)


@_op("dinp")
def matmul_backward_input(dinp, dout, w) -> None:
    """dinp (B,T,C) = dout (B,T,OC) @ w (OC,C): the input gradient (zero-bubble's B)."""
    np.matmul(_rows(dout), w, out=_rows(dinp))


@_op("dw", "db")
def matmul_backward_weight(dw, db, dout, inp) -> None:
    """dw (OC,C) += dout^T @ inp; db (OC) += sum of dout rows (zero-bubble's W: off the
    critical path, so a schedule may defer it)."""
    d2 = _rows(dout)
    dw += d2.T @ _rows(inp)
    if db is not None:
        db += d2.sum(0)


@_op("dqkv")
def attention_backward(dqkv, dout, qkv, out, lse, NH: int) -> None:
    """dqkv (B,T,3C) from dout (B,T,C), with forward's out and lse: each block's
    probabilities made again, D = rowsum(dout * out) in place of the sum over keys."""
    B, T, C3 = qkv.shape
    q, k, v = _qkv(qkv, NH)
    dq, dk, dv = _qkv(dqkv, NH)
    scale = 1.0 / math.sqrt(q.shape[-1])
    do = _heads(dout, B, T, NH)
    D = (do * _heads(out, B, T, NH)).sum(-1)
    dk[...], dv[...] = 0, 0
    for t0 in range(0, T, ATT_ROWS):
        t1 = min(T, t0 + ATT_ROWS)
        p = _probs(q, k, lse, t0, t1, scale)
        ds = do[:, :, t0:t1] @ v[:, :, :t1].transpose(0, 1, 3, 2)
        ds -= D[:, :, t0:t1, None]
        ds *= p
        ds *= scale
        _stored(ds)  # the next matmuls' input, as p is dv's
        _stored(p)
        dv[:, :, :t1] += p.transpose(0, 1, 3, 2) @ do[:, :, t0:t1]
        dq[:, :, t0:t1] = ds @ k[:, :, :t1]
        dk[:, :, :t1] += ds.transpose(0, 1, 3, 2) @ q[:, :, t0:t1]


@_op("dinp")
def gelu_backward(dinp, inp, dout) -> None:
    """dinp = dout * d/dx gelu(x), with th = tanh(s (x + 0.044715 x^3)):
    0.5 (1 + th) + 0.5 x (1 - th^2) s (1 + 3 * 0.044715 x^2); in place in two scratches."""
    t, a = _gelu_tanh(inp), _ws("gelu_a", inp.shape, inp.dtype)
    np.add(t, 1.0, out=a)
    a *= 0.5                       # 0.5 (1 + th)
    t *= t
    np.subtract(1.0, t, out=t)     # 1 - th^2
    np.multiply(inp, 0.5, out=dinp)
    dinp *= t
    dinp *= GELU_SCALE
    np.multiply(inp, 3 * 0.044715, out=t)
    t *= inp
    t += 1.0
    dinp *= t
    dinp += a
    dinp *= dout


# --- optimizer ---------------------------------------------------------------------------

@_op(mixed=False)
def sum_squares(acc, x, offset: int = 0) -> None:
    """acc (1,) += the sum of x's squares (the global gradient norm's share of x; x[0] is
    element `offset` of its stage's flat buffer), as the CUDA kernel sums them: squares
    added in x's wide type (float for fp32 and bf16) within each group of 16 bytes of that
    buffer, in element order, and the groups' sums in float64. Each group's float sum is
    the same whichever ranks' slices hold the group (only a group a slice boundary cuts is
    summed in two parts), and float64 sums in another order move the float norm only on a
    tie within 1e-16 of it: so ZeRO-1's norm is the unsharded one, bit for bit."""
    pack, w = 16 // x.dtype.itemsize, wide(x.dtype)
    lead = offset % pack
    step = ADAM_CHUNK - ADAM_CHUNK % pack  # (chunks of whole groups)
    for a in range(-lead, x.size, step):
        c = np.zeros(step, w)
        part = x[max(a, 0):a + step]
        c[max(a, 0) - a:max(a, 0) - a + part.size] = part
        sq = (c * c).reshape(-1, pack)
        s = sq[:, 0].copy()
        for k in range(1, pack):  # in element order, as the kernel
            s += sq[:, k]
        acc += s.sum(dtype=np.float64)


def _grad_scale(norm_sq, clip, dtype):
    """The gradient's factor: clip / norm when the global norm is above clip (> 0), in
    dtype's wide type as the CUDA kernel computes it (norm_sq: float64); None for 1."""
    norm = wide(dtype).type(np.sqrt(norm_sq[0]))
    return norm.dtype.type(clip) / norm if clip and norm > clip else None


@_op(mixed=False)
def adamw(params, grads, m, v, sched: tuple, beta1: float, beta2: float, eps: float,
          weight_decay: float, norm_sq, clip: float, master=None, salt: int = 0,
          offset: int = 0) -> None:
    """llm.c's AdamW over a whole flat buffer: bias-corrected moments, decoupled decay;
    sched = (lr, 1 - beta1^t, 1 - beta2^t, t); the gradient clipped at global norm clip
    (norm_sq (1,): the norm squared; clip 0: never). With master (a bf16 run's fp32 master
    weights of params) the update is made there and params[i] becomes it stochastically
    rounded with the noise of element offset + i and this step's seed (salt: the stage's)."""
    scale = _grad_scale(norm_sq, clip, params.dtype)
    seed = None if master is None else step_seed(int(sched[3]), salt)
    for a in range(0, params.size, ADAM_CHUNK):  # elementwise: chunks change no bit
        b = a + ADAM_CHUNK
        w = params[a:b] if master is None else master[a:b]
        _adamw(w, grads[a:b], m[a:b], v[a:b], sched, beta1, beta2, eps, weight_decay, scale)
        if master is not None:
            params[a:b] = stochastic_round(w, seed, offset + a)


ADAM_CHUNK = 1 << 20  # 4 MiB of fp32: two scratches this size instead of the model's size


def _adamw(params, grads, m, v, sched, beta1, beta2, eps, weight_decay, scale):
    lr, bc1, bc2 = sched[:3]
    t, u = _ws("adam_t", params.shape, params.dtype), _ws("adam_u", params.shape, params.dtype)
    if scale is not None or grads.dtype != params.dtype:  # (bf16 gradients: widened)
        g = _ws("adam_g", params.shape, params.dtype)
        g[...] = grads
        grads = g if scale is None else np.multiply(g, scale, out=g)
    m *= beta1
    np.multiply(grads, 1.0 - beta1, out=t)
    m += t
    v *= beta2
    np.multiply(grads, 1.0 - beta2, out=t)
    t *= grads
    v += t
    np.divide(v, bc2, out=t)
    np.sqrt(t, out=t)
    t += eps
    np.divide(m, bc1, out=u)
    u /= t                         # mhat / (sqrt(vhat) + eps)
    np.multiply(params, weight_decay, out=t)
    u += t
    u *= lr
    params -= u
