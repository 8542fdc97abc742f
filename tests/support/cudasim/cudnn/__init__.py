"""cudasim's cudnn (nvidia-cudnn-frontend 1.32's graph API): the part the CUDA backend's
fused attention uses (cupygpt/backends/cuda/cudnn.py), computed by NumPy from the
very pointers, dims and strides it declares, on cudasim's device memory and streams.

Installed state: CUDASIM_CUDNN picks what this machine pretends to have installed:
- unset: the frontend without the cuDNN library (backend_version() fails as the real
  frontend's does when libcudnn is missing), so runs that do not ask for cuDNN keep the
  project's own attention kernels;
- "1": the frontend and the library, of version LIBRARY_VERSION;
- "unsupported": as "1", but build_plans finds no engine for any graph (raises
  cudnnGraphNotSupportedError, as a library that does not run a shape does), so the
  callers' handling of cuDNN's own refusals runs;
- "absent": no frontend (importing this module fails, as `import cudnn` would).

Strict where cuDNN is, and where a mistake would only show on a GPU:
- a graph goes validate -> build_operation_graph -> create_execution_plans -> check_support
  -> build_plans in that order, is frozen once validated, and executes only once built;
- every sdpa tensor is rank 4 (B, H, S, D) with a unit stride on D, the q/k/v/O dims agree,
  Stats is a FLOAT (B, H, S_q, 1), D is a multiple of 8 (validate) and at most MAX_HEAD_DIM
  (check_support: what this stand-in's library runs forward and backward), the outputs'
  dims, strides and data types are declared by the caller and no two of an output's
  elements share an address; every bf16 tensor's strides but the last are whole 16-byte
  steps (validate) and its address at execute a multiple of 16 (Hopper's kernels load
  16 bytes at a time; Stats, one float per row, is read and written a float at a time);
- the mask as the pybind spells it: the preferred diagonal_alignment and
  diagonal_band_right_bound (an int >= 0), or the deprecated use_causal_mask, not both
  (the binding refuses the mix); a backward with s_q = s_kv = 1 is refused (the real
  validator's rule); what a graph asked is kept on it (its params, the backward's
  use_deterministic_algorithm in _deterministic, the replay hint in _replay) for tests;
- get_workspace_size() takes no handle here: 1.32's handle overload sizes the backend's
  current candidate plan, not the built one, so a caller passing one could allocate a
  workspace the built plan outgrows;
- execute wants every tensor of the graph in the variant pack, each one's extent inside one
  live device allocation of its declared type, a workspace of get_workspace_size() bytes
  inside one allocation (the forward asks a float per row, the backward a float dQ
  accumulator plus a float per row: so a missing or short workspace shows), and a handle
  made by create_handle() whose stream is live;
- handle creation, graph building, support checks and get_workspace_size are setup, refused
  while the current stream captures a CUDA graph; execute is recorded on the handle's
  stream (replayed with the graph, run in stream order under CUDASIM_ORDER=random).
The math: bf16 inputs widened to float, float accumulation, softmax stats as natural-log
logsumexp (float), P and dS rounded to bf16 before the products that read them (P.V, dS.K,
dS^T.Q, P^T.dO: cuDNN's bf16 kernels feed them to bf16 tensor cores, as the project's own
kernels and its NumPy reference do), outputs rounded to bf16 once.
"""
import ctypes
import enum
import itertools
import os

import cupy as _cp
import numpy as np

if os.environ.get("CUDASIM_CUDNN") == "absent":
    raise ImportError("cudasim: CUDASIM_CUDNN=absent (no cudnn frontend installed)")

__version__ = "1.32.0"
LIBRARY_VERSION = 91300
MAX_HEAD_DIM = 128


class data_type(enum.IntEnum):  # noqa: N801 (the real enum's name)
    NOT_SET = 0
    FLOAT = 1
    HALF = 3
    BFLOAT16 = 10


class heur_mode(enum.IntEnum):  # noqa: N801
    A = 0
    B = 1
    FALLBACK = 2


class diagonal_alignment(enum.IntEnum):  # noqa: N801
    TOP_LEFT = 0
    BOTTOM_RIGHT = 1


