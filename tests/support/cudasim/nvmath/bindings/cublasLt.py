"""cudasim's nvmath.bindings.cublasLt (nvmath-python 1.x): the cuBLASLt calls the CUDA
backend makes, computed by NumPy from the very pointers, layouts and attributes it passes,
on cudasim's device memory and streams (the cupy stand-in beside this folder).

Strict where cuBLASLt is, and where a mistake would only show on a GPU:
- attributes are set through a buffer of exactly the attribute's size (the real dtype
  table below); an attribute or epilogue it does not emulate is refused, never ignored;
- a matmul's layouts must agree with its transposes (m, n, k), each ld covers its rows,
  every matrix, the bias vector and the workspace lie inside one live device allocation,
  and each pointer is as aligned as the algorithm was chosen for (the preference's
  MIN_ALIGNMENT_*_BYTES, 256 when not given, as in cuBLASLt);
- the algorithm must be one the heuristic returned for this very descriptor and these
  layouts, unchanged since (but for the bias pointer); the workspace must hold what it
  asked for (this stand-in asks 1 MiB of every algorithm, so a missing workspace shows)
  and be 256-byte aligned;
- BIAS adds a vector of D's type (the allocation holding it must be of that type) of D's
  rows, before D is rounded; BGRADB writes op(B)'s column sums (D's columns) in D's type;
  either wants a 16-byte aligned vector; a BIAS_DATA_TYPE other than D's is refused by the
  heuristic with INVALID_VALUE, as an H100's cuBLASLt 13.1 refused a float bias gradient
  on a bf16 product ("Unsupported config of bias pointer type for chosen precision": only
  FP8 products take another bias type);
- TF32 (CUBLAS_COMPUTE_32F_FAST_TF32) rounds fp32 inputs to TF32; bf16 inputs take
  CUBLAS_COMPUTE_32F only;
- nothing but matmul may be called while the current stream captures a CUDA graph: a
  handle, descriptor, layout, preference or heuristic made there is refused (a plan must
  be made before the capture), and matmul is recorded on the stream it is given (run
  there in the stream's order, under CUDASIM_ORDER=random too).
CUDASIM_LT_NO_EPILOGUE=1 makes the heuristic find no algorithm for any epilogue (the
backend's fallback kernels then run, as on a library without them); =refuse makes it
refuse every epilogue with INVALID_VALUE, as a library that does not take one for a
product's types does.
"""
import ctypes
import enum
import itertools
import os

import cupy as _cp
import numpy as np


class cuBLASLtError(Exception):
    def __init__(self, status):
        super().__init__(status)


class Epilogue(enum.IntEnum):
    DEFAULT = 1
    BIAS = 4
    BGRADA = 256
    BGRADB = 512


class MatmulDescAttribute(enum.IntEnum):
    COMPUTE_TYPE = 0
    SCALE_TYPE = 1
    POINTER_MODE = 2
    TRANSA = 3
    TRANSB = 4
    EPILOGUE = 7
    BIAS_POINTER = 8
    BIAS_DATA_TYPE = 26


class MatrixLayoutAttribute(enum.IntEnum):
    TYPE = 0
    ROWS = 2
    COLS = 3
    LD = 4
    BATCH_COUNT = 5
    STRIDED_BATCH_OFFSET = 6


class MatmulPreferenceAttribute(enum.IntEnum):
    MAX_WORKSPACE_BYTES = 1
    REDUCTION_SCHEME_MASK = 3
    MIN_ALIGNMENT_A_BYTES = 5
    MIN_ALIGNMENT_B_BYTES = 6
    MIN_ALIGNMENT_C_BYTES = 7
    MIN_ALIGNMENT_D_BYTES = 8


class ReductionScheme(enum.IntEnum):
    NONE = 0
    INPLACE = 1
    COMPUTE_TYPE = 2
    OUTPUT_TYPE = 4
    MASK = 7


# each attribute's type, as the real get_*_attribute_dtype give them
_DESC_TYPES = {0: np.int32, 1: np.int32, 2: np.int32, 3: np.int32, 4: np.int32, 7: np.uint32,
               8: np.int64, 26: np.int32}
_LAYOUT_TYPES = {0: np.uint32, 2: np.uint64, 3: np.uint64, 4: np.int64, 5: np.int32, 6: np.int64}
_PREF_TYPES = {1: np.uint64, 3: np.uint32, 5: np.uint32, 6: np.uint32, 7: np.uint32, 8: np.uint32}
matmul_heuristic_result_dtype = np.dtype([("algo", [("data_", "<u8", (8,))]),
                                          ("workspace_size", "<u8"), ("state", "<i4"),
                                          ("waves_count", "<f4"), ("reserved", "<i4", (4,))])
