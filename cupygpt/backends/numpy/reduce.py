"""The gradient norm's sum of squares, summed as the CUDA kernel sums it (reduce.cu)."""
from __future__ import annotations

import numpy as np

from ...precision import wide
from .adamw import ADAM_CHUNK
from .mixed import op


class Reduce:
    @op(mixed=False)
    def sum_squares(self, acc, x, offset: int = 0) -> None:
        """acc (1,) += the sum of x's squares (the global gradient norm's share of x; x[0] is
        element `offset` of its stage's flat buffer), as the CUDA kernel sums them: squares
        added in x's wide type (float for fp32 and bf16) within each group of 16 bytes of
        that buffer, in element order, and the groups' sums in float64. Each group's float
        sum is the same whichever ranks' slices hold the group (only a group a slice
        boundary cuts is summed in two parts), and float64 sums in another order move the
        float norm only on a tie within 1e-16 of it: so ZeRO-1's norm is the unsharded one,
        bit for bit."""
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
