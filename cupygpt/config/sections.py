"""The parts every command's config shares (where it computes: Device; how its ranks split
the model: Grid; how a step is cut across the pipeline: Pipeline), where a command runs
(place, the end of every config's validate), and the checks of single fields the configs
make (configs.py and train.py hold the commands' configs). None makes a directory: the
commands make theirs at their start (paths.make_dir)."""
import math
import os
from dataclasses import dataclass, replace
from typing import Optional

from .. import CupyGPTError
from ..comm.launch import YEAR_S
from ..model.layout import RECOMPUTED
from ..parallel.pipeline.plan import plan_split
from ..parallel.pipeline.schedule import SCHEDULES, chunks_per_rank
from ..paths import check_dir, file_dir, not_regular
from ..precision import DTYPES, dtype_name
from . import fields
from .fields import flag

ATTENTION = ("auto", "cudnn", "own", "both")


@dataclass(frozen=True)
class Device:
    """Where a command computes and how its ranks talk."""
    backend: str = flag("--backend", default="auto", choices=("auto", "cuda", "numpy"))
    transport: str = flag("--transport", default="auto",
                          choices=("auto", "nvshmem", "nccl", "mpi"), help=(
                              "stage-to-stage transport under mpiexec (auto: the backend's "
                              "first choice: nvshmem on a GPU, mpi on the CPU)"))
    peer_timeout: float = flag("--peer-timeout", default=300.0,
                               help="seconds to wait on another rank before failing")
    tf32: Optional[bool] = flag("--tf32/--no-tf32", default=None, help=(
        "TF32 matmuls on the GPU (default: off for verify, on for every other command: "
        "train, bench, sample, eval)"))
    attention: str = flag("--attention", default="auto", choices=ATTENTION, help=(
        "bf16 attention: cuDNN's fused sdpa (the cudnn extra) or the own flash kernels; auto: "
        "cuDNN where it can run, saying why not otherwise; both: bench's, the two side by "
        "side"))

    def validate(self, be, world):
        positive(self, "peer_timeout")
        at_most_a_year(self.peer_timeout, "peer_timeout")
        if self.tf32 and be.name == "numpy":
            raise CupyGPTError("the numpy backend has no TF32 (a GPU's matmul mode): it runs "
                               "with --backend cuda; leave it out here", "tf32", FLAG)
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
    dp: Optional[int] = flag("--dp", default=None, help=(
        "data-parallel replicas (each takes -b/DP rows)  [default: 1]"))
    tp: Optional[int] = flag("--tp", default=None, help=(
        "tensor-parallel ranks per stage (must divide the heads)  [default: 1]"))
    pp: Optional[int] = flag("--pp", default=None, help=(
        "pipeline stages  [default: the ranks dp and tp leave]"))
    zero: int = flag("--zero", default=0, help=(
        "1: shard AdamW's state across the --dp replicas (ZeRO-1)"))
    overlap: bool = flag("--overlap/--no-overlap", default=True, help=(
        "sum the replicas' gradients layer by layer during the last backward (with --zero 1: "
        "as an all-reduce, each replica updating its slice)"))

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

    def rows_per_replica(self, batch):
        """Each replica computes batch / dp rows of the step's batch."""
        if batch % self.dp:  # (--dp may not have been given: say where it comes from)
            raise CupyGPTError(f"must divide the batch size {batch}: each of the {self.dp} "
                               f"data-parallel replicas ({self.dp * self.tp * self.pp} ranks "
                               f"/ (tp {self.tp} x pp {self.pp})) takes an equal part of it; "
                               f"give -b a multiple of {self.dp}, or launch fewer ranks",
                               "dp", self.dp)
        return batch // self.dp


