"""A stage's tensor-parallel group: the collectives Megatron's split needs, through the
run's transport (its "tp" group). With one shard every call is the transport's no-op."""
from __future__ import annotations

from typing import Any

from ...comm.base import Transport


class TensorGroup:
    """shard `shard` of `tp` in the transport's "tp" group."""

    def __init__(self, transport: Transport, tp: int = 1, shard: int = 0) -> None:
        self.transport, self.tp, self.shard = transport, tp, shard

    def sum(self, arr: Any) -> None:
        """The group's sum of arr, in place: a row-parallel product's partial outputs
        forward, a column-parallel product's partial input gradients backward."""
        self.transport.all_reduce(arr, "tp")

    def cross_entropy(self, be: Any, logits: Any, losses: Any, targets: Any, lstats: Any,
                      v0: int, valid: int, dloss: Any) -> None:
        """Vocab-parallel softmax cross-entropy of one chunk of positions (logits: (n, rows)
        of this shard's vocabulary rows from v0): each shard's (max, sum of exponentials,
        target logit) per position are gathered into lstats (tp, n, 3), every shard
        combines them in shard order, and the logits are never gathered. With one shard,
        the backend's fused op."""
        if self.tp == 1:
            return be.cross_entropy(logits, losses, targets, valid, dloss)
        stats = lstats.reshape(-1)[:self.tp * len(losses) * 3].reshape(self.tp, -1, 3)
        be.classifier_stats(stats[self.shard], logits, targets, v0, valid)
        self.transport.all_gather(stats[self.shard], stats, "tp")
        be.classifier(logits, losses, stats, targets, v0, valid, dloss)
