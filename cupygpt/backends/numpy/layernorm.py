"""Layernorm's ops, eps LN_EPS; the residual add before it, as the two ops."""
from __future__ import annotations

import numpy as np

from .matmul import rows
from .mixed import op

LN_EPS = 1e-5


class Layernorm:
    @op("out", "mean", "rstd")
    def layernorm_forward(self, out, mean, rstd, inp, w, b) -> None:
        """out (B,T,C); mean, rstd (B,T) saved for backward."""
        mean[...] = inp.mean(-1)
        xc = inp - mean[..., None]
        rstd[...] = 1.0 / np.sqrt((xc * xc).mean(-1) + LN_EPS)
        np.multiply(xc * rstd[..., None], w, out=out)
        out += b

    def residual_layernorm_forward(self, res, a, b, out, mean, rstd, w, lnb) -> None:
        """res = a + b, stored; out, mean, rstd: the layernorm of res as stored. The CUDA
        kernel fuses the two; here they are the two ops (and profile as such)."""
        self.residual_forward(res, a, b)
        self.layernorm_forward(out, mean, rstd, res, w, lnb)

    @op("dinp", "dw", "db")
    def layernorm_backward(self, dinp, dw, db, dout, inp, w, mean, rstd) -> None:
        norm = (inp - mean[..., None]) * rstd[..., None]
        dnorm = dout * w
        dinp += (dnorm - dnorm.mean(-1, keepdims=True)
                 - norm * (dnorm * norm).mean(-1, keepdims=True)) * rstd[..., None]
        dw += rows(dout * norm).sum(0)
        db += rows(dout).sum(0)