_TYPES = {0: np.dtype(np.float32), 14: _cp.BF16}  # cudaDataType: R_32F, R_16BF
_COMPUTE_32F, _COMPUTE_32F_FAST_TF32 = 68, 77
_WORKSPACE_ASKED = 1 << 20
_ids = itertools.count(1)
_live = {}   # id -> ("handle" | "desc" | "layout" | "pref", its attributes dict)
_algos = {}  # algo id -> what the heuristic chose it for


def _error(status, why):
    return cuBLASLtError(f"{status}: {why}")


def _setup(kind, attrs):
    _cp._not_capturing(f"cuBLASLt {kind} setup (make plans before the capture)")
    i = next(_ids)
    _live[i] = (kind, attrs)
    return i


def _get(i, kind):
    if _live.get(i, (None,))[0] != kind:
        raise _error("CUBLAS_STATUS_INVALID_VALUE", f"{i} is no live {kind}")
    return _live[i][1]


def _destroy(i, kind):
    _get(i, kind)
    _cp._not_capturing(f"cuBLASLt {kind} destroy")
    del _live[i]


def _set(i, kind, table, attr, buf, size):
    attrs = _get(i, kind)
    if attr not in table:
        raise _error("CUBLAS_STATUS_NOT_SUPPORTED", f"cudasim does not emulate {kind} "
                     f"attribute {attr}")
    t = np.dtype(table[attr])
    if size != t.itemsize:
        raise _error("CUBLAS_STATUS_INVALID_VALUE", f"{kind} attribute {attr}: {size} bytes, "
                     f"wants {t.itemsize}")
    attrs[attr] = np.frombuffer((ctypes.c_char * size).from_address(buf), t)[0].item()
    if not (kind == "desc" and attr == MatmulDescAttribute.BIAS_POINTER):  # (a pointer
        attrs["version"] = attrs.get("version", 0) + 1  # leaves the chosen algorithm good)


def get_matmul_desc_attribute_dtype(attr):
    return _DESC_TYPES[attr]


def get_matrix_layout_attribute_dtype(attr):
    return _LAYOUT_TYPES[attr]


def get_matmul_preference_attribute_dtype(attr):
    return _PREF_TYPES[attr]


def create():
    return _setup("handle", {})


def destroy(light_handle):
    _destroy(light_handle, "handle")


def matmul_desc_create(compute_type, scale_type):
    if compute_type not in (_COMPUTE_32F, _COMPUTE_32F_FAST_TF32) or scale_type != 0:
        raise _error("CUBLAS_STATUS_NOT_SUPPORTED", f"cudasim emulates compute types 68/77 "
                     f"with fp32 scale, not {compute_type}/{scale_type}")
    return _setup("desc", {0: compute_type, 1: scale_type, 3: 0, 4: 0, 7: int(Epilogue.DEFAULT),
                           8: 0, 26: -1})


def matmul_desc_destroy(matmul_desc):
    _destroy(matmul_desc, "desc")


def matmul_desc_set_attribute(matmul_desc, attr, buf, size_in_bytes):
    _set(matmul_desc, "desc", _DESC_TYPES, attr, buf, size_in_bytes)
    v = _live[matmul_desc][1][attr]
    if attr == MatmulDescAttribute.EPILOGUE and v not in (Epilogue.DEFAULT, Epilogue.BIAS,
                                                          Epilogue.BGRADB):
        raise _error("CUBLAS_STATUS_NOT_SUPPORTED", f"cudasim does not emulate epilogue {v}")
    if attr in (MatmulDescAttribute.TRANSA, MatmulDescAttribute.TRANSB) and v not in (0, 1):
        raise _error("CUBLAS_STATUS_INVALID_VALUE", f"operation {v}")


def matrix_layout_create(type, rows, cols, ld):  # noqa: A002 (the real parameter's name)
    if type not in _TYPES:
        raise _error("CUBLAS_STATUS_NOT_SUPPORTED", f"cudasim emulates R_32F and R_16BF, "
                     f"not data type {type}")
    return _setup("layout", {0: type, 2: rows, 3: cols, 4: ld, 5: 1, 6: 0})


def matrix_layout_destroy(mat_layout):
    _destroy(mat_layout, "layout")


def matrix_layout_set_attribute(mat_layout, attr, buf, size_in_bytes):
    _set(mat_layout, "layout", _LAYOUT_TYPES, attr, buf, size_in_bytes)


def matmul_preference_create():
    return _setup("pref", {1: 0, 3: int(ReductionScheme.MASK), 5: 256, 6: 256, 7: 256, 8: 256})


def matmul_preference_destroy(pref):
    _destroy(pref, "pref")


