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
    """The update of a rank's stages (its model chunks: one unless the schedule gives a
    rank several) and the step count t (the only copy: backends see lr and the bias
    corrections, never t).

    slices: None, or per stage (a, b), ZeRO-1 (llm.c's -z 1): this replica updates
    params[a:b] only, so m and v hold that slice; the replicas' gradients are
    reduce-scattered into it first (unless the runner's overlapped all-reduce has summed
    them already: the same member-order sums) and the updated slices all-gathered after,
    through the transport's "dp" group. The update is elementwise, so the parameters are
    bit-identical to the unsharded step's."""

    def __init__(self, stages, hp, transport=None, slices=None):
        self.hp, self.t, self.tr = hp, 0, transport
        self.stages, self.slices = stages, slices or [None] * len(stages)
        # per stage (m, v, the summed gradient slice with ZeRO-1)
        self.state = [[st.be.zeros(n, st.dtype) for n in self.sizes(st.params.size, piece)]
                      for st, piece in zip(stages, self.slices)]

    @staticmethod
    def sizes(n_params, piece=None):
        """Elements of each state buffer kept for a stage of n_params parameters: m and v,
        and with ZeRO-1 (piece: this replica's (a, b)) their slice and the summed gradient
        slice the reduce-scatter fills."""
        return [n_params] * 2 if piece is None else [piece[1] - piece[0]] * 3

    def advance(self, lr=None):
        """Counts a step; returns its schedule (lr, 1 - beta1^t, 1 - beta2^t)."""
        self.t += 1
        hp = self.hp
        return (hp.lr if lr is None else lr, 1.0 - hp.beta1 ** self.t, 1.0 - hp.beta2 ** self.t)

    def step(self, lr=None, summed=True):
        self.apply(self.advance(lr), summed)

    def apply(self, sched, summed=True):
        """The update with schedule sched (inside a CUDA graph capture the backend reads it
        from the device instead, where the runner uploads each step's before replay).
        summed: the gradients are the replicas' sums already."""
        hp = self.hp
        for st, piece, (m, v, *summed_slice) in zip(self.stages, self.slices, self.state):
            params, grads = st.params, st.grads
            if piece is not None:
                a, b = piece
                if not summed:
                    self.tr.reduce_scatter(st.grads, summed_slice[0], "dp")
                params, grads = st.params[a:b], st.grads[a:b] if summed else summed_slice[0]
            if params.size:
                st.be.adamw(params, grads, m, v, sched, hp.beta1, hp.beta2, hp.eps,
                            hp.weight_decay)
            if piece is not None:
                self.tr.all_gather(params, st.params, "dp")

    def stage_state(self):
        """Per stage, (m, v) over its whole flat buffer, on the host (ZeRO-1: the
        replicas' slices all-gathered; collective over the dp group)."""
        out = []
        for st, piece, state in zip(self.stages, self.slices, self.state):
            both = []
            for x in state[:2]:
                if piece is not None:
                    whole = st.be.zeros(st.params.size, st.dtype)
                    self.tr.all_gather(x, whole, "dp")
                    x = whole
                both.append(np.array(st.be.to_host(x), np.float32))
            out.append(both)
        return out

    def load_stage_state(self, states):
        """states: per stage, host (m, v) over its whole flat buffer; this rank keeps its
        slice."""
        for st, piece, mine, theirs in zip(self.stages, self.slices, self.state, states):
            a, b = piece or (0, st.params.size)
            for x, host in zip(mine, theirs):
                st.be.upload(x, host[a:b])

    def state_bytes(self):
        """Bytes of the state on this rank (m and v, with ZeRO-1 1/dp of them and the summed
        gradient slice)."""
        return sum(x.nbytes for state in self.state for x in state)


def lr_at(step, lr, warmup, steps, final_frac, schedule="cosine"):
    """llm.c's schedules at `step` of `steps`: cosine, linear (warm up linearly over `warmup`
    steps, then decay to lr * final_frac along a half cosine or a line), wsd (warm up, hold,
    then over the last 20% of the steps decay as 1 - sqrt of the way to lr * final_frac)
    and constant (lr throughout, as llm.c's: no warm-up)."""
    if schedule == "constant":
        return lr
    if step < warmup:
        return lr * (step + 1) / warmup
    low = lr * final_frac
    if schedule == "wsd":
        start = int(0.8 * steps)
        if step < start:
            return lr
        return low + (1.0 - math.sqrt((step - start) / (steps - start))) * (lr - low)
    if steps <= warmup:
        return lr
    ratio = (step - warmup) / (steps - warmup)
    if schedule == "linear":
        return lr - ratio * (lr - low)
    return lr * (final_frac + (1.0 - final_frac) * 0.5 * (1.0 + math.cos(math.pi * ratio)))


LR_SCHEDULES = ("cosine", "linear", "constant", "wsd")
