"""The matmuls: NumPy's (BLAS) over the rows of the batch."""
from __future__ import annotations

import numpy as np

from .mixed import op


def rows(a):
    """a's rows: (..., C) as (N, C)."""
    return a.reshape(-1, a.shape[-1])


class Matmul:
    @op("out")
    def matmul_forward(self, out, inp, w, bias=None) -> None:
        """out (B,T,OC) = inp (B,T,C) @ w (OC,C)^T (+ bias (OC)), the sum rounded once to
        out's type (the CUDA backend's GEMM epilogue adds the bias before it stores)."""
        np.matmul(rows(inp), w.T, out=rows(out))
        if bias is not None:
            out += bias

    @op("dinp")
    def matmul_backward_input(self, dinp, dout, w) -> None:
        """dinp (B,T,C) = dout (B,T,OC) @ w (OC,C): the input gradient (zero-bubble's B)."""
        np.matmul(rows(dout), w, out=rows(dinp))

    @op("dw", "db")
    def matmul_backward_weight(self, dw, db, dout, inp) -> None:
        """dw (OC,C) += dout^T @ inp; db (OC) += sum of dout rows (zero-bubble's W: off the
        critical path, so a schedule may defer it)."""
        d2 = rows(dout)
        dw += d2.T @ rows(inp)
        if db is not None:
            db += d2.sum(0)
