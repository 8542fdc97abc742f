"""AdamW state over a stage's flat parameter buffer (m, v in the same layout), and
llm.c's learning-rate schedule."""
import math
from dataclasses import dataclass


@dataclass
class AdamWConfig:
    lr: float = 3e-4
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0


class AdamW:
    def __init__(self, stage, hp):
        self.stage, self.hp, self.t = stage, hp, 0
        self.m = stage.be.zeros(stage.params.size, stage.dtype)
        self.v = stage.be.zeros(stage.params.size, stage.dtype)

    def step(self, lr=None):
        self.t += 1
        self.launch(lr)

    def launch(self, lr=None):
        """The update for step t (a captured CUDA graph replays this without bumping t)."""
        hp = self.hp
        self.stage.be.adamw(self.stage.params, self.stage.grads, self.m, self.v, self.t,
                            hp.lr if lr is None else lr, hp.beta1, hp.beta2, hp.eps,
                            hp.weight_decay)


def lr_at(step, lr, warmup, steps, final_frac):
    """llm.c: linear warm-up over `warmup` steps, then cosine decay to lr * final_frac."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if steps <= warmup:
        return lr
    ratio = (step - warmup) / (steps - warmup)
    return lr * (final_frac + (1.0 - final_frac) * 0.5 * (1.0 + math.cos(math.pi * ratio)))
