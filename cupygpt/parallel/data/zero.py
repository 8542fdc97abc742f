"""ZeRO-1 (llm.c's -z 1): each replica updates one contiguous slice of every stage's flat
parameter buffer and keeps AdamW's state for that slice only. The replicas' gradients are
reduce-scattered into the slices, the updated slices all-gathered after, through the
transport's "dp" group; the update is elementwise, so the parameters are bit-identical to
the unsharded step's."""
from __future__ import annotations

from typing import Any

from ...comm.base import Transport, chunks


def zero_slices(sizes: list[int], dp: int, replica: int) -> list[tuple[int, int]]:
    """Per stage of `sizes` parameters, the slice [a, b) replica `replica` of dp updates."""
    return [chunks(n, dp)[replica] for n in sizes]


class ZeroOne:
    """The replicas' side of a sharded update: slices (per stage, as zero_slices gives)
    and the dp group's reduce-scatter and all-gather over them."""

    def __init__(self, transport: Transport, slices: list[tuple[int, int]]) -> None:
        self.transport, self.slices = transport, slices

    def reduce_scatter(self, grads: Any, mine: Any) -> None:
        """mine = this replica's slice of the replicas' summed flat gradient buffer grads."""
        self.transport.reduce_scatter(grads, mine, "dp")

    def all_gather(self, mine: Any, whole: Any) -> None:
        """whole (a stage's flat buffer) = every replica's slice of it, mine among them."""
        self.transport.all_gather(mine, whole, "dp")
