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
    """The update and its step count t (the only copy: backends see lr and the bias
    corrections, never t)."""

    def __init__(self, stage, hp):
        self.stage, self.hp, self.t = stage, hp, 0
        self.m = stage.be.zeros(stage.params.size, stage.dtype)
        self.v = stage.be.zeros(stage.params.size, stage.dtype)

    def advance(self, lr=None):
        """Counts a step; returns its schedule (lr, 1 - beta1^t, 1 - beta2^t)."""
        self.t += 1
        hp = self.hp
        return (hp.lr if lr is None else lr, 1.0 - hp.beta1 ** self.t, 1.0 - hp.beta2 ** self.t)

    def step(self, lr=None):
        self.apply(self.advance(lr))

    def apply(self, sched):
        """The update with schedule sched (inside a CUDA graph capture the backend reads it
        from the device instead, where the runner uploads each step's before replay)."""
        hp = self.hp
        self.stage.be.adamw(self.stage.params, self.stage.grads, self.m, self.v, sched,
                            hp.beta1, hp.beta2, hp.eps, hp.weight_decay)


def lr_at(step, lr, warmup, steps, final_frac):
    """llm.c: linear warm-up over `warmup` steps, then cosine decay to lr * final_frac."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if steps <= warmup:
        return lr
    ratio = (step - warmup) / (steps - warmup)
    return lr * (final_frac + (1.0 - final_frac) * 0.5 * (1.0 + math.cos(math.pi * ratio)))
