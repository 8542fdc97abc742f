"""Megatron's split of GPT-2's parameters over tp shards: qkvw/qkvb by heads (NH/tp whole
heads of each of q, k and v), fcw/fcb by output rows (column-parallel), attprojw and fcprojw
by input columns (row-parallel), wte by vocabulary rows (uneven where tp does not divide
Vp); every other tensor is held whole by each shard."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# {tensor: how it is split}, over per-layer shapes (nl, ...): "heads" splits q, k and v's
# heads, "rows" the output rows (axis 1), "cols" the input columns (axis 2)
SPLIT = {"qkvw": "heads", "qkvb": "heads", "fcw": "rows", "fcb": "rows", "attprojw": "cols",
         "fcprojw": "cols"}


def vocab_rows(Vp: int, V: int, tp: int, shard: int) -> tuple[int, int, int]:
    """(v0, rows, valid): shard's rows [v0, v0 + rows) of wte's Vp, split as evenly as
    possible, and how many of them are real tokens (< V), not padding."""
    base, extra = divmod(Vp, tp)
    v0 = shard * base + min(shard, extra)
    rows = base + (shard < extra)
    return v0, rows, max(0, min(rows, V - v0))


def shard_dims(name: str, dims: tuple, tp: int) -> tuple:
    """A per-layer tensor's dims (nl, ...) as one of tp shards holds it (wte: vocab_rows)."""
    how = SPLIT.get(name)
    if how is None:
        return dims
    axis = 2 if how == "cols" else 1
    return dims[:axis] + (dims[axis] // tp,) + dims[axis + 1:]


def shard_view(name: str, x: Any, NH: int, tp: int, shard: int) -> Any:
    """The part of x (a per-layer tensor over a layer range, whole) that shard holds: a view
    shaped as shard_dims says, or one that reshapes to it."""
    how, s = SPLIT.get(name), shard
    if how == "heads":  # (nl, 3, NH, HS[, C]): this shard's heads of q, k and v
        h = NH // tp
        return x.reshape(x.shape[0], 3, NH, -1)[:, :, s * h:(s + 1) * h]
    if how == "rows":
        n = x.shape[1] // tp
        return x[:, s * n:(s + 1) * n]
    if how == "cols":
        n = x.shape[2] // tp
        return x[:, :, s * n:(s + 1) * n]
    return x


@dataclass(frozen=True)
class TensorShard:
    """Shard `shard` of `tp`: what model.layout.Part's split asks (vocab_rows, dims, view)."""
    tp: int
    shard: int

    def vocab_rows(self, Vp: int, V: int) -> tuple[int, int, int]:
        return vocab_rows(Vp, V, self.tp, self.shard)

    def dims(self, name: str, dims: tuple) -> tuple:
        return shard_dims(name, dims, self.tp)

    def view(self, name: str, x: Any, NH: int) -> Any:
        return shard_view(name, x, NH, self.tp, self.shard)