class cudnnGraphNotSupportedError(Exception):  # noqa: N818 (the real exception's name)
    pass


_DTYPES = {data_type.FLOAT: np.dtype(np.float32), data_type.BFLOAT16: _cp.BF16}
_uids = itertools.count(1)


def backend_version():
    if os.environ.get("CUDASIM_CUDNN") not in ("1", "unsupported"):
        raise RuntimeError("Unable to find symbol cudnnGetVersion")
    return LIBRARY_VERSION


class Handle:
    """What create_handle gives: the stream its work runs on (0 until set_stream)."""

    def __init__(self, backend_handle, ordinal=None, stream=None):
        self._backend, self._ordinal, self._stream = backend_handle, ordinal, stream


def create_handle():
    backend_version()  # (no library: no handle)
    _cp._not_capturing("cudnnCreate")
    return Handle(next(_uids), None, 0)


def set_stream(handle, stream):
    if not isinstance(handle, Handle):
        raise TypeError(f"cudnn.set_stream expects a cudnn.Handle, got {type(handle).__name__}")
    handle._stream = int(stream)


class Tensor:
    """A graph tensor: dims, strides (elements) and type, as declared."""

    def __init__(self, name="", data_type=None, dim=None, stride=None):
        self._dim, self._stride, self._dtype = dim, stride, data_type
        self._name, self._uid, self._output = name, next(_uids), False

    def set_output(self, value):
        self._output = bool(value)
        return self

    def set_dim(self, dim):
        self._dim = [int(x) for x in dim]
        return self

    def set_stride(self, stride):
        self._stride = [int(x) for x in stride]
        return self

    def set_data_type(self, dtype):
        self._dtype = data_type(dtype)
        return self

    def get_dim(self):
        return self._dim

    def get_stride(self):
        return self._stride


_MASK = {"use_causal_mask", "diagonal_alignment", "diagonal_band_right_bound"}
_FORWARD = {"generate_stats", "is_inference", "attn_scale"} | _MASK
_BACKWARD = {"attn_scale", "use_deterministic_algorithm"} | _MASK
_STAGES = ("validate", "build_operation_graph", "create_execution_plans", "check_support",
           "build_plans")


