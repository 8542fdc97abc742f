"""The embedding's ops (kernels_cu/encoder.cu): wte's rows and wpe's added, and their
gradients, wte's by a sort of the positions by token (no atomics: a run repeats its bits)."""
from __future__ import annotations

import numpy as np

from .compile import i32, row_packs
from .kernels import GEOMETRY
from .profile import op


class Encoder:
    @op
    def encoder_forward(self, out, inp, wte, wpe, v0: int = 0) -> None:
        B, T = inp.shape
        rows, C = wte.shape
        self.kernels.ew("encoder_forward", row_packs(B * T, C, out.dtype), out, inp, wte,
                        wte if wpe is None else wpe, i32(B), i32(T), i32(C), i32(v0), i32(rows),
                        i32(wpe is not None))

    @op
    def encoder_backward(self, dwte, dwpe, dout, inp, v0: int = 0) -> None:
        B, T = inp.shape
        rows, C = dwte.shape
        n, warp, runs = B * T, GEOMETRY["WARP"], -(-B * T // GEOMETRY["SORT_KEYS"])
        order = [self._ws(key, n, np.int32) for key in ("emb_sorted", "emb_first", "emb_start")]
        keys = self._ws("emb_keys", runs * GEOMETRY["SORT_KEYS"], np.int64)
        k = self.kernels
        k.launch("encoder_sort_blocks", (runs,), (GEOMETRY["SORT_KEYS"] // 2,), keys, inp, i32(n))
        k.ew("encoder_rank", n, *order, keys, inp, i32(n))
        k.launch("encoder_backward_wte", (n, -(-C // (warp * 16 // dwte.dtype.itemsize))),
                 (warp,), dwte, dout, inp, *order, i32(C), i32(v0), i32(rows))
        k.ew("encoder_backward_wpe", row_packs(T, C, dwpe.dtype), dwpe, dout, i32(B), i32(T),
             i32(C))