@dataclass(frozen=True)
class Pipeline:
    """How one step is cut across the pipeline's stages and micro-batches."""
    micro_batches: int = flag("--micro-batches", default=1, help=(
        "micro-batches per step (must divide the batch; per replica with --dp)"))
    schedule: str = fields.schedule()
    virtual_stages: Optional[int] = fields.virtual_stages()
    split: Optional[str] = flag("--split", default=None, help=(
        "layers per model chunk (a stage's, but with interleaved or zbv), e.g. 6,6 (default: "
        "balanced by counted cost)"))  # validate resolves it into counts
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
            given = self.virtual_stages is not None  # (else the schedule's own count)
            raise CupyGPTError(("" if given else f"{self.schedule} holds {v} model chunks per "
                                f"rank: ") + f"{stages * v} model chunks ({stages} stage(s) x "
                               f"{v}) but the model has {shape.L} layers; a chunk needs one",
                               *(("virtual_stages", v) if given else ("schedule", self.schedule)))
        return replace(self, virtual_stages=v,
                       counts=tuple(plan_split(shape, seq, stages * v, self.split, stages)))


def default(value, fallback):
    return fallback if value is None else value


def positive(config, *names, zero_ok=False):
    for name in names:
        v = getattr(config, name)
        if not math.isfinite(v):
            raise CupyGPTError("must be a finite number", name, v)
        if not (v >= 0 if zero_ok else v > 0):
            raise CupyGPTError("must not be negative" if zero_ok else "must be positive",
                               name, v)


FLAG = "(given)"  # CupyGPTError's value for an on/off flag: the CLI names the flag alone


def graphs_on(c, be):
    """c with --graphs resolved (None: on where the backend has them); --graphs asked of a
    backend without CUDA graphs is refused, as --tf32 and --attention cudnn are."""
    if c.graphs and not be.supports_graphs:
        raise CupyGPTError(f"the {be.name} backend has no CUDA graphs (a GPU's): it runs "
                           f"with --backend cuda; leave it out here", "graphs", FLAG)
    return replace(c, graphs=c.graphs is not False)


def at_most_a_year(v, name):
    if v > YEAR_S:
        raise CupyGPTError(f"is more than a year; the most it takes is {YEAR_S} seconds",
                           name, v)


def between(config, name, lo, hi, what):
    v = getattr(config, name)
    if not lo <= v <= hi:  # (NaN fails too)
        raise CupyGPTError(f"must be between {lo:g} and {hi:g} ({what})", name, v)


def fits(seq, shape):
    if seq > shape.maxT:
        raise CupyGPTError(f"longer than the model's maxT={shape.maxT}; lower it", "seq", seq)


