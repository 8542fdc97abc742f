"""The head's softmax and cross-entropy (kernels_cu/classifier.cu): a block per row of
logits; each vocab shard's statistics, the loss from all shards' and dlogits in place, the
two fused where one head holds the whole vocab; the losses summed on the device."""
from __future__ import annotations

import numpy as np

from .compile import i32, whole_packs
from .kernels import GEOMETRY
from .profile import op


class Classifier:
    @op
    def classifier_stats(self, stats, logits, targets, v0: int, valid: int) -> None:
        Vs = logits.shape[-1]
        self.kernels.launch(whole_packs("classifier_stats", Vs, logits), (logits.size // Vs,),
                            (GEOMETRY["CLS_THREADS"],), stats, logits, targets, i32(v0),
                            i32(valid), i32(Vs))

    @op
    def classifier(self, logits, losses, stats, targets, v0: int, valid: int,
                   dloss: float | None = None) -> None:
        Vs = logits.shape[-1]
        N = logits.size // Vs
        self.kernels.launch(whole_packs("classifier", Vs, logits), (N,),
                            (GEOMETRY["CLS_THREADS"],), logits, losses, stats, targets,
                            np.float32(dloss or 0.0), i32(dloss is not None), i32(v0),
                            i32(valid), i32(Vs), i32(stats.shape[0]), i32(N))

    @op
    def cross_entropy(self, logits, losses, targets, valid: int,
                      dloss: float | None = None) -> None:
        Vs = logits.shape[-1]
        self.kernels.launch(whole_packs("cross_entropy", Vs, logits), (logits.size // Vs,),
                            (GEOMETRY["CLS_THREADS"],), logits, losses, targets,
                            np.float32(dloss or 0.0), i32(dloss is not None), i32(valid),
                            i32(Vs))

    @op
    def loss_accumulate(self, acc, losses) -> None:
        """acc (1,) float64 += sum of losses, on the device (no sync; graph-safe)."""
        self.kernels.launch("loss_accumulate", (1,), (GEOMETRY["CLS_THREADS"],), acc, losses,
                            i32(losses.size))
