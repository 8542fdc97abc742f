"""What a run is: one frozen config per command, checked by its validate() before anything is allocated.

The CLI builds a config from its flags (each field is named as the flag's parameter) and
calls validate(backend, world), which resolves what depends on the device (the default
model and T) once, and raises CupyGPTError naming the field at fault; the CLI shows it as
its flag. Checks that need the files' contents beyond their headers (token ranges, the
checkpoint's identity) stay with the readers.
"""
import glob
import math
import os
from dataclasses import dataclass, field, replace
from typing import Optional

from . import CupyGPTError
from .checkpoint import resolve as resolve_checkpoint
from .files import model_shape, read_state_header
from .parallel.pipeline.plan import plan_split
from .parallel.pipeline.schedule import SCHEDULES, chunks_per_rank
from .shape import preset


# --- run configs -------------------------------------------------------------------------

@dataclass(frozen=True)
class Device:
    """Where a command computes and how its ranks talk."""
    backend: str = "auto"
    tf32: Optional[bool] = None     # None: the command's default (train on, verify off)
    transport: str = "auto"
    peer_timeout: float = 300.0

    def validate(self, be, world):
        positive(self, "peer_timeout")
        if world > 1 and self.transport != "auto" and self.transport not in be.TRANSPORTS:
            raise CupyGPTError(f"the {be.name} backend's arrays travel by "
                               f"{', '.join(be.TRANSPORTS)} only", "transport", self.transport)
        return self