class pygraph:  # noqa: N801
    """One sdpa or sdpa_backward node over bf16 tensors (what the backend builds)."""

    def __init__(self, name="test_graph", io_data_type=None, intermediate_data_type=None,
                 compute_data_type=None, handle=None, *, is_cuda_graph_replay_expected=False):
        if handle is not None and not isinstance(handle, Handle):
            raise TypeError("handle: a cudnn.Handle from create_handle()")
        self._name, self._handle, self._done, self._node = name, handle, [], None
        self._replay = bool(is_cuda_graph_replay_expected)  # (a plan-ranking hint: no math)
        self._deterministic = None  # (the backward's ask, kept for tests: no math here)
        self._types = (io_data_type, intermediate_data_type, compute_data_type)
        self._tensors = []

    def _mutable(self):
        if self._done:
            raise RuntimeError(f"graph {self._name}: changed after validate()")

    def tensor(self, dim, stride=None, data_type=None, *, name=""):
        self._mutable()
        t = Tensor(name, data_type, [int(x) for x in dim],
                   None if stride is None else [int(x) for x in stride])
        self._tensors.append(t)
        return t

    def _op(self, kind, inputs, params, allowed, outputs):
        self._mutable()
        if self._node is not None:
            raise cudnnGraphNotSupportedError("cudasim emulates one sdpa node per graph")
        extra = set(params) - allowed
        if extra:
            raise cudnnGraphNotSupportedError(f"cudasim does not emulate {kind} {sorted(extra)}")
        _mask_args(params)
        outs = [Tensor(f"{kind}::{o}") for o in outputs]
        self._tensors += outs
        self._node = (kind, inputs, params, outs)
        return outs

    def sdpa(self, q, k, v, **kwargs):
        if kwargs.get("generate_stats") is None and kwargs.get("is_inference") is None:
            raise ValueError("sdpa: one of generate_stats, is_inference must be set")
        stats = kwargs.get("generate_stats")
        stats = bool(stats) if stats is not None else not kwargs["is_inference"]
        outs = self._op("sdpa", dict(q=q, k=k, v=v), kwargs, _FORWARD,
                        ("O", "Stats") if stats else ("O",))
        return outs + [None] * (2 - len(outs))

    def sdpa_backward(self, q, k, v, o, dO, stats, **kwargs):  # noqa: N803 (the real name)
        self._deterministic = bool(kwargs.get("use_deterministic_algorithm"))
        return self._op("sdpa_backward", dict(q=q, k=k, v=v, o=o, dO=dO, stats=stats), kwargs,
                        _BACKWARD, ("dQ", "dK", "dV"))

    def _stage(self, name):
        _cp._not_capturing(f"cudnn graph {name} (build graphs before the capture)")
        if self._done != list(_STAGES[:_STAGES.index(name)]):
            raise RuntimeError(f"graph {self._name}: {name}() after {self._done or 'nothing'}; "
                               f"the order is {', '.join(_STAGES)}")
        self._done.append(name)

    def validate(self):
        self._stage("validate")
        _validate(self)

    def build_operation_graph(self):
        self._stage("build_operation_graph")

    def create_execution_plans(self, heuristics=None):
        if not heuristics or any(not isinstance(h, heur_mode) for h in heuristics):
            raise ValueError("create_execution_plans: a list of cudnn.heur_mode")
        self._stage("create_execution_plans")

    def check_support(self):
        self._stage("check_support")
        d = max(self._node[1]["q"]._dim[3], self._node[1]["v"]._dim[3])
        if d > MAX_HEAD_DIM:
            raise cudnnGraphNotSupportedError(f"no engine runs head dim {d} (cudasim's "
                                              f"library: at most {MAX_HEAD_DIM})")

    def build_plans(self):
        self._stage("build_plans")
        if os.environ.get("CUDASIM_CUDNN") == "unsupported":
            raise cudnnGraphNotSupportedError("cudasim (CUDASIM_CUDNN=unsupported): no "
                                              "engine builds a plan for this graph")

    def get_workspace_size(self, handle=None):
        _cp._not_capturing("cudnn get_workspace_size")
        if handle is not None:
            raise RuntimeError("cudasim: get_workspace_size(handle) sizes the backend's "
                               "current candidate plan in 1.32, not the built one; call it "
                               "with no arguments")
        if self._done != list(_STAGES):
            raise RuntimeError(f"graph {self._name}: get_workspace_size() before build_plans()")
        return self._asks()

    def _asks(self):
        b, h, s, d = self._node[1]["q"]._dim
        return 4 * b * h * s * (1 if self._node[0] == "sdpa" else d + 1)

    def execute(self, tensor_dict, workspace=None, handle=None):
        if self._done != list(_STAGES):
            raise RuntimeError(f"graph {self._name}: execute() before build_plans()")
        handle = handle or self._handle
        if not isinstance(handle, Handle) or int(handle._stream) not in _cp._streams:
            raise RuntimeError("execute: no handle, or its stream is not a live stream")
        by = {}
        for key, data in tensor_dict.items():
            uid = key._uid if isinstance(key, Tensor) else key if isinstance(key, int) else \
                next((t._uid for t in self._tensors if t._name == key), None)
            by[uid] = data if isinstance(data, int) else int(data.data.ptr)
        views, keep = {}, []
        kind, inputs, params, outs = self._node
        for port, t in [*inputs.items(), *zip(("O", "Stats", "dQ", "dK", "dV")[
                0 if kind == "sdpa" else 2:], outs)]:
            if t is None:
                continue
            if t._uid not in by:
                raise RuntimeError(f"execute: the variant pack lacks tensor {port} (uid {t._uid})")
            views[port] = _view(by[t._uid], t, port)
            keep.append(_cp._owner_array(by[t._uid]))
        ws = _workspace(workspace, self._asks())
        keep.append(_cp._owner_array(ws) if ws else None)
        scale = float(params.get("attn_scale", 1.0))
        right = _mask_args(params)
        run = (lambda: _forward(views, scale, right)) if kind == "sdpa" else \
            (lambda: _backward(views, scale, right, ws))
        _cp._enqueue(run, keep=keep, stream=_cp._stream_of(handle._stream))


