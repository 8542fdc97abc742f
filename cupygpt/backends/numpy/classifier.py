"""The head's softmax and cross-entropy: each vocab shard's statistics, the loss from all
shards', dlogits in place; and the losses' running sum."""
from __future__ import annotations

import numpy as np

from ...precision import wide
from .encoder import held
from .mixed import op


class Classifier:
    @op("stats")
    def classifier_stats(self, stats, logits, targets, v0: int, valid: int) -> None:
        """Per position, over this vocab shard's first `valid` logits (its real tokens):
        stats (B,T,3) = max, sum of exp(logit - max), and the target's logit when the shard
        holds the target (0 elsewhere)."""
        if valid == 0:
            stats[...] = (-np.inf, 0, 0)
            return
        lg = logits[..., :valid]
        mx = lg.max(-1, keepdims=True)
        stats[..., 0] = mx[..., 0]
        e = self._ws("cls_e", lg.shape, lg.dtype)
        np.subtract(lg, mx, out=e)
        np.exp(e, out=e)
        stats[..., 1] = e.sum(-1)
        r, kept = held(targets, v0, valid)
        stats[..., 2] = np.where(kept, np.take_along_axis(lg, r[..., None], -1)[..., 0], 0)

    @op("logits", "losses")
    def classifier(self, logits, losses, stats, targets, v0: int, valid: int,
                   dloss: float | None = None) -> None:
        """Softmax + cross-entropy from every vocab shard's stats (tp,B,T,3), combined in
        shard order: max M, sum S = sum of s * exp(m - M), target logit t; losses (B,T) =
        log S + M - t.

        With dloss (the loss gradient each position gets, 1/(B*T) for a mean), this shard's
        logits are overwritten in place by dlogits, zero over its padding columns.
        """
        m, s, t = stats[..., 0], stats[..., 1], stats[..., 2]
        M = m.max(0)
        S, tgt = s[0] * np.exp(m[0] - M), t[0].copy()
        for k in range(1, len(stats)):
            S += s[k] * np.exp(m[k] - M)
            tgt += t[k]
        losses[...] = np.log(S) + M - tgt
        if dloss is not None and valid:
            lg = logits[..., :valid]
            np.subtract(lg, M[..., None], out=lg)
            np.exp(lg, out=lg)
            lg /= S[..., None]
            r, kept = held(targets, v0, valid)
            np.put_along_axis(lg, r[..., None], np.take_along_axis(lg, r[..., None], -1)
                              - kept[..., None], -1)
            lg *= dloss
        if dloss is not None:
            logits[..., valid:] = 0

    def cross_entropy(self, logits, losses, targets, valid: int,
                      dloss: float | None = None) -> None:
        """classifier_stats and classifier for a head holding the whole vocab (no tensor
        parallelism: nothing to gather between them), which the CUDA kernel fuses; here they
        are the two ops (and profile as such)."""
        stats = self._ws("ce_stats", (1, *targets.shape, 3), wide(logits.dtype))
        self.classifier_stats(stats[0], logits, targets, 0, valid)
        self.classifier(logits, losses, stats, targets, 0, valid, dloss)

    @op("acc")
    def loss_accumulate(self, acc, losses) -> None:
        """acc (1,) float64 += sum of losses."""
        acc += losses.sum(dtype=np.float64)