def runs_on(c, be, shape, name, value, both=False):
    """The backend runs this model's attention (the CUDA kernels take some head sizes), the
    way --attention asks, in each dtype the command runs (c's, resolved); both: the command
    takes --attention both (bench). --attention's own refusals come first: a head size
    cuDNN does not run, asked of it, is its to say."""
    asked = c.device.attention
    if asked not in ATTENTION:
        raise CupyGPTError(f"unknown; use {', '.join(ATTENTION)}", "attention", asked)
    if asked == "both" and not both:
        raise CupyGPTError("runs the two attentions side by side, which bench alone does; "
                           "use auto, cudnn or own", "attention", asked)
    if asked == "both" and c.dtype == "both":
        raise CupyGPTError("and --dtype both: one side-by-side comparison at a time",
                           "attention", asked)
    for dtype in RUN_DTYPES if c.dtype == "both" else (c.dtype,):
        for one in ("cudnn", "own") if asked == "both" else (asked,):
            attention_path(one, be, DTYPES[dtype], shape, given=asked)
        why = be.attention_refuses(shape.C // shape.NH, DTYPES[dtype])
        if why:
            raise CupyGPTError(f"{why}; use --backend numpy for this model", name, value)


def place(c, be, world, shape, seq, batch, at, both=False):
    """Where a command runs, checked in one order by every config's validate (each
    refusal is one line, so the order decides which of two it names): the model's
    attention on this backend (runs_on; at: the (field, value) that named the model), the
    device, the grid, then a pass of batch rows of seq tokens cut across the pipeline
    (seq None: none is cut; bench --comm times the transport alone). Returns c with its
    sections resolved."""
    runs_on(c, be, shape, *at, both=both)
    c = replace(c, device=c.device.validate(be, world), grid=c.grid.validate(shape, world))
    if seq is None:
        return c
    return replace(c, pipeline=c.pipeline.validate(shape, seq, c.grid.pp,
                                                   c.grid.rows_per_replica(batch)))


def attention_path(asked, be, dtype, shape, given=None):
    """(the attention a run of dtype takes for --attention asked: "cudnn" | "own", the run
    table's words for it: which, and why when auto fell back); an asked cudnn that cannot
    run raises, saying why, naming the value given (both: bench's, which asks cudnn too).
    Where the own kernels cannot run the head size either, the advice is the numpy backend."""
    why = be.fused_attention_refuses(dtype, shape.C // shape.NH)
    if asked == "own":
        return "own", "own flash kernels (as asked)"
    if why is None:
        return "cudnn", f"cuDNN fused sdpa ({'auto' if asked == 'auto' else 'as asked'})"
    if asked == "cudnn":
        advice = ("use --backend numpy for this model (the own kernels do not run its head "
                  "size either)" if be.attention_refuses(shape.C // shape.NH, dtype) else
                  "else use --attention auto (cuDNN where it can run, the own kernels "
                  "elsewhere) or own")
        raise CupyGPTError(f"{why}; {advice}", "attention", given or asked)
    return "own", f"own flash kernels (auto: {why})"


def out_file(name, path, overwrite=None):
    """A file the command writes (at its end, perhaps): not a directory, and its directory
    one the command can make (paths.make_parent, at its start) and write in. overwrite (the
    command's --overwrite; None where the command claims it otherwise, train's log): an
    existing file is replaced only when asked (bench --out over a run's model.bin would
    destroy it); every such file is written through atomic_write (a temporary renamed over
    it, the umask's mode)."""
    if path is None:
        return
    if not path:
        raise CupyGPTError("is empty; give a file name", name, "''")
    if path.endswith(os.sep):  # (its rename at the end was a traceback, the work lost)
        raise CupyGPTError("ends in /, naming a directory; give a file name", name, path)
    if overwrite is False and os.path.lexists(path) and not os.path.isdir(path):
        raise CupyGPTError("exists; add --overwrite to replace it, or give another path",
                           name, path)
    if os.path.isdir(path):
        raise CupyGPTError("is a directory; give a file name", name, path)
    if os.path.islink(path) and not os.path.exists(path):  # (else found at the end)
        raise CupyGPTError(f"is a symbolic link to {os.readlink(path)!r}, which does not "
                           f"resolve (missing, or a loop); give a file name", name, path)
    file_dir(check_dir, name, path)


def existing(name, path, how=None):
    """path is a regular file; how: what makes it, said when it is missing."""
    try:
        what = not_regular(os.stat(path))
    except OSError:
        raise CupyGPTError("no such file" + (f"; {how} makes it" if how else ""), name,
                           path) from None
    if what:  # (a FIFO would block its reader)
        raise CupyGPTError(f"is {what}, not a regular file; give a file", name, path)


def recompute_level(config):
    if config.recompute not in RECOMPUTED:
        raise CupyGPTError(f"one of {', '.join(map(str, RECOMPUTED))} (0: keep every "
                           f"activation, 1: recompute GELU's output, 2: also the layernorms')",
                           "recompute", config.recompute)


RUN_DTYPES = ("fp32", "bf16")  # what train, bench and sample run in
VERIFY_DTYPES = ("fp32", "fp64", "bf16")  # verify adds fp64, the gradient checks' reference


def run_dtype(config, be, names=RUN_DTYPES):
    """config with its --dtype resolved: the backend's default when not given (bf16 where it
    has bf16 kernels, as llm.c on a GPU), else one of names the backend computes in."""
    name = default(config.dtype, be.DEFAULT_DTYPE)
    here = [n for n in names if n in {dtype_name(d) for d in be.DTYPES}]
    if name not in here:
        raise CupyGPTError(f"the {be.name} backend runs in {', '.join(here)}", "dtype", name)
    return replace(config, dtype=name)
