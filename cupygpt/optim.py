"""AdamW state over a stage's flat parameter buffer (m, v in the same layout), and
llm.c's learning-rate schedule."""
import math
from dataclasses import dataclass

import numpy as np


@dataclass
class AdamWConfig:
    lr: float = 3e-4
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0


class AdamW:
    """The update and its step count t (the only copy: backends see lr and the bias
    corrections, never t).

    part=(a, b) is ZeRO-1 (llm.c's -z 1): this replica updates params[a:b] only, so m and v
    hold that slice; the replicas' gradients are reduce-scattered into it first and the
    updated slices all-gathered after, through the transport's "dp" group. The update is
    elementwise, so the parameters are bit-identical to the unsharded step's."""

    def __init__(self, stage, hp, transport=None, part=None):
        self.stage, self.hp, self.t, self.tr, self.part = stage, hp, 0, transport, part
        be, n = stage.be, stage.params.size if part is None else part[1] - part[0]
        self.m, self.v = be.zeros(n, stage.dtype), be.zeros(n, stage.dtype)
        self.gpart = be.zeros(n, stage.dtype) if part is not None else None

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
        hp, st = self.hp, self.stage
        params, grads = st.params, st.grads
        if self.part is not None:
            a, b = self.part
            self.tr.reduce_scatter(st.grads, self.gpart, "dp")
            params, grads = st.params[a:b], self.gpart
        if params.size:
            st.be.adamw(params, grads, self.m, self.v, sched, hp.beta1, hp.beta2, hp.eps,
                        hp.weight_decay)
        if self.part is not None:
            self.tr.all_gather(params, st.params, "dp")

    def stage_state(self):
        """(m, v) over the whole stage's flat buffer, on the host (ZeRO-1: the replicas'
        slices all-gathered; collective over the dp group)."""
        out = []
        for x in (self.m, self.v):
            if self.part is not None:
                whole = self.stage.be.zeros(self.stage.params.size, self.stage.dtype)
                self.tr.all_gather(x, whole, "dp")
                x = whole
            out.append(np.array(self.stage.be.to_host(x), np.float32))
        return out

    def load_stage_state(self, m, v):
        """m, v: host arrays over the whole stage's flat buffer; this rank keeps its slice."""
        a, b = self.part or (0, self.stage.params.size)
        self.stage.be.upload(self.m, m[a:b])
        self.stage.be.upload(self.v, v[a:b])

    def state_bytes(self):
        """Bytes of m and v on this rank (1/dp of the stage's with ZeRO-1)."""
        return self.m.nbytes + self.v.nbytes


def lr_at(step, lr, warmup, steps, final_frac):
    """llm.c: linear warm-up over `warmup` steps, then cosine decay to lr * final_frac."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if steps <= warmup:
        return lr
    ratio = (step - warmup) / (steps - warmup)
    return lr * (final_frac + (1.0 - final_frac) * 0.5 * (1.0 + math.cos(math.pi * ratio)))
