"""The embedding's ops: wte's rows and wpe's added, and their gradients."""
from __future__ import annotations

import numpy as np

from .mixed import op


def held(inp, v0, rows):
    """Token ids as rows of a vocab shard holding [v0, v0 + rows), and which it holds."""
    r = inp - v0
    held = (r >= 0) & (r < rows)
    return np.where(held, r, 0), held


class Encoder:
    @op("out")
    def encoder_forward(self, out, inp, wte, wpe, v0: int = 0) -> None:
        """out (B,T,C) = wte[inp] + wpe[:T]; inp (B,T) int32. wte holds vocab rows v0.. (a
        tensor-parallel shard): tokens it does not hold get zeros; wpe None: no positions."""
        r, kept = held(inp, v0, wte.shape[0])
        x = wte[r] if kept.all() else np.where(kept[..., None], wte[r], 0)
        if wpe is None:
            out[...] = x
        else:
            np.add(x, wpe[: inp.shape[1]], out=out)

    @op("dwte", "dwpe")
    def encoder_backward(self, dwte, dwpe, dout, inp, v0: int = 0) -> None:
        """dwte[inp] += dout (for the tokens this vocab shard holds); dwpe[:T] += dout summed
        over B."""
        r, kept = held(inp, v0, dwte.shape[0])
        np.add.at(dwte, r[kept], dout[kept])
        dwpe[: inp.shape[1]] += dout.sum(0)
