"""AdamW state over a stage's flat parameter buffer (m, v in the same layout), the
gradient's global norm and clipping, and llm.c's learning-rate schedule."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import DTypeLike

from ..comm.base import Transport
from ..precision import is_narrow, wide
from .layout import Part, replicated
from .stage import Stage


@dataclass
class AdamWConfig:
    lr: float = 3e-4
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 0.0  # the gradient is scaled to this global norm when above it; 0: off


class AdamW:
    """The update of a rank's stages (its model chunks: one unless the schedule gives a
    rank several) and the step count t (the only copy: backends see lr and the bias
    corrections, never t).

    zero: None, or ZeRO-1's replicas (parallel/data/zero.py): per stage this replica
    updates params[a:b] of zero.slices only, so m and v hold that slice; the replicas'
    gradients are reduce-scattered into it first (unless the runner's overlapped
    all-reduce has summed them already: the same member-order sums) and the updated
    slices all-gathered after.

    Every step measures the gradient's global norm (llm.c's, printed in the step line)
    over the whole grid, on the device, so a captured step keeps it: each rank adds the
    squares it counts (norm_ranges), then the sums go over the tensor, pipeline and (with
    ZeRO-1) data groups. With hp.grad_clip the update reads the gradient scaled by
    grad_clip / norm when the norm is above grad_clip."""

    def __init__(self, stages: list[Stage], hp: AdamWConfig | None,
                 transport: Transport | None = None, zero: Any = None) -> None:
        self.hp, self.t, self.transport, self.zero = hp, 0, transport, zero
        self.stages, self.slices = stages, zero.slices if zero else [None] * len(stages)
        # per stage {"m", "v"[, "summed": ZeRO-1's gradient slice][, "master": bf16's]}
        self.state = [{k: st.be.zeros(n, dt) for k, (n, dt) in
                       self.sizes(st.params.size, piece, st.dtype).items()}
                      for st, piece in zip(stages, self.slices)]
        self.counted = [norm_ranges(st, piece) for st, piece in zip(stages, self.slices)]
        # the global sum of squares, in float64 on every backend: a ZeRO-1 replica's slices
        # and an unsharded rank add in other orders, yet give the same float32 norm
        self.norm_sq = stages[0].be.zeros(1, np.float64)

    @staticmethod
    def sizes(n_params: int, piece: tuple[int, int] | None = None,
              dtype: DTypeLike = np.float32) -> dict[str, tuple[int, np.dtype]]:
        """{name: (elements, dtype)} of the state kept for a stage of n_params parameters of
        dtype: m and v in its wide type, with ZeRO-1 (piece: this replica's (a, b)) over
        that slice only, with the summed gradient slice the reduce-scatter fills; for a
        bf16 run also the fp32 master weights (llm.c's -w 1) of the same span."""
        n, w = n_params if piece is None else piece[1] - piece[0], wide(dtype)
        out = {"m": (n, w), "v": (n, w)}
        if piece is not None:
            out["summed"] = (n, np.dtype(dtype))
        if is_narrow(dtype):
            out["master"] = (n, w)
        return out

    def advance(self, lr: float | None = None) -> tuple:
        """Counts a step; returns its schedule (lr, 1 - beta1^t, 1 - beta2^t, t)."""
        self.t += 1
        hp = self.hp
        return (hp.lr if lr is None else lr, 1.0 - hp.beta1 ** self.t, 1.0 - hp.beta2 ** self.t,
                self.t)

    def step(self, lr: float | None = None, summed: bool = True,
             keep: Callable | None = None) -> bool:
        return self.apply(self.advance(lr), summed, keep)

    def apply(self, sched: tuple, summed: bool = True, keep: Callable | None = None) -> bool:
        """The update with schedule sched (inside a CUDA graph capture the backend reads it
        from the device instead, where the runner uploads each step's before replay).
        summed: the gradients are the replicas' sums already. keep(norm), when given (an
        eager step), is asked with the global norm whether to update (llm.c's outlier
        skipping: a skipped step counts, as llm.c's update takes t = step + 1); returns
        whether it updated."""
        hp = self.hp
        grads = [self._summed(st, piece, state, summed)
                 for st, piece, state in zip(self.stages, self.slices, self.state)]
        self._global_norm(grads)
        if keep is not None and not keep(self.grad_norm()):
            return False
        for st, piece, state, g in zip(self.stages, self.slices, self.state, grads):
            a, b = piece or (0, st.params.size)
            params = st.params[a:b]
            if params.size:
                st.be.adamw(params, g, state["m"], state["v"], sched, hp.beta1, hp.beta2,
                            hp.eps, hp.weight_decay, self.norm_sq, hp.grad_clip,
                            state.get("master"), rounding_salt(st.part), a)
            if piece is not None:
                self.zero.all_gather(params, st.params)
        return True

    def _summed(self, st, piece, state, summed):
        """The replicas' summed gradient the update reads: the stage's whole buffer, or with
        ZeRO-1 this replica's slice of it (reduce-scattered here unless summed)."""
        if piece is None:
            return st.grads
        if summed:
            return st.grads[piece[0]:piece[1]]
        self.zero.reduce_scatter(st.grads, state["summed"])
        return state["summed"]

    def _global_norm(self, grads):
        """norm_sq = the sum of squares of the whole model's gradient, on every rank."""
        acc = self.norm_sq
        acc.fill(0)
        for st, piece, g, ranges in zip(self.stages, self.slices, grads, self.counted):
            a0 = piece[0] if piece else 0
            for a, b in ranges:
                st.be.sum_squares(acc, g[a - a0:b - a0], a)
        for axis in ("tp", "pp") + (("dp",) if self.slices[0] is not None else ()):
            self.transport.all_reduce(acc, axis)

    def grad_norm(self) -> float:
        """The last step's global gradient norm (before clipping), on the host."""
        return math.sqrt(float(self.stages[0].be.to_host(self.norm_sq)[0]))

    KEPT = ("m", "v", "master")  # what a checkpoint keeps (master: bf16 runs only)

    def stage_state(self) -> list[dict[str, np.ndarray]]:
        """Per stage, {name: host fp32 array over its whole flat buffer} of KEPT (ZeRO-1:
        the replicas' slices all-gathered; collective over the dp group)."""
        out = []
        for st, piece, state in zip(self.stages, self.slices, self.state):
            kept = {}
            for k in (k for k in self.KEPT if k in state):
                x = state[k]
                if piece is not None:
                    whole = st.be.zeros(st.params.size, x.dtype)
                    self.zero.all_gather(x, whole)
                    x = whole
                kept[k] = np.array(st.be.to_host(x), np.float32)
            out.append(kept)
        return out

    def load_stage_state(self, states: list[dict]) -> None:
        """states: per stage, {name: host array over its whole flat buffer} of KEPT (without
        "master", a bf16 run's master weights are the stage's parameters as given); this
        rank keeps its slice."""
        for st, piece, mine, theirs in zip(self.stages, self.slices, self.state, states):
            a, b = piece or (0, st.params.size)
            for k, x in mine.items():
                if k in theirs:
                    st.be.upload(x, theirs[k][a:b])


def rounding_salt(part: Part) -> int:
    """Which noise a bf16 update's stochastic rounding draws on a stage: the tensor-parallel
    shard's. Not the layers': the embedding's and the head's copies of the tied wte (both at
    offset 0 of their stages' buffers) must round alike, as must replicas (ZeRO-1 slices
    use their offset in the stage's buffer)."""
    return part.shard


def norm_ranges(st: Stage, piece: tuple[int, int] | None = None) -> list[tuple[int, int]]:
    """[a, b) ranges of stage st's flat gradient buffer whose squares this rank adds to the
    global norm, so that over the grid each parameter counts once: the tied wte on the
    embedding's stage only (the head's copy holds the same sum), the tensors every
    tensor-parallel shard holds whole on shard 0 only, with ZeRO-1 this replica's slice
    piece only (without it each replica counts its whole, equal, gradient alone)."""
    lo, hi = piece or (0, st.layout.size)
    skip = replicated(st.shape, st.part) if st.part.shard else set()
    out = []
    for name, shape, off in zip(st.layout.names, st.layout.shapes, st.layout.offsets):
        if (name == "wte" and not st.embed) or name in skip:
            continue
        a, b = max(lo, off), min(hi, off + math.prod(shape))
        if a >= b:
            continue
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def lr_at(step: int, lr: float, warmup: int, steps: int, final_frac: float,
          schedule: str = "cosine") -> float:
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