def _mask_args(params):
    """The diagonal band's right bound the mask args ask (None: no mask), refusing what the
    binding refuses: the deprecated use_causal_mask mixed with a right bound, a bound that
    is no int or below 0, an alignment that is no cudnn.diagonal_alignment. (With
    s_q = s_kv, all this stand-in runs, the two alignments are one diagonal.)"""
    right = params.get("diagonal_band_right_bound")
    if params.get("use_causal_mask") and right is not None:
        raise ValueError("use_causal_mask and diagonal_band_right_bound cannot be set at the "
                         "same time")
    if right is not None and (not isinstance(right, int) or isinstance(right, bool)):
        raise ValueError("diagonal_band_right_bound must be an int (or None)")
    if right is not None and right < 0:
        raise ValueError("Right bound needs to be larger than or equal to zero")
    if not isinstance(params.get("diagonal_alignment", diagonal_alignment.TOP_LEFT),
                      diagonal_alignment):
        raise TypeError("diagonal_alignment: a cudnn.diagonal_alignment")
    return 0 if params.get("use_causal_mask") else right


def _declared(t, port):
    if t._dim is None or t._stride is None or t._dtype is None:
        raise ValueError(f"{port}: dim, stride and data type must be set")
    if len(t._dim) != 4 or len(t._stride) != 4:
        raise ValueError(f"The dim and stride for {port} must be rank 4 (B, H, S, D)")
    if t._stride[3] != 1:
        raise cudnnGraphNotSupportedError(f"The stride for the last dimension of {port} "
                                          f"should be 1")
    if min(t._dim) < 1 or min(t._stride) < 0:
        raise ValueError(f"{port}: dims {t._dim}, strides {t._stride}")
    size = _DTYPES[t._dtype].itemsize if t._dtype in _DTYPES else 0
    if t._dtype == data_type.BFLOAT16 and any(s * size % 16 for s in t._stride[:3]):
        raise cudnnGraphNotSupportedError(f"{port}: strides {t._stride} of {size}-byte "
                                          f"elements are not 16-byte aligned")


def _injective(t, port):
    """No two elements of an output at one address (a write would race with itself)."""
    idx = np.indices(t._dim).reshape(4, -1).T @ np.array(t._stride)
    if np.unique(idx).size != idx.size:
        raise cudnnGraphNotSupportedError(f"output {port}: dims {t._dim} with strides "
                                          f"{t._stride} give two elements one address")


def _validate(g):
    if g._node is None:
        raise ValueError(f"graph {g._name}: no operation")
    kind, inputs, _, outs = g._node
    ports = dict(inputs)
    ports.update(zip(("O", "Stats") if kind == "sdpa" else ("dQ", "dK", "dV"), outs))
    for port, t in ports.items():
        if t is None:
            continue
        _declared(t, port)
        if port in ("O", "Stats", "dQ", "dK", "dV"):
            if not t._output:
                raise ValueError(f"{port}: an output not marked set_output(True)")
            _injective(t, port)
    b, h, s, d = ports["q"]._dim
    if kind == "sdpa_backward" and s == 1:  # (s_kv = s_q here: the dims agree, below)
        raise cudnnGraphNotSupportedError("s_q = s_kv = 1 is not supported.")
    for port in ("k", "v", "o", "dO", "O", "dQ", "dK", "dV"):
        if port in ports and ports[port]._dim != [b, h, s, d]:
            raise cudnnGraphNotSupportedError(f"{port} dims {ports[port]._dim}; q's are "
                                              f"{[b, h, s, d]} (cudasim: one head dim, S_q = S_kv)")
    stats = ports.get("Stats", ports.get("stats"))
    if stats is not None and (stats._dim != [b, h, s, 1] or stats._dtype != data_type.FLOAT):
        raise cudnnGraphNotSupportedError(f"Stats: a FLOAT {[b, h, s, 1]}, not "
                                          f"{stats._dtype!r} {stats._dim}")
    for port, t in ports.items():
        if t is not None and t is not stats and t._dtype != data_type.BFLOAT16:
            raise cudnnGraphNotSupportedError(f"{port}: cudasim emulates bf16 sdpa only")
    if d % 8:
        raise cudnnGraphNotSupportedError("hidden_dim should be multiple of 8")


