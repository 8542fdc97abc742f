"""What a rank's runner will allocate, from the allocators' own sizes (Stage.sizes,
AdamW.sizes), and the check against the memory there is, made before anything is
allocated. The run table shows the same figures."""
from __future__ import annotations

import numpy as np
from numpy.typing import DTypeLike

from .. import CupyGPTError
from ..backends.protocol import Backend
from ..comm.base import Transport
from ..model.layout import stage_shape
from ..model.optim import AdamW
from ..model.shape import GPT2Config
from ..model.stage import Stage
from .mesh import Mesh
from .pipeline.plan import StepPlan

GiB = 2 ** 30


def memory_plan(shape: GPT2Config, plan: StepPlan, be: Backend, dtype: DTypeLike,
                with_adamw: bool, zero_slices: list | None = None,
                recompute: int = 0) -> dict[str, int]:
    """Bytes this rank's stages (and AdamW's state for them) will allocate, by kind:
    params, grads, activations (every slot), scratch, optimizer; and workspace, the
    backend's kept temporaries (shared by the stages: the largest one's)."""
    out = dict.fromkeys(("params", "grads", "activations", "scratch", "optimizer"), 0)
    out["workspace"] = max(be.workspace_bytes(stage_shape(shape, plan.mb_rows, plan.seq, part),
                                              dtype) for part in plan.parts)
    for i, (part, slots) in enumerate(zip(plan.parts, plan.slots)):
        sizes = Stage.sizes(shape, batch=plan.mb_rows, seq=plan.seq, part=part, slots=slots,
                            split=plan.split_backward, recompute=recompute, dtype=dtype)
        for k, n in sizes.items():
            out[k] += n
        if with_adamw:
            zp = zero_slices[i] if zero_slices else None
            n_params = sizes["params"] // np.dtype(dtype).itemsize
            out["optimizer"] += sum(n * np.dtype(dt).itemsize
                                    for n, dt in AdamW.sizes(n_params, zp, dtype).values())
    return out


def check_memory(memory: dict[str, int], be: Backend, transport: Transport, mesh: Mesh,
                 fix: str | None = None) -> None:
    """Collective. Refuses, on every rank alike, when the ranks sharing a memory (a GPU, or
    the host's RAM for the CPU) need more than it has free: one line with both figures and
    what to lower (fix: what the command can lower; default: a training step's)."""
    need = sum(memory.values())
    every = transport.bcast(transport.gather((be.memory_domain(), be.device_memory(), need,
                                              mesh.rank)))
    totals = {}
    for domain, free, n, rank in every:
        total, _, ranks = totals.get(domain, (0, free, []))
        totals[domain] = (total + n, free, ranks + [rank])
    for domain, (total, free, ranks) in totals.items():
        if free is not None and total > free:
            mine = ", ".join(f"{k} {v / GiB:.2f}" for k, v in memory.items() if v)
            who = f"rank {ranks[0]} needs" if len(ranks) == 1 else \
                f"the {len(ranks)} ranks sharing {be.memory_name} need"
            fix = fix or _step_fix(memory, need)
            raise CupyGPTError(
                f"out of memory at start: {who} {total / GiB:.2f} GiB (rank {mesh.rank}'s, "
                f"in GiB: {mine}) and {free / GiB:.2f} GiB of {be.memory_name} is free; "
                f"{fix}")


def _step_fix(memory, need):
    """What lowers a step's memory: the batch where activations dominate, else the
    model's share per rank."""
    per_token = memory["activations"] + memory["scratch"] + memory["workspace"]
    return ("lower the batch size or sequence length, use more micro-batches, or more "
            "pipeline stages or tensor-parallel ranks" if 2 * per_token > need else
            "split the model over more pipeline stages or tensor-parallel ranks, shard "
            "AdamW's state over replicas (ZeRO-1), or take a smaller model")
