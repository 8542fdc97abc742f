"""cuBLASLt's matmuls (nvmath-python's bindings), not CuPy's cuBLAS wrappers: those set
the handle's stream on every call, which CuPy refuses while a stream captures a CUDA graph.
Everything cuBLASLt needs but a capture may not do (the handle, the workspace, each shape's
descriptor, layouts and heuristic-chosen algorithm) is made on a matmul's first call, in
the eager first step; a captured step only calls cublasLtMatmul. Biases are the GEMMs'
epilogues: forward BIAS (added before the output is rounded), backward BGRADB (the bias
gradient from the weight-gradient GEMM, into a scratch of the gradient's type added into
the gradient buffer: cuBLASLt takes no other bias type for bf16 or fp32 products)."""
from __future__ import annotations

import re
from collections.abc import Callable
from types import MappingProxyType

import cupy as cp
import numpy as np
from nvmath.bindings import cublasLt as lt

from ... import CupyGPTError
from ...precision import BF16
from .profile import Profiler

# cudaDataType (library_types.h) and cublasComputeType_t (cublas_api.h): fp32 math, exact or
# with TF32 tensor cores
CUDA_TYPE = MappingProxyType({np.dtype(np.float32): 0, BF16: 14})
COMPUTE_32F, COMPUTE_32F_FAST_TF32 = 68, 77
N_, T_ = 0, 1  # cuBLAS operation flags: no transpose, transpose
LT_WORKSPACE = 32 * 2**20  # cuBLAS's recommended workspace on Hopper; one for every matmul
LT_ALIGN = 256             # the workspace's alignment (what cuBLAS asks of one)
BIAS_ALIGN = 16            # an epilogue's bias vector: 16-byte aligned, else the fallback


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


class Cublaslt:
    """The handle and workspace (made on the first matmul, before a capture), each
    matmul's plan, and the epilogues that could not run."""

    def __init__(self, profiler: Profiler, workspace: Callable) -> None:
        self.profiler = profiler
        self.kept = workspace  # (key, n, dtype): a buffer kept for the process
        self.tf32 = False      # fp32 products on TF32 tensor cores (configure's)
        self.handle = self.workspace = None
        self.plans = {}      # a matmul's shape, types, epilogue and alignments -> its plan
        self.scalars = {}    # alpha values by value: cuBLAS reads them through a host pointer
        self.fallbacks = {}  # (epilogue, why) -> calls made without it (bench reports them)
        self.one, self.zero = np.array(1.0, np.float32), np.array(0.0, np.float32)

    def reset(self, tf32: bool) -> None:
        """Plans are made again (their compute type follows tf32)."""
        self.tf32 = tf32
        self.plans.clear()

    def ready(self):
        """The handle, made with the workspace on the first matmul."""
        if self.handle is None:
            self.handle = lt.create()
            raw = self.kept("cublaslt", LT_WORKSPACE + LT_ALIGN, np.uint8)
            start = -raw.data.ptr % LT_ALIGN
            self.workspace = raw[start:start + LT_WORKSPACE]
        return self.handle

    def scalar(self, x: float) -> np.ndarray:
        return self.scalars.setdefault(float(x), np.array(x, np.float32))

    def fallback_lines(self) -> list:
        """Each bias epilogue a matmul ran without (its term added by a kernel after the
        GEMM): which, why, and how many calls."""
        return [f"{epilogue} epilogue: {why}; a kernel added its term instead ({n} calls)"
                for (epilogue, why), n in sorted(self.fallbacks.items())]

    def plan(self, key: tuple, epilogue, bias_ptr: int) -> dict:
        """The descriptor, layouts and algorithm of a column-major D (m,n) = alpha op(A) op(B)
        + beta C: made once (never while a stream captures: cuBLASLt's setup is not graph
        work). The heuristic's first algorithm, split-K only with a reduction pass over the
        workspace, never in place in the output (a run must repeat its bits, and the in-place
        scheme's order rests on counters between blocks); None when no algorithm takes the
        epilogue."""
        h = self.ready()
        (ta, tb, m, n, k, lda, ldb, ldc, batch, sA, sB, sC, at, bt, ct, aligns) = key
        desc = lt.matmul_desc_create(COMPUTE_32F_FAST_TF32 if self.tf32 and at == np.float32 else
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

    def gemm(self, ta, tb, M, N, K, A, lda, B, ldb, C, ldc, beta=0.0, batch=1, sA=0, sB=0, sC=0,
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
                plan = self.cached(key, epilogue, vec.data.ptr)
                why = plan.get("refused")
                plan = None if why else plan
            if plan is None:
                missing = epilogue
                self.fallbacks[epilogue.name, why] = \
                    self.fallbacks.get((epilogue.name, why), 0) + 1
            elif plan["bias"] != vec.data.ptr:  # (host memory only: allowed in a capture, and
                plan["bias"] = vec.data.ptr      # the captured call keeps the pointer it saw)
                _set(lt.matmul_desc_set_attribute, plan["desc"],
                     lt.MatmulDescAttribute.BIAS_POINTER, plan["bias"],
                     lt.get_matmul_desc_attribute_dtype)
        plan = plan or self.cached(key, lt.Epilogue.DEFAULT, 0)
        args = (self.ready(), plan["desc"], self.scalar(alpha).ctypes.data,
                B.data.ptr, plan["layouts"][0], A.data.ptr, plan["layouts"][1],
                (self.one if beta else self.zero).ctypes.data, C.data.ptr, plan["layouts"][2],
                C.data.ptr, plan["layouts"][2], plan["algo"].ctypes.data,
                self.workspace.data.ptr, LT_WORKSPACE, cp.cuda.get_current_stream().ptr)
        if self.profiler.trace is None:
            lt.matmul(*args)
        else:
            shape = f"{'NT'[ta]}{'NT'[tb]} {M}x{N}x{K}" + (f"x{batch}" if batch > 1 else "")
            self.profiler.traced("gemm_" + shape, lt.matmul, *args)
        return missing

    def cached(self, key: tuple, epilogue, bias_ptr: int) -> dict:
        """The plan of key with this epilogue (its bias pointer first set to bias_ptr): made
        on first use, refused while the stream captures (cuBLASLt's setup is no graph work)."""
        full = (key, epilogue)
        if full not in self.plans:
            if cp.cuda.get_current_stream().is_capturing():
                raise RuntimeError(f"a matmul first seen while the stream captures a CUDA graph "
                                   f"({key}, {epilogue.name}): its cuBLASLt plan must be made in "
                                   f"an eager step first")
            self.plans[full] = self.plan(key, epilogue, bias_ptr)
        return self.plans[full]