def matmul_preference_set_attribute(pref, attr, buf, size_in_bytes):
    _set(pref, "pref", _PREF_TYPES, attr, buf, size_in_bytes)


def _shape(desc, a, b, c, d):
    """(m, n, k, batch) of a matmul, checked as cuBLASLt checks its layouts."""
    if (c[0], c[2], c[3], c[4], c[5], c[6]) != (d[0], d[2], d[3], d[4], d[5], d[6]):
        raise _error("CUBLAS_STATUS_NOT_SUPPORTED", "C and D layouts differ (an in-place "
                     "matmul wants one layout)")
    m, n = d[2], d[3]
    ka = a[3] if desc[3] == 0 else a[2]
    kb = b[2] if desc[4] == 0 else b[3]
    rows_a = a[2] if desc[3] == 0 else a[3]
    cols_b = b[3] if desc[4] == 0 else b[2]
    if (rows_a, cols_b, ka) != (m, n, kb):
        raise _error("CUBLAS_STATUS_INVALID_VALUE", f"op(A) {rows_a}x{ka}, op(B) {kb}x"
                     f"{cols_b}, D {m}x{n}: the layouts do not agree with the transposes")
    if len({a[5], b[5], d[5]}) != 1:
        raise _error("CUBLAS_STATUS_INVALID_VALUE", "batch counts differ")
    if _TYPES[a[0]] != _TYPES[b[0]]:
        raise _error("CUBLAS_STATUS_NOT_SUPPORTED", "A and B types differ")
    if _TYPES[a[0]] == _cp.BF16 and desc[0] != _COMPUTE_32F:
        raise _error("CUBLAS_STATUS_NOT_SUPPORTED", "bf16 inputs take CUBLAS_COMPUTE_32F")
    if _TYPES[a[0]] == np.float32 and _TYPES[d[0]] != np.float32:
        raise _error("CUBLAS_STATUS_NOT_SUPPORTED", "fp32 inputs give an fp32 D")
    return m, n, ka, d[5]


def _bias_type(desc, d):
    return _TYPES[d[0]] if desc[26] == -1 else _TYPES.get(desc[26])


def matmul_algo_get_heuristic(light_handle, operation_desc, adesc, bdesc, cdesc, ddesc,
                              preference, requested_algo_count, heuristic_results_array,
                              return_algo_count):
    _get(light_handle, "handle")
    desc, pref = _get(operation_desc, "desc"), _get(preference, "pref")
    layouts = [_get(x, "layout") for x in (adesc, bdesc, cdesc, ddesc)]
    _cp._not_capturing("cuBLASLt heuristic (make plans before the capture)")
    _shape(desc, *layouts)
    out = np.frombuffer((ctypes.c_char * (requested_algo_count * matmul_heuristic_result_dtype
                                          .itemsize)).from_address(heuristic_results_array),
                        matmul_heuristic_result_dtype)
    count = ctypes.c_int32.from_address(return_algo_count)
    epilogue = desc[MatmulDescAttribute.EPILOGUE]
    if epilogue != Epilogue.DEFAULT and _bias_type(desc, layouts[3]) != _TYPES[layouts[3][0]]:
        raise _error("CUBLAS_STATUS_INVALID_VALUE", "Unsupported config of bias pointer type "
                     f"for chosen precision, got ({desc[MatmulDescAttribute.BIAS_DATA_TYPE]})")
    if epilogue != Epilogue.DEFAULT and os.environ.get("CUDASIM_LT_NO_EPILOGUE") == "refuse":
        raise _error("CUBLAS_STATUS_INVALID_VALUE", f"epilogue {epilogue} refused "
                     "(CUDASIM_LT_NO_EPILOGUE=refuse)")
    if requested_algo_count < 1 or (epilogue != Epilogue.DEFAULT and
                                    os.environ.get("CUDASIM_LT_NO_EPILOGUE") == "1"):
        count.value = 0
        return
    if pref[MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES] < _WORKSPACE_ASKED:
        count.value = 0  # (this stand-in's algorithms all want a workspace)
        return
    i = next(_ids)
    _algos[i] = {"for": (operation_desc, adesc, bdesc, cdesc, ddesc),
                 "versions": [desc.get("version", 0), *(x.get("version", 0) for x in layouts)],
                 "align": [pref[a] for a in (5, 6, 7, 8)]}
    out[0]["algo"]["data_"][:] = 0
    out[0]["algo"]["data_"][0] = i
    out[0]["workspace_size"], out[0]["state"], out[0]["waves_count"] = _WORKSPACE_ASKED, 0, 1.0
    count.value = 1


