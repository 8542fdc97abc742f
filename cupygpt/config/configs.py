"""What a run is: one frozen config per command, checked by its validate() before anything
is allocated (the parts they share, and the field checks, are in config_parts.py).

The CLI builds a config from its flags (each field is named as the flag's parameter) and
calls validate(backend, world), which resolves what depends on the device (the default
model and T) once, and raises CupyGPTError naming the field at fault; the CLI shows it as
its flag. Checks that need the files' contents beyond their headers (token ranges, the
checkpoint's identity) stay with the readers.
"""
import glob
import os
from dataclasses import dataclass, field, replace
from typing import Optional

from .. import CupyGPTError
from ..formats.checkpoint import STATE, check_resume, resolve as resolve_checkpoint
from ..formats.llmc import shard_files
from ..formats.llmc import is_model_file, model_shape, read_expected, read_state_header
from ..formats.hellaswag import check_fits, longest_row, read_eval
from .sections import (Device, Grid, Pipeline, between, default, existing, fits, graphs_on,
                       make_dir, out_file, positive, recompute_level, run_dtype, runs_on,
                       RUN_DTYPES, VERIFY_DTYPES)
from ..model.optim import LR_SCHEDULES
from ..paths import check_outputs, files_of
from ..model.shape import PRESETS, preset


@dataclass(frozen=True)
class TrainConfig:
    train_pattern: str
    val_pattern: str
    tokenizer: str
    shuffle: bool = True            # train batches in a seeded random order (llm.c's)
    init: Optional[str] = None      # None: the backend's DEFAULT_RUN
    out: str = "out"
    batch: int = 4
    seq: Optional[int] = None       # None: the backend's DEFAULT_RUN
    lr: float = 1e-3
    warmup: int = 10
    final_lr_frac: float = 0.1
    lr_schedule: str = "cosine"
    recompute: int = 0              # llm.c's -r: 1 GELU's output, 2 also the layernorms'
    dtype: Optional[str] = None     # fp32 | bf16; None: the backend's DEFAULT_DTYPE
    total_batch: Optional[int] = None  # tokens per step (gradient accumulation); None: B x T
    steps: int = 60
    val_every: int = 20
    val_batches: int = 4
    sample_every: Optional[int] = None  # None: at the end only; 0: never
    gen_tokens: int = 48
    weight_decay: float = 0.0
    grad_clip: float = 1.0          # llm.c's: the gradient clipped at this global norm; 0 off
    seed: int = 1337
    checkpoint_every: int = 0
    keep: int = 2
    resume: Optional[str] = None
    log_file: Optional[str] = None
    graphs: Optional[bool] = None   # None: on where the backend has CUDA graphs
    trace: Optional[str] = None     # Chrome trace-event JSON of every rank's actions
    overwrite: bool = False         # a fresh run may replace an earlier run's output in -o
    skip_loss: float = 0.0          # llm.c's -sl: skip the update at a loss z-score above; 0 off
    skip_norm: float = 0.0          # llm.c's -sg: the same for the gradient norm
    overfit: int = 0                # llm.c's -a 1: every step trains on the first batch
    checkpoint_major: int = 0       # llm.c's -nm: checkpoints at multiples never removed
    hellaswag: int = 0              # llm.c's -h 1: HellaSwag accuracy at every val step
    hellaswag_file: str = os.path.join("data", "hellaswag_val.bin")
    hellaswag_examples: tuple = ()  # validate reads them from hellaswag_file
    made_out: bool = False          # validate made -o (a run failing before step 1 removes it)
    device: Device = field(default_factory=Device)
    pipeline: Pipeline = field(default_factory=Pipeline)
    grid: Grid = field(default_factory=Grid)

    @property
    def micro_steps(self):
        """Batches per step: gradient accumulation's (-d / (B x T)), once validated."""
        return self.total_batch // (self.batch * self.seq)

    def _resumed(self, c):
        """(c, the model's shape) of a resume: its checkpoint found and checked to fit."""
        c = replace(c, resume=resolve_checkpoint(c.resume))
        shape = model_shape(os.path.join(c.resume, "model.bin"))
        if self.init is not None and model_shape(self.init) != shape:
            raise CupyGPTError(f"a resumed run continues its checkpoint's own model "
                               f"({os.path.join(c.resume, 'model.bin')}), of another "
                               f"shape; leave -e out to resume, or start afresh without "
                               f"--resume", "init", self.init)
        at = check_resume(c.resume, shape, c.batch, c.seq, c.total_batch, c.dtype,
                          sorted(glob.glob(c.train_pattern)))
        if at > c.steps:
            raise CupyGPTError(f"the checkpoint is already at step {at}; this is the "
                               f"total step count", "steps", c.steps)
        return c, shape

    def validate(self, be, world):
        """Returns the config with every default resolved and the model's shape (`shape`)."""
        init, seq = be.DEFAULT_RUN
        c = replace(self, init=default(self.init, init), seq=default(self.seq, seq),
                    sample_every=default(self.sample_every, self.steps))
        positive(c, "batch", "seq", "lr")
        c = replace(c, total_batch=default(c.total_batch, c.batch * c.seq))
        if c.total_batch < 1 or c.total_batch % (c.batch * c.seq):
            raise CupyGPTError(f"tokens per step must be a multiple of B x T = "
                               f"{c.batch * c.seq} (each micro-step a batch)", "total_batch",
                               c.total_batch)
        recompute_level(c)
        c = graphs_on(run_dtype(c, be), be)
        if c.lr_schedule not in LR_SCHEDULES:
            raise CupyGPTError(f"unknown; use {', '.join(LR_SCHEDULES)}", "lr_schedule",
                               c.lr_schedule)
        positive(c, "steps", "val_every", "val_batches", "sample_every", "gen_tokens",
                 "warmup", "checkpoint_every", "weight_decay", "grad_clip", "seed", "skip_loss",
                 "skip_norm", "checkpoint_major", zero_ok=True)
        if c.overfit not in (0, 1):
            raise CupyGPTError("0 (off) or 1 (every step trains on the first batch)", "overfit",
                               c.overfit)
        between(c, "final_lr_frac", 0, 1, "the final lr as a fraction of -l")
        if c.keep < 1:
            raise CupyGPTError("keep at least one checkpoint", "keep", c.keep)
        if c.val_pattern and c.val_every and c.val_batches < 1:
            raise CupyGPTError("validation needs at least one batch; give -v 0 to turn it "
                               "off", "val_batches", c.val_batches)
        if c.tokenizer:
            existing("tokenizer", c.tokenizer)
        for name in (n for n in ("train_pattern", "val_pattern") if getattr(c, n)):
            shard_files(getattr(c, name), name)
        c, shape = self._resumed(c) if c.resume else (c, model_shape(c.init))
        fits(c.seq, shape)
        runs_on(c, be, shape, "init", c.init)
        c = replace(c, device=c.device.validate(be, world), grid=c.grid.validate(shape, world))
        c = replace(c, pipeline=c.pipeline.validate(shape, c.seq, c.grid.pp,
                                                    c.grid.rows_per_replica(c.batch)))
        if c.hellaswag not in (0, 1):
            raise CupyGPTError("0 (off) or 1 (HellaSwag at every val step)", "hellaswag",
                               c.hellaswag)
        if c.hellaswag:
            c = replace(c, hellaswag_examples=hellaswag_examples(c.hellaswag_file, c.batch,
                                                                 c.seq, shape)[0])
        log_file = default(c.log_file, os.path.join(c.out, "log.jsonl"))
        check_outputs([("out", c.out), ("out", os.path.join(c.out, "model.bin")),
                       ("log_file", log_file), ("trace", c.trace)], self._inputs(c))
        # last, as they make directories: nothing is left behind when a check above fails
        out_file("trace", c.trace, c.overwrite)
        out_file("log_file", c.log_file)
        c = replace(c, log_file=log_file, made_out=not os.path.isdir(c.out))
        make_dir("out", c.out)
        out_file("log_file", c.log_file)  # (the default: only not a directory)
        return c, shape

    @staticmethod
    def _inputs(c):
        """Every file the run reads: shards, the model or checkpoint, the tokenizer."""
        model = c.init if is_model_file(c.init) or os.path.isdir(c.init) else None
        resumed = [os.path.join(c.resume, f) for f in ("model.bin", STATE)] if c.resume else []
        return [*glob.glob(c.train_pattern), *(glob.glob(c.val_pattern) if c.val_pattern
                                               else []),
                *files_of(model), *resumed, *files_of(c.tokenizer),
                *(files_of(c.hellaswag_file) if c.hellaswag else [])]