def _view(ptr, t, port):
    """The (B, H, S, D) NumPy view of a tensor at ptr, checked to lie in one allocation of
    its declared type."""
    dt = _DTYPES[t._dtype]
    if t._dtype == data_type.BFLOAT16 and ptr % 16:
        raise RuntimeError(f"execute: tensor {port} at {ptr:#x} is not 16-byte aligned")
    extent = sum((n - 1) * s for n, s in zip(t._dim, t._stride)) + 1
    if _cp._owner(ptr, extent * dt.itemsize) is None:
        raise RuntimeError(f"execute: tensor {port} ({t._dim}, strides {t._stride}) at {ptr:#x} "
                           f"reaches outside one live device allocation")
    owner = _cp._owner_array(ptr)
    if owner.dtype != dt:
        raise RuntimeError(f"execute: tensor {port} lies in a {owner.dtype} allocation; the "
                           f"graph says {dt}")
    flat = np.frombuffer((ctypes.c_char * (extent * dt.itemsize)).from_address(ptr), dt)
    return np.lib.stride_tricks.as_strided(flat, t._dim, [s * dt.itemsize for s in t._stride])


def _workspace(ptr, size):
    if size == 0:
        return 0
    if not ptr:
        raise RuntimeError(f"execute: no workspace; the plan asks {size} bytes")
    ptr = ptr if isinstance(ptr, int) else int(ptr.data.ptr)
    if _cp._owner(ptr, size) is None:
        raise RuntimeError(f"execute: the workspace at {ptr:#x} has less than the {size} bytes "
                           f"the plan asks inside one live device allocation")
    return ptr


def _scores(q, k, scale, right):
    s = np.float32(scale) * np.matmul(q.astype(np.float32), k.astype(np.float32)
                                      .swapaxes(-1, -2))
    if right is not None:  # top-left diagonal band: row i sees keys up to i + right
        n = s.shape[-1]
        s[..., np.triu_indices(n, right + 1)[0], np.triu_indices(n, right + 1)[1]] = -np.inf
    return s


def _bf16(x):
    """x as a bf16 tensor-core operand holds it: rounded to bf16, widened back."""
    return x.astype(_cp.BF16).astype(np.float32)


def _forward(v, scale, right):
    s = _scores(v["q"], v["k"], scale, right)
    m = s.max(-1, keepdims=True)
    lse = m + np.log(np.exp(s - m).sum(-1, keepdims=True, dtype=np.float32))
    p = np.exp(s - lse)
    v["O"][...] = np.matmul(_bf16(p), v["v"].astype(np.float32))
    if "Stats" in v:
        v["Stats"][...] = lse


def _backward(v, scale, right, ws):
    q, k, vv = (v[n].astype(np.float32) for n in ("q", "k", "v"))
    do, o = v["dO"].astype(np.float32), v["o"].astype(np.float32)
    p = np.exp(_scores(v["q"], v["k"], scale, right) - v["stats"].astype(np.float32))
    dp = np.matmul(do, vv.swapaxes(-1, -2))
    ds = _bf16(p * (dp - (do * o).sum(-1, keepdims=True, dtype=np.float32)))
    p = _bf16(p)
    b, h, s, d = q.shape
    acc = np.frombuffer((ctypes.c_char * (4 * b * h * s * d)).from_address(ws), np.float32)
    acc = acc.reshape(b, h, s, d)  # the dQ accumulator lives in the workspace, as cuDNN's
    acc[...] = np.float32(scale) * np.matmul(ds, k)
    v["dQ"][...] = acc
    v["dK"][...] = np.float32(scale) * np.matmul(ds.swapaxes(-1, -2), q)
    v["dV"][...] = np.matmul(p.swapaxes(-1, -2), do)
