"""The reductions (kernels_cu/reduce.cu): column sums (layernorm's weight gradients, a bias
gradient whose epilogue could not run) and the gradient norm's sum of squares, each in one
launch in an order fixed by the shape, so a step repeats its bits."""
from __future__ import annotations

import numpy as np

from .compile import i32
from .kernels import GEOMETRY
from .profile import op

COLUMN_BLOCKS = 528  # column sums: at least this many blocks (4 per SM of an H100) where
                     # the rows allow, each chunk of rows at least ROW_LANES long
NORM_BLOCKS = 528  # sum_squares' most blocks: 4 per SM of an H100 (132 SMs)


class Reduce:
    def _column_sum(self, out, inp, N, OC, out_b=None, split=None) -> None:
        """out (OC) += column sums of inp (N, OC), deterministically, in one launch; with
        out_b, columns [split, OC) go to out_b instead. inp float: layernorm's partials
        (column_sum_f32), else a gradient of the run's type where a bias gradient's epilogue
        could not run (column_sum_x)."""
        per_thread = 16 // inp.dtype.itemsize
        tiles = -(-OC // (GEOMETRY["COL_TILE"] * per_thread))
        R = max(1, min(-(-COLUMN_BLOCKS // tiles), N // GEOMETRY["ROW_LANES"]))
        per = -(-N // R)
        R = -(-N // per)  # (no empty chunk)
        self.kernels.launch("column_sum_f32" if inp.dtype == np.float32 else "column_sum_x",
                            (tiles, R), (GEOMETRY["COL_TILE"], GEOMETRY["ROW_LANES"]), out,
                            out if out_b is None else out_b, i32(OC if split is None else split),
                            inp, i32(N), i32(OC), i32(per), self._ws("colsum", R * OC),
                            self._ws("colsum_done", tiles, np.int32, zeroed=True))

    @op
    def sum_squares(self, acc, x, offset: int = 0) -> None:
        """acc (1,) float64 += the sum of x's squares (x[0]: element `offset` of its stage's
        flat buffer), float within each 16-byte group of that buffer and float64 across them
        (reduce.cu says why), in an order fixed by x.size, so a step's norm and its clipping
        repeat exactly."""
        threads, pack = GEOMETRY["EW_THREADS"], 16 // x.dtype.itemsize
        groups = (offset % pack + x.size + pack - 1) // pack
        R = max(1, min(NORM_BLOCKS, (groups + threads - 1) // threads))
        partial = self._ws("norm_partial", R, np.float64)
        start = x.data.ptr - offset % pack * x.dtype.itemsize  # its first group's, in the buffer
        self.kernels.launch("sum_squares_partial_v" if start % 16 == 0 else
                            "sum_squares_partial", (R,), (threads,), partial, x,
                            np.int64(x.size), np.int64(offset))
        self.kernels.launch("sum_squares_finish", (1,), (threads,), acc, partial, i32(R))
