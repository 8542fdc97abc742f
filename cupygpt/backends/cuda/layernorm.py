"""Layernorm's ops (kernels_cu/layernorm.cu): a warp per row, statistics in float; the
residual add fused before the next layernorm; backward's weight gradients as per-block
partials summed by the column sums (reduce.py)."""
from __future__ import annotations

from .compile import i32, whole_packs
from .kernels import GEOMETRY
from .profile import op


class Layernorm:
    @op
    def layernorm_forward(self, out, mean, rstd, inp, w, b) -> None:
        C = inp.shape[-1]
        N = inp.size // C
        self.kernels.rows(whole_packs("layernorm_forward", C, out, inp, w, b), N, out, mean,
                          rstd, inp, w, b, i32(N), i32(C))

    @op
    def residual_layernorm_forward(self, res, a, b, out, mean, rstd, w, lnb) -> None:
        C = res.shape[-1]
        N = res.size // C
        self.kernels.rows(whole_packs("residual_layernorm_forward", C, res, a, b, out, w, lnb),
                          N, res, a, b, out, mean, rstd, w, lnb, i32(N), i32(C))

    @op
    def layernorm_backward(self, dinp, dw, db, dout, inp, w, mean, rstd) -> None:
        C = inp.shape[-1]
        N = inp.size // C
        R = -(-N // GEOMETRY["ROW_WARPS"])
        partial = self._ws("ln_partial", R * 2 * C)
        self.kernels.rows(whole_packs("layernorm_backward", C, dinp, dout, inp, w), N, dinp,
                          partial, dout, inp, w, mean, rstd, i32(N), i32(C))
        self._column_sum(dw, partial, R, 2 * C, db, C)