def hellaswag_examples(path, batch, seq, shape, option="hellaswag_file"):
    """(the eval file's examples, T): checked to fit a batch (4 rows each), T (None: the
    longest row) and the vocab."""
    if batch < 4:
        raise CupyGPTError("HellaSwag puts an example's 4 completions in 4 rows of a batch: "
                           "give -b 4 or more", "batch", batch)
    existing(option, path, "`cupygpt prepare hellaswag_val.jsonl --hellaswag` (HellaSwag's "
             "published jsonl)")
    examples = tuple(read_eval(path))
    longest = longest_row(examples)
    if longest > shape.maxT:  # no -t helps: say what the model takes
        raise CupyGPTError(f"its longest example is {longest} tokens (context + completion), "
                           f"more than the model's context takes (maxT = {shape.maxT}); give "
                           f"a file whose examples fit, or a model with a longer context",
                           option, path)
    seq = default(seq, longest)
    fits(seq, shape)
    check_fits(path, examples, seq, shape.V, option)
    return examples, seq


@dataclass(frozen=True)
class EvalConfig:
    model: str
    hellaswag: str
    batch: int = 16                 # rows per forward: B // 4 examples
    seq: Optional[int] = None       # None: the eval file's longest row
    dtype: Optional[str] = None     # fp32 | bf16 | fp64; None: the backend's DEFAULT_DTYPE
    examples: tuple = ()            # validate reads them from `hellaswag`
    device: Device = field(default_factory=Device)
    pipeline: Pipeline = field(default_factory=Pipeline)
    grid: Grid = field(default_factory=Grid)

    def validate(self, be, world):
        positive(self, "batch")
        if self.seq is not None:
            positive(self, "seq")
        c = run_dtype(self, be, VERIFY_DTYPES)
        existing("model", c.model)
        shape = model_shape(c.model, "model")
        runs_on(c, be, shape, "model", c.model)
        examples, seq = hellaswag_examples(c.hellaswag, c.batch, c.seq, shape, "hellaswag")
        c = replace(c, seq=seq, examples=examples)
        grid = c.grid.validate(shape, world)
        return replace(c, device=c.device.validate(be, world), grid=grid,
                       pipeline=c.pipeline.validate(shape, seq, grid.pp,
                                                    grid.rows_per_replica(c.batch))), shape