@dataclass(frozen=True)
class Grid:
    """How many ranks split the model each way: data-parallel replicas (dp), tensor-parallel
    shards of each stage (tp), pipeline stages (pp); dp * tp * pp = the ranks. An omitted
    degree is inferred: the pipeline takes what dp and tp leave, so a plain mpiexec -n 2 is
    a 2-stage pipeline. zero=1 shards AdamW's state across the replicas (llm.c's -z 1)."""
    dp: Optional[int] = None
    tp: Optional[int] = None
    pp: Optional[int] = None
    zero: int = 0
    overlap: bool = True            # the replicas' gradient sum during the last backward

    def validate(self, shape, world):
        for name in ("dp", "tp", "pp"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise CupyGPTError("must be at least 1", name, v)
        dp, tp, pp = self.dp, self.tp, self.pp
        if pp is None:
            dp, tp = dp or 1, tp or 1
            pp = world // (dp * tp)
        elif dp is None:
            tp = tp or 1
            dp = world // (tp * pp)
        elif tp is None:
            tp = world // (dp * pp)
        if dp * tp * pp != world or min(dp, tp, pp) < 1:
            given = " x ".join(f"--{k} {getattr(self, k)}" for k in ("dp", "tp", "pp")
                               if getattr(self, k) is not None)
            raise CupyGPTError(f"{given} does not multiply out to the {world} rank(s) of this "
                               f"launch; dp x tp x pp must equal the number of ranks")
        if shape.NH % tp:
            raise CupyGPTError(f"each tensor-parallel rank holds whole heads: {tp} must divide "
                               f"the model's {shape.NH} heads", "tp", tp)
        if self.zero not in (0, 1):
            raise CupyGPTError("0 (off) or 1 (AdamW state sharded across --dp replicas)",
                               "zero", self.zero)
        if self.zero and dp == 1:
            raise CupyGPTError("shards the optimizer state across data-parallel replicas, "
                               "and there is one (--dp 1); add --dp 2 or more, or leave it "
                               "out", "zero", self.zero)
        return replace(self, dp=dp, tp=tp, pp=pp)

    def rows(self, batch):
        """Each replica computes batch / dp rows of the step's batch."""
        if batch % self.dp:
            raise CupyGPTError(f"must divide the batch size {batch}: each data-parallel "
                               f"replica takes an equal part of it", "dp", self.dp)
        return batch // self.dp


@dataclass(frozen=True)
class Pipeline:
    """How one step is cut across the pipeline's stages and micro-batches."""
    micro_batches: int = 1
    schedule: str = "1f1b"
    virtual_stages: Optional[int] = None  # model chunks per rank; None: the schedule's
    split: Optional[str] = None     # "6,6"; validate resolves it into counts
    counts: tuple = ()              # layers per model chunk, in model order

    def validate(self, shape, seq, stages, batch):
        if self.micro_batches < 1 or batch % self.micro_batches:
            raise CupyGPTError(f"must divide the batch size {batch} (per data-parallel "
                               f"replica)", "micro_batches", self.micro_batches)
        if self.schedule not in SCHEDULES:
            raise CupyGPTError(f"unknown; use {' or '.join(SCHEDULES)}", "schedule",
                               self.schedule)
        v = chunks_per_rank(self.schedule, self.virtual_stages)
        SCHEDULES[self.schedule](stages, self.micro_batches, 0, v)  # (refuses what it can't do)
        if v > 1 and stages * v > shape.L:  # (one chunk a rank: plan_split says it)
            raise CupyGPTError(f"{stages * v} model chunks ({stages} stage(s) x {v}) but the "
                               f"model has {shape.L} layers; a chunk needs one", "virtual_stages",
                               v)
        return replace(self, virtual_stages=v,
                       counts=tuple(plan_split(shape, seq, stages * v, self.split, stages)))


def default(value, fallback):
    return fallback if value is None else value


def positive(cfg, *names, zero_ok=False):
    for name in names:
        v = getattr(cfg, name)
        if not (v >= 0 if zero_ok else v > 0) or not math.isfinite(v):
            raise CupyGPTError("must not be negative" if zero_ok else "must be positive",
                               name, v)


def fits(seq, shape):
    if seq > shape.maxT:
        raise CupyGPTError(f"longer than the model's maxT={shape.maxT}; lower it", "seq", seq)


def make_dir(name, path):
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise CupyGPTError(f"cannot create this directory ({e.strerror})", name, path) from None
    if not os.access(path, os.W_OK):
        raise CupyGPTError("this directory is not writable", name, path)


def trace_dir(cfg):
    """--trace's directory exists (made) and is writable, before the run starts."""
    if cfg.trace:
        make_dir("trace", os.path.dirname(os.path.abspath(cfg.trace)))


def existing(name, path):
    if not os.path.isfile(path):
        raise CupyGPTError("no such file", name, path)


@dataclass(frozen=True)
class TrainConfig:
    train_pattern: str
    val_pattern: str
    tokenizer: str
    init: Optional[str] = None      # None: the backend's DEFAULT_RUN
    out: str = "out"
    batch: int = 4
    seq: Optional[int] = None       # None: the backend's DEFAULT_RUN
    lr: float = 1e-3
    warmup: int = 10
    final_lr_frac: float = 0.1
    steps: int = 60
    val_every: int = 20
    val_batches: int = 4
    sample_every: Optional[int] = None  # None: at the end only; 0: never
    gen_tokens: int = 48
    weight_decay: float = 0.0
    seed: int = 1337
    checkpoint_every: int = 0
    keep: int = 2
    resume: Optional[str] = None
    log_file: Optional[str] = None
    graphs: bool = True
    trace: Optional[str] = None     # Chrome trace-event JSON of every rank's actions
    device: Device = field(default_factory=Device)
    pipeline: Pipeline = field(default_factory=Pipeline)
    grid: Grid = field(default_factory=Grid)

    def validate(self, be, world):
        """Returns the config with every default resolved and the model's shape (`shape`)."""
        init, seq = be.DEFAULT_RUN
        c = replace(self, init=default(self.init, init), seq=default(self.seq, seq),
                    sample_every=default(self.sample_every, self.steps))
        positive(c, "batch", "seq", "lr")
        positive(c, "steps", "val_every", "val_batches", "sample_every", "gen_tokens",
                 "warmup", "checkpoint_every", "weight_decay", zero_ok=True)
        if c.keep < 1:
            raise CupyGPTError("keep at least one checkpoint", "keep", c.keep)
        if c.resume:
            c = replace(c, resume=resolve_checkpoint(c.resume))
            if self.init is not None:
                raise CupyGPTError(f"a resumed run continues its checkpoint's own model "
                                   f"({os.path.join(c.resume, 'model.bin')}), not this one; "
                                   f"leave it out to resume, or start afresh without resuming",
                                   "init", self.init)
            shape = model_shape(os.path.join(c.resume, "model.bin"))
        else:
            shape = model_shape(c.init)
        fits(c.seq, shape)
        for name in ("train_pattern", "val_pattern"):
            if getattr(c, name) and not glob.glob(getattr(c, name)):
                raise CupyGPTError("no token shard matches this pattern; run `prepare` or "
                                   "fix the path", name, getattr(c, name))
        c = replace(c, device=c.device.validate(be, world), grid=c.grid.validate(shape, world))
        c = replace(c, pipeline=c.pipeline.validate(shape, c.seq, c.grid.pp,
                                                    c.grid.rows(c.batch)))
        trace_dir(c)
        make_dir("out", c.out)  # last: nothing is left behind when a check above fails
        return c, shape


@dataclass(frozen=True)
class VerifyConfig:
    model: str
    state: str
    steps: int = 10
    lr: float = 1e-4
    weight_decay: float = 0.01
    expected: Optional[str] = None
    dtype: str = "float32"
    trace: Optional[str] = None
    device: Device = field(default_factory=Device)
    pipeline: Pipeline = field(default_factory=Pipeline)
    grid: Grid = field(default_factory=Grid)

    def validate(self, be, world):
        positive(self, "steps", "lr")
        positive(self, "weight_decay", zero_ok=True)
        if self.expected:
            existing("expected", self.expected)
        shape = model_shape(self.model)
        B, T = read_state_header(self.state, shape)
        grid = self.grid.validate(shape, world)
        trace_dir(self)
        return replace(self, device=self.device.validate(be, world), grid=grid,
                       pipeline=self.pipeline.validate(shape, T, grid.pp, grid.rows(B))), shape


@dataclass(frozen=True)
class SampleConfig:
    model: str
    tokenizer: str
    prompt: str = ""
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: Optional[int] = None
    seed: int = 1337
    kv_cache: bool = True
    device: Device = field(default_factory=Device)
    pipeline: Pipeline = field(default_factory=Pipeline)  # even split; one row, one pass
    grid: Grid = field(default_factory=Grid)              # a pipeline of every rank

    def validate(self, be, world):
        positive(self, "max_new_tokens", "temperature", zero_ok=True)
        shape = model_shape(self.model)
        if self.top_k is not None and not 0 < self.top_k <= shape.V:
            raise CupyGPTError(f"must be between 1 and the vocab size {shape.V}", "top_k",
                               self.top_k)
        return replace(self, device=self.device.validate(be, world),
                       grid=self.grid.validate(shape, world),
                       pipeline=self.pipeline.validate(shape, shape.maxT, world, 1)), shape


@dataclass(frozen=True)
class BenchConfig:
    data: str
    init: Optional[str] = None      # None: the backend's DEFAULT_RUN
    batch: int = 4
    seq: Optional[int] = None
    steps: int = 20
    warmup: int = 3
    graphs: bool = True
    profile: bool = False
    comm: bool = False              # the transports' collectives and handoff instead
    trace: Optional[str] = None
    device: Device = field(default_factory=Device)
    pipeline: Pipeline = field(default_factory=Pipeline)  # one process: one stage
    grid: Grid = field(default_factory=Grid)

    def validate(self, be, world):
        init, seq = be.DEFAULT_RUN
        c = replace(self, init=default(self.init, init), seq=default(self.seq, seq))
        positive(c, "batch", "seq", "steps")
        positive(c, "warmup", zero_ok=True)
        shape = preset(c.init)
        fits(c.seq, shape)
        c = replace(c, device=c.device.validate(be, world))
        if c.comm:  # every rank in one group: the collectives span the world
            if world < 2:
                raise CupyGPTError("bench --comm measures communication between ranks: run "
                                   "it under mpiexec -n 2 or more")
            return replace(c, grid=Grid(dp=world).validate(shape, world)), shape
        c = replace(c, grid=c.grid.validate(shape, world))
        trace_dir(c)
        return replace(c, pipeline=c.pipeline.validate(shape, c.seq, c.grid.pp,
                                                       c.grid.rows(c.batch))), shape
