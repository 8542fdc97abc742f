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
import tempfile
from dataclasses import dataclass, field, replace
from typing import Optional

from . import CupyGPTError
from .checkpoint import check_resume, listed, resolve as resolve_checkpoint
from .files import is_model_file, model_shape, read_expected, read_state_header
from .parallel.pipeline.plan import plan_split
from .parallel.pipeline.schedule import SCHEDULES, chunks_per_rank
from .shape import PRESETS, preset


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
        if world == 1 and self.transport != "auto":
            raise CupyGPTError("carries arrays between ranks, and this is one process; run "
                               "under mpiexec -n 2 or more, or leave it out", "transport",
                               self.transport)
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
        if not math.isfinite(v):
            raise CupyGPTError("must be a finite number", name, v)
        if not (v >= 0 if zero_ok else v > 0):
            raise CupyGPTError("must not be negative" if zero_ok else "must be positive",
                               name, v)


def between(cfg, name, lo, hi, what):
    v = getattr(cfg, name)
    if not lo <= v <= hi:  # (NaN fails too)
        raise CupyGPTError(f"must be between {lo:g} and {hi:g} ({what})", name, v)


def fits(seq, shape):
    if seq > shape.maxT:
        raise CupyGPTError(f"longer than the model's maxT={shape.maxT}; lower it", "seq", seq)


def make_dir(name, path):
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise CupyGPTError(f"cannot create this directory ({e.strerror})", name, path) from None
    try:  # a file made and removed: access() says yes to root on /proc or /sys
        fd, probe = tempfile.mkstemp(dir=path, prefix=".cupygpt-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise CupyGPTError(f"cannot write files in this directory ({e.strerror})", name,
                           path) from None


def out_file(name, path):
    """A file the command writes (at its end, perhaps): not a directory, and its directory
    exists (made) and is writable, before the run starts."""
    if path is None:
        return
    if not path:
        raise CupyGPTError("is empty; give a file name", name, "''")
    if os.path.isdir(path):
        raise CupyGPTError("is a directory; give a file name", name, path)
    try:
        make_dir(name, os.path.dirname(os.path.abspath(path)))
    except CupyGPTError as e:  # the flag's own value in front, then its directory
        raise CupyGPTError(f"in {e.value}: {e.args[0]}", name, path) from None


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
                 "warmup", "checkpoint_every", "weight_decay", "seed", zero_ok=True)
        between(c, "final_lr_frac", 0, 1, "the final lr as a fraction of -l")
        if c.keep < 1:
            raise CupyGPTError("keep at least one checkpoint", "keep", c.keep)
        if c.val_pattern and c.val_every and c.val_batches < 1:
            raise CupyGPTError("validation needs at least one batch; give -v 0 to turn it "
                               "off", "val_batches", c.val_batches)
        if c.tokenizer:
            existing("tokenizer", c.tokenizer)
        for name in ("train_pattern", "val_pattern"):
            if getattr(c, name) and not glob.glob(getattr(c, name)):
                raise CupyGPTError("no token shard matches this pattern; run `prepare` or "
                                   "fix the path", name, getattr(c, name))
        if c.resume:
            c = replace(c, resume=resolve_checkpoint(c.resume))
            shape = model_shape(os.path.join(c.resume, "model.bin"))
            if self.init is not None and model_shape(self.init) != shape:
                raise CupyGPTError(f"a resumed run continues its checkpoint's own model "
                                   f"({os.path.join(c.resume, 'model.bin')}), of another "
                                   f"shape; leave -e out to resume, or start afresh without "
                                   f"--resume", "init", self.init)
            at = check_resume(c.resume, shape, c.batch, c.seq,
                              sorted(glob.glob(c.train_pattern)))
            if at > c.steps:
                raise CupyGPTError(f"the checkpoint is already at step {at}; this is the "
                                   f"total step count", "steps", c.steps)
        else:
            shape = model_shape(c.init)
        fits(c.seq, shape)
        c = replace(c, device=c.device.validate(be, world), grid=c.grid.validate(shape, world))
        c = replace(c, pipeline=c.pipeline.validate(shape, c.seq, c.grid.pp,
                                                    c.grid.rows(c.batch)))
        if c.checkpoint_every and not c.resume and os.path.isdir(c.out) and listed(c.out):
            raise CupyGPTError(f"holds an earlier run's checkpoints (the newest "
                               f"{listed(c.out)[-1]}), which a resume from it would take for "
                               f"this run's; add --resume {c.out} to continue that run, or give "
                               f"another -o", "out", c.out)
        # last, as they make directories: nothing is left behind when a check above fails
        out_file("trace", c.trace)
        out_file("log_file", c.log_file)
        make_dir("out", c.out)
        c = replace(c, log_file=default(c.log_file, os.path.join(c.out, "log.jsonl")))
        out_file("log_file", c.log_file)  # (the default: only not a directory)
        return c, shape


@dataclass(frozen=True)
class VerifyConfig:
    model: str
    state: str
    steps: int = 10
    lr: float = 1e-4
    weight_decay: float = 0.01
    expected: Optional[str] = None
    expected_losses: tuple = ()     # validate reads them from `expected`
    dtype: str = "float32"
    trace: Optional[str] = None
    device: Device = field(default_factory=Device)
    pipeline: Pipeline = field(default_factory=Pipeline)
    grid: Grid = field(default_factory=Grid)

    def validate(self, be, world):
        positive(self, "steps", "lr")
        positive(self, "weight_decay", zero_ok=True)
        c = self if self.expected is None else \
            replace(self, expected_losses=read_expected(self.expected))
        shape = model_shape(self.model)
        B, T = read_state_header(self.state, shape)
        grid = self.grid.validate(shape, world)
        out_file("trace", self.trace)
        return replace(c, device=self.device.validate(be, world), grid=grid,
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
        positive(self, "max_new_tokens", "temperature", "seed", zero_ok=True)
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
        if is_model_file(c.init):  # (its weights would not change the timing)
            raise CupyGPTError(f"bench times a preset's shape ({', '.join(PRESETS)}), not a "
                               f"model file's", "init", c.init)
        shape = preset(c.init)
        fits(c.seq, shape)
        c = replace(c, device=c.device.validate(be, world))
        if c.comm:  # every rank in one group: the collectives span the world
            if world < 2:
                raise CupyGPTError("bench --comm measures communication between ranks: run "
                                   "it under mpiexec -n 2 or more")
            return replace(c, grid=Grid(dp=world).validate(shape, world)), shape
        c = replace(c, grid=c.grid.validate(shape, world))
        out_file("trace", c.trace)
        return replace(c, pipeline=c.pipeline.validate(shape, c.seq, c.grid.pp,
                                                       c.grid.rows(c.batch))), shape