def _pointer(ptr, nbytes, what, align):
    if ptr % align:
        raise _error("CUBLAS_STATUS_NOT_SUPPORTED", f"{what} at {ptr:#x} is not {align}-byte "
                     f"aligned (the algorithm was chosen for {align})")
    if _cp._owner(ptr, nbytes) is None:
        raise _error("CUBLAS_STATUS_INVALID_VALUE", f"{what} ({nbytes} bytes at {ptr:#x}) is "
                     f"not inside one live device allocation")


def _vector(ptr, n, dtype, what):
    _pointer(ptr, n * dtype.itemsize, what, 16)
    owner = _cp._owner_array(ptr)
    if owner.dtype != dtype:
        raise _error("CUBLAS_STATUS_INVALID_VALUE", f"{what} lies in a {owner.dtype} "
                     f"allocation; the descriptor says {dtype}")
    return np.frombuffer((ctypes.c_char * (n * dtype.itemsize)).from_address(ptr), dtype)


def matmul(light_handle, compute_desc, alpha, a, adesc, b, bdesc, beta, c, cdesc, d, ddesc,
           algo, workspace, workspace_size_in_bytes, stream):
    _get(light_handle, "handle")
    desc = _get(compute_desc, "desc")
    la, lb, lc, ld = (_get(x, "layout") for x in (adesc, bdesc, cdesc, ddesc))
    chosen = _algos.get(ctypes.c_uint64.from_address(algo).value)
    versions = [desc.get("version", 0), *(x.get("version", 0) for x in (la, lb, lc, ld))]
    if chosen is None or chosen["for"] != (compute_desc, adesc, bdesc, cdesc, ddesc) or \
            chosen["versions"] != versions:
        raise _error("CUBLAS_STATUS_INVALID_VALUE", "the algorithm was not chosen by the "
                     "heuristic for this descriptor and these layouts (as they are now)")
    m, n, k, batch = _shape(desc, la, lb, lc, ld)
    if workspace_size_in_bytes < _WORKSPACE_ASKED:
        raise _error("CUBLAS_STATUS_INVALID_VALUE", f"a workspace of "
                     f"{workspace_size_in_bytes} bytes; the algorithm asked {_WORKSPACE_ASKED}")
    _pointer(workspace, workspace_size_in_bytes, "the workspace", 256)
    if c != d:
        raise _error("CUBLAS_STATUS_NOT_SUPPORTED", "cudasim emulates C == D (in place) only")
    mats = []
    for ptr, lay, rows, cols, what, align in (
            (a, la, *((m, k) if desc[3] == 0 else (k, m)), "A", chosen["align"][0]),
            (b, lb, *((k, n) if desc[4] == 0 else (n, k)), "B", chosen["align"][1]),
            (d, ld, m, n, "D", chosen["align"][3])):
        t = _TYPES[lay[0]]
        stride = lay[6] if batch > 1 else 0
        _pointer(ptr, t.itemsize, what, align)
        mats.append(_cp._matrix(ptr, rows, cols, lay[4], stride, batch, what, t))
    opA, opB, outD = mats
    a_ = ctypes.c_float.from_address(alpha).value  # host pointer mode: read at call time
    b_ = ctypes.c_float.from_address(beta).value
    epilogue, bias = desc[MatmulDescAttribute.EPILOGUE], None
    if epilogue != Epilogue.DEFAULT and batch > 1:
        raise _error("CUBLAS_STATUS_NOT_SUPPORTED", "cudasim emulates epilogues on unbatched "
                     "matmuls only")
    if epilogue != Epilogue.DEFAULT:
        bias = _vector(desc[MatmulDescAttribute.BIAS_POINTER],
                       m if epilogue == Epilogue.BIAS else n, _bias_type(desc, ld),
                       f"the {Epilogue(epilogue).name} vector")
    tf32 = desc[0] == _COMPUTE_32F_FAST_TF32

    def run():
        x = (opA if desc[3] == 0 else opA.transpose(0, 2, 1)).astype(np.float32)
        y = (opB if desc[4] == 0 else opB.transpose(0, 2, 1)).astype(np.float32)
        if tf32:
            x, y = _cp._tf32(x), _cp._tf32(y)
        r = np.float32(a_) * np.matmul(x, y)
        if b_ != 0:  # beta 0: C is not read
            r = r + np.float32(b_) * outD.astype(np.float32)
        if epilogue == Epilogue.BIAS:
            r = r + bias.astype(np.float32)[:, None]
        elif epilogue == Epilogue.BGRADB:
            bias[...] = y[0].sum(0, dtype=np.float32)
        outD[...] = r
    if int(stream) not in _cp._streams:
        raise _error("CUBLAS_STATUS_INVALID_VALUE", f"no live stream {int(stream):#x}")
    keep = [_cp._owner_array(p) for p in (a, b, d, workspace)] + [bias]
    _cp._enqueue(run, keep=keep, stream=_cp._stream_of(stream))
