"""The step plan, pure data from the schedule and the mesh: how the model's layers are cut
into chunks (balanced by counted cost), and what one rank holds and does in a step.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from ... import CupyGPTError
from ...model.layout import Part
from ...model.shape import GPT2Config
from ..mesh import Mesh
from ..tensor.sharding import TensorShard
from .schedule import SCHEDULES, Op, chunks_per_rank, forward_only, holders, placement, slot_plan


def costs(shape: GPT2Config, T: int) -> tuple[int, int]:
    """(a block's, the head's) forward FLOPs per token, the counted cost a split balances
    (backward is about twice forward everywhere, so it balances alike): a block's matmuls
    24 C^2 and its attention 4 T C; the head's logits 2 C Vp and its softmax (~4 per logit).
    The embedding is a lookup: nothing."""
    return 24 * shape.C ** 2 + 4 * T * shape.C, 2 * shape.C * shape.Vp + 4 * shape.Vp


def stage_shares(shape: GPT2Config, T: int, counts: Sequence[int] | None) -> list[float]:
    """Each stage's share of the step's counted cost (the last one carries the head)."""
    block, head = costs(shape, T)
    c = [n * block + (head if i == len(counts) - 1 else 0) for i, n in enumerate(counts)]
    return [x / sum(c) for x in c]


def plan_split(shape: GPT2Config, T: int, p: int, split: Sequence[int] | None = None,
               ranks: int | None = None) -> tuple[int, ...]:
    """Layer counts per stage: `split` ("6,6"), or balanced by counted cost: the last stage
    carries the LM head (on GPT-2's vocab as much as several blocks), so it takes fewer
    blocks; the others share the rest evenly, earlier ones taking the remainder."""
    L = shape.L
    if p > L:
        raise CupyGPTError(f"{p} pipeline stages but the model has {L} layers; use at most "
                           f"{L} ranks")
    if split:
        try:
            counts = [int(s) for s in split.split(",")]
        except ValueError:
            raise CupyGPTError("not a comma-separated list of layer counts, e.g. 6,6",
                               "split", split) from None
        if len(counts) != p:
            n = len(counts)
            raise CupyGPTError(
                f"{n} stages but {p} ranks; give one layer count per rank"
                if ranks in (None, p) else f"{n} counts but {p} model chunks ({ranks} ranks "
                f"x {p // ranks}); give one layer count per chunk", "split", split)
        if sum(counts) != L or min(counts) < 1:
            raise CupyGPTError(f"counts must be positive and sum to the model's {L} layers",
                               "split", split)
        return counts
    if p == 1:
        return [L]

    def even(n, k):
        return [n // k + (1 if r < n % k else 0) for r in range(k)]
    best = min(range(1, L - p + 2),
               key=lambda n: (max(stage_shares(shape, T, even(L - n, p - 1) + [n])), -n))
    return even(L - best, p - 1) + [best]


@dataclass(frozen=True)
class StepPlan:
    """What one rank does in a step, as data (no backend, no transport): the model chunks it
    holds and their Parts, its action lists, activation slots, and whom it talks to. Built
    by `plan_step` from the schedule and the mesh; the runner, the memory estimate and the
    tests read it.

    Rows: the step's batch is B rows; replica d computes rows [d * rows, (d + 1) * rows),
    in micro_batches of mb_rows each.
    """
    schedule: str
    micro_batches: int
    batch: int                  # B: the whole step's rows, over every replica
    seq: int                    # T
    rows: int                   # this replica's rows: B / dp
    mb_rows: int                # a micro-batch's rows: rows / micro_batches
    counts: tuple               # layers per model chunk, in model order
    chunks: tuple               # the model chunks this rank holds (its chunk 0 first)
    parts: tuple                # a Part per held chunk
    train: tuple                # action lists: a training step,
    evaluate: tuple             # a forward-only pass over every micro-batch,
    first: tuple                # and over the first micro-batch alone (sampling)
    slots: tuple                # activation slots per held chunk (most in flight at once)
    split_backward: bool        # the schedule splits backward into B and W
    last_backward: dict         # held chunk -> micro-batch of its step's last backward
    next: tuple                 # per held chunk: where its output goes, where its
    prev: tuple                 # input comes from: a rank, ("local", held chunk), or None
    loss_rank: int              # the rank reporting the loss (replica 0, shard 0 of the head)
    tied_peer: Optional[int]    # the rank holding wte's other end, when not this one
    replica: int

    def replica_rows(self) -> slice:
        """This replica's rows of the step's batch."""
        return slice(self.replica * self.rows, (self.replica + 1) * self.rows)

    def mb_slice(self, mb: int) -> slice:
        """Micro-batch mb's rows of this replica's rows."""
        return slice(mb * self.mb_rows, (mb + 1) * self.mb_rows)

    def global_rows(self, mb: int) -> slice:
        """Micro-batch mb's rows of the step's batch."""
        a = self.replica * self.rows + mb * self.mb_rows
        return slice(a, a + self.mb_rows)


def plan_step(shape: GPT2Config, mesh: Mesh, *, batch: int, seq: int, micro_batches: int = 1,
              schedule: str = "1f1b", virtual: int | None = None,
              counts: Sequence[int] | None = None) -> StepPlan:
    """The StepPlan of mesh.rank. counts: layers per model chunk (plan_split's; None:
    balanced)."""
    p, r, m = mesh.pp, mesh.stage, micro_batches
    v = chunks_per_rank(schedule, virtual)
    k_all = p * v
    counts = tuple(counts or plan_split(shape, seq, k_all))
    chunks = placement(schedule, p, v, r)
    train = SCHEDULES[schedule](p, m, r, v)
    evaluate = forward_only(p, m, r, v, schedule)
    first = forward_only(p, 1, r, v, schedule)
    split = TensorShard(mesh.tp, mesh.shard) if mesh.tp > 1 else None
    parts = tuple(Part(sum(counts[:k]), sum(counts[:k + 1]), k == 0, k == k_all - 1, split)
                  for k in chunks)
    slots = tuple(max(slot_plan([a for a in acts if a.chunk == c])[0] for acts in (train, evaluate))
                  for c in range(len(chunks)))
    at = holders(schedule, p, v)  # model chunk -> (rank, its chunk index there)
    embed_rank, head_rank = at[0][0], at[k_all - 1][0]
    ends = (embed_rank, head_rank)

    def peer(k):
        if not 0 <= k < k_all:
            return None
        rk, c = at[k]
        return ("local", c) if rk == r else mesh.stage_rank(rk)
    rows = batch // mesh.dp
    return StepPlan(
        schedule=schedule, micro_batches=m, batch=batch, seq=seq, rows=rows,
        mb_rows=rows // m, counts=counts, chunks=tuple(chunks), parts=parts,
        train=tuple(train), evaluate=tuple(evaluate), first=tuple(first), slots=slots,
        split_backward=any(a.op == Op.BWD_WEIGHT for a in train),
        last_backward={a.chunk: a.mb for a in train if a.op in (Op.BWD, Op.BWD_WEIGHT)},
        next=tuple(peer(k + 1) for k in chunks), prev=tuple(peer(k - 1) for k in chunks),
        loss_rank=mesh.rank_at(head_rank),
        tied_peer=(mesh.stage_rank(ends[1 - ends.index(r)])
                   if r in ends and embed_rank != head_rank else None),
        replica=mesh.replica)
