"""A runner's settings: what each of its steps is, made once where a command starts
(Session.step_settings: the --dtype name turned into its NumPy type there, the pipeline
and grid flags from the command's config) and handed to the Runner as one frozen object."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..model.optim import AdamWConfig


@dataclass(frozen=True)
class StepSettings:
    batch: int                      # the step's rows over every replica (each computes
    seq: int                        # batch / dp of them, in micro_batches); T
    dtype: np.dtype = np.dtype(np.float32)  # the run's storage type (precision.DTYPES')
    adamw: Optional[AdamWConfig] = None     # None: no optimizer (eval, sample)
    recompute: int = 0              # llm.c's -r: what backward makes again (layout.RECOMPUTED)
    micro_batches: int = 1
    schedule: str = "1f1b"
    virtual: Optional[int] = None   # model chunks per rank (None: the schedule's)
    counts: Optional[tuple] = None  # layers per model chunk (plan_split's, checked; None:
    #                                 balanced)
    zero: bool = False              # AdamW's state sharded across the replicas (ZeRO-1)
    overlap: bool = True            # the replicas' gradient sum during the last backward
    graphs: bool = False            # --graphs: steps as CUDA graphs where they can be
    trace: bool = False             # every action recorded from the first (--trace)
    micro_steps: int = 1            # batches a step accumulates (gradient accumulation)
    gated: bool = False             # the outlier gate asks before each update (-sl, -sg)
    attention: Optional[str] = None  # the backend attention the run takes (use_attention's
    #                                  kind; None: as it is)

    def __post_init__(self):  # a NumPy scalar type given (np.float64) is held as its dtype
        object.__setattr__(self, "dtype", np.dtype(self.dtype))

    @property
    def graphable(self) -> bool:
        """Whether the steps asked can be captured: --graphs, and none of a trace (it marks
        each action), gradient accumulation (it feeds each batch) or the outlier gate (the
        update waits on the host's answer). The runner adds what backend and transport
        allow."""
        return self.graphs and not self.trace and self.micro_steps == 1 and not self.gated
