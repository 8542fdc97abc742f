"""The process grid: which ranks form which pipeline, data-parallel and tensor-parallel
group. This is the only place that does rank arithmetic; everything else asks a Mesh.

Ranks are laid out as Megatron does, tensor-parallel fastest, then data-parallel, then
pipeline: rank = (stage * dp + replica) * tp + shard, so tensor-parallel peers are
neighbours (one node, the fastest links) and a pipeline's stages are dp * tp apart.

    world 8, pp=2 dp=2 tp=2:   stage 0: [[0 1]   stage 1: [[4 5]
                                          [2 3]]            [6 7]]   rows: replicas
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np


@dataclass(frozen=True)
class Mesh:
    rank: int = 0
    pp: int = 1
    dp: int = 1
    tp: int = 1
    hosts: tuple = ()  # each rank's host name, rank 0's first (empty: all on one host)

    @cached_property
    def grid(self) -> np.ndarray:
        """(pp, dp, tp) array of ranks."""
        return np.arange(self.size).reshape(self.pp, self.dp, self.tp)

    @property
    def size(self) -> int:
        return self.pp * self.dp * self.tp

    @cached_property
    def coords(self) -> tuple[int, int, int]:
        """(stage, replica, shard) of this rank."""
        return tuple(int(c) for c in np.argwhere(self.grid == self.rank)[0])

    @property
    def stage(self) -> int:
        return self.coords[0]

    @property
    def replica(self) -> int:
        """Which data-parallel replica: the batch rows this rank's pipeline computes."""
        return self.coords[1]

    @property
    def shard(self) -> int:
        """Which tensor-parallel shard of its stage this rank holds."""
        return self.coords[2]

    @property
    def pipeline(self) -> list[int]:
        """The ranks of this rank's pipeline, stage 0 first."""
        _, d, t = self.coords
        return [int(r) for r in self.grid[:, d, t]]

    def groups(self, axis: str) -> list[list[int]]:
        """Every group of the world along axis "pp", "dp" or "tp", members in order (a
        transport makes one communicator per group, each rank calling with its own)."""
        g = {"pp": self.grid.transpose(1, 2, 0), "dp": self.grid.transpose(0, 2, 1),
             "tp": self.grid}[axis]
        return [[int(r) for r in row] for row in g.reshape(-1, g.shape[-1])]

    def describe(self) -> list[tuple[str, str]]:
        """The run table's rows: which ranks form each pipeline and group."""
        return [(f"{name}", " ".join("[" + ",".join(map(str, g)) + "]" for g in self.groups(axis)))
                for name, axis in (("pipelines", "pp"), ("dp groups", "dp"), ("tp groups", "tp"))]

    def stage_rank(self, stage: int) -> int:
        """The rank holding `stage` of this rank's pipeline."""
        return self.pipeline[stage]

    def rank_at(self, stage: int, replica: int = 0, shard: int = 0) -> int:
        """The rank at those coordinates (the schedule says which stage holds the loss:
        replica 0, shard 0 of it reports it; after the data-parallel sum every replica's
        rank there holds the whole batch's loss)."""
        return int(self.grid[stage, replica, shard])

    def ring(self, step: int) -> tuple[int, int]:
        """The rank `step` stages on along this rank's pipeline, wrapping around (the
        interleaved and zero-bubble schedules send from the last stage to the first)."""
        return self.stage_rank((self.stage + step) % self.pp)

    def pairs(self) -> list[tuple[int, int]]:
        """Every point-to-point pair of the world, sorted (a transport that sets pairs up
        collectively, every rank walking this list, cannot wait in a cycle): (sender,
        receiver, kind) for "act" and "grad" both ways between ring neighbours of each
        pipeline (stage s and s + 1 mod pp; with two stages, each way once), and (lower,
        higher, "tied") for the tied-wte pair."""
        out = set()
        for d in range(self.dp):
            for t in range(self.tp):
                line = [int(r) for r in self.grid[:, d, t]]
                for a, b in zip(line, line[1:] + line[:1]):
                    out |= {(x, y, k) for x, y in ((a, b), (b, a)) if x != y
                            for k in ("act", "grad")}
                out |= {(line[0], line[-1], "tied")} if self.pp > 1 else set()
        return sorted(out)

    def host_of(self, rank: int) -> str:
        return self.hosts[rank] if self.hosts else ""

    @property
    def host(self) -> str:
        return self.host_of(self.rank)

    @property
    def local_rank(self) -> int:
        """This rank's index among the ranks of its host (a GPU is its host's own)."""
        return sum(self.host_of(r) == self.host for r in range(self.rank))

    @property
    def local_size(self) -> int:
        """How many ranks run on this rank's host (they share its cores and memory)."""
        return sum(self.host_of(r) == self.host for r in range(self.size))

    def device(self, count: int) -> int:
        """The GPU of this rank among `count` visible ones on its host: its local rank,
        round-robin when the host runs more ranks than it has GPUs."""
        return self.local_rank % count

