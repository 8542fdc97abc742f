"""The matmuls (cublaslt.py's GEMMs), their biases in the GEMMs' epilogues, or, where an
epilogue cannot run, added by elementwise.cu's bias kernels and reduce.py's column sums."""
from __future__ import annotations

import numpy as np

from .compile import i32
from .cublaslt import N_, T_
from .profile import op


class Matmul:
    @op
    def matmul_forward(self, out, inp, w, bias=None) -> None:
        OC, C = w.shape
        if self.blas.gemm(N_, T_, inp.size // C, OC, C, inp, C, w, C, out, OC, bias=bias):
            self.kernels.ew("bias_forward", out.size, out, bias, np.int64(out.size), i32(OC),
                            per_thread=16 // out.dtype.itemsize)

    @op
    def matmul_backward_input(self, dinp, dout, w) -> None:
        OC, C = w.shape
        self.blas.gemm(N_, N_, dinp.size // C, C, OC, dout, OC, w, C, dinp, C)

    @op
    def matmul_backward_weight(self, dw, db, dout, inp) -> None:
        """dw += dout^T inp; db += dout's column sums, from the GEMM's BGRADB epilogue (it
        writes them, rounded to dw's type: a scratch added into db once, as the column sums
        would add), or the column sums' kernel where the epilogue cannot run."""
        OC, C = dw.shape
        N = inp.size // C
        g = None if db is None else self._ws("bias_grad", OC, dw.dtype)
        if self.blas.gemm(T_, N_, OC, C, N, dout, OC, inp, C, dw, C, beta=1.0, bias_grad=g):
            self._column_sum(db, dout, N, OC)
        elif db is not None:
            self.kernels.ew("bias_grad_add", OC, db, g, i32(OC))