@dataclass(frozen=True)
class VerifyConfig:
    model: str
    state: Optional[str]
    steps: int = 10
    lr: float = 1e-4
    weight_decay: float = 0.01
    expected: Optional[str] = None
    expected_losses: tuple = ()     # validate reads them from `expected`
    dtype: str = "fp32"
    trace: Optional[str] = None
    overwrite: bool = False         # --trace may replace an existing file
    device: Device = field(default_factory=Device)
    pipeline: Pipeline = field(default_factory=Pipeline)
    grid: Grid = field(default_factory=Grid)

    def validate(self, be, world):
        positive(self, "steps", "lr")
        positive(self, "weight_decay", zero_ok=True)
        c = run_dtype(self, be, VERIFY_DTYPES)
        c = c if c.expected is None else replace(c, expected_losses=read_expected(c.expected))
        shape = model_shape(self.model, "model")
        runs_on(c, be, shape, "model", self.model)
        if self.state is None:  # (the CLI looked beside the model)
            raise CupyGPTError(f"no NAME_debug_state.bin beside {self.model}: give the "
                               f"model's llm.c debug state with --state")
        B, T = read_state_header(self.state, shape)
        grid = self.grid.validate(shape, world)
        check_outputs([("trace", self.trace)],
                      [*files_of(self.model), self.state, *files_of(self.expected)])
        out_file("trace", self.trace, self.overwrite)
        pipeline = self.pipeline.validate(shape, T, grid.pp, grid.rows_per_replica(B))
        return replace(c, device=self.device.validate(be, world), grid=grid,
                       pipeline=pipeline), shape


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
    dtype: Optional[str] = None     # fp32 | bf16; None: the backend's DEFAULT_DTYPE
    device: Device = field(default_factory=Device)
    pipeline: Pipeline = field(default_factory=Pipeline)  # even split; one row, one pass
    grid: Grid = field(default_factory=Grid)              # a pipeline of every rank

    def validate(self, be, world):
        positive(self, "max_new_tokens", "temperature", "seed", zero_ok=True)
        self = run_dtype(self, be)
        shape = model_shape(self.model, "model")
        runs_on(self, be, shape, "model", self.model)
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
    graphs: Optional[bool] = None   # None: on where the backend has CUDA graphs
    profile: bool = False
    comm: bool = False              # the transports' collectives and handoff instead
    recompute: int = 0
    dtype: Optional[str] = None     # fp32 | bf16 | both; None: the backend's DEFAULT_DTYPE
    grad_clip: float = 1.0          # train's default: the step it times clips as train's
    trace: Optional[str] = None
    overwrite: bool = False         # --out and --trace may replace existing files
    device: Device = field(default_factory=Device)
    pipeline: Pipeline = field(default_factory=Pipeline)  # one process: one stage
    grid: Grid = field(default_factory=Grid)

    def validate(self, be, world):
        init, seq = be.DEFAULT_RUN
        c = replace(self, init=default(self.init, init), seq=default(self.seq, seq))
        positive(c, "batch", "seq", "steps")
        positive(c, "warmup", "grad_clip", zero_ok=True)
        recompute_level(c)
        c = graphs_on(c, be)
        if c.dtype == "both":  # side by side: each must run here
            for name in RUN_DTYPES:
                run_dtype(replace(c, dtype=name), be)
        else:
            c = run_dtype(c, be)
        if is_model_file(c.init):  # (its weights would not change the timing)
            raise CupyGPTError(f"bench times a preset's shape ({', '.join(PRESETS)}), not a "
                               f"model file's", "init", c.init)
        shape = preset(c.init)
        fits(c.seq, shape)
        runs_on(c, be, shape, "init", c.init, both=True)
        c = replace(c, device=c.device.validate(be, world))
        if c.comm:  # every rank in one group: the collectives span the world
            if world < 2:
                raise CupyGPTError("bench --comm measures communication between ranks: run "
                                   "it under mpiexec -n 2 or more")
            return replace(c, grid=Grid(dp=world).validate(shape, world)), shape
        c = replace(c, grid=c.grid.validate(shape, world))
        check_outputs([("trace", c.trace)], [c.data])
        out_file("trace", c.trace, c.overwrite)
        return replace(c, pipeline=c.pipeline.validate(shape, c.seq, c.grid.pp,
                                                       c.grid.rows_per_replica(c.batch))), shape
