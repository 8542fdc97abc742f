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
from dataclasses import dataclass, replace
from typing import Optional

from .. import CupyGPTError
from . import fields
from .fields import flag
from ..formats.checkpoint import STATE, check_resume, resolve as resolve_checkpoint
from ..formats.llmc import shard_files
from ..formats.llmc import is_model_file, model_shape, read_expected, read_state_header
from ..formats.hellaswag import check_fits, longest_row, read_eval
from .sections import (Device, Grid, Pipeline, between, default, existing, fits, graphs_on,
                       make_dir, out_file, positive, recompute_level, run_dtype, runs_on,
                       RUN_DTYPES, VERIFY_DTYPES)
from ..model.optim import LR_SCHEDULES
from ..paths import DATA, REFERENCE, TOKENIZER, check_outputs, files_of
from ..model.shape import PRESETS, preset


@dataclass(frozen=True)
class TrainConfig:
    train_pattern: str = flag("-i", default=os.path.join(DATA, "tiny_shakespeare_train.bin"),
                              help="train shards (glob)")
    val_pattern: str = flag("-j", default=os.path.join(DATA, "tiny_shakespeare_val.bin"),
                            help="val shards (glob)")
    shuffle: bool = flag("--shuffle/--no-shuffle", default=True, help=(
        "train shards and the batches in each in a seeded random order per epoch (llm.c's); "
        "--no-shuffle: in file order"))
    init: Optional[str] = flag("-e", default=None, help=(
        "llm.c model file, or one of llm.c's descriptors for a fresh model: d6, d12 .. d84 "
        "(GPT-2 by depth), gpt3:c768 .. (GPT-3 by channels, T 2048), or tiny  [default: d12 "
        "on a GPU, tiny on the CPU]"))  # None: the backend's DEFAULT_RUN
    out: str = flag("-o", default="out", help="output directory")
    batch: int = fields.batch()
    seq: Optional[int] = fields.seq("sequence length T  [default: 1024 on a GPU, 64 on the "
                                    "CPU]")  # None: the backend's DEFAULT_RUN
    lr: float = flag("-l", default=1e-3, help="learning rate")
    warmup: int = flag("-u", default=10, help="lr warm-up steps")
    final_lr_frac: float = flag("-q", default=0.1, help="final lr as a fraction of -l (where "
                                                        "the schedule decays)")
    lr_schedule: str = flag("-k", default="cosine", choices=LR_SCHEDULES,
                            help="lr schedule after the warm-up (llm.c's)")
    recompute: int = fields.recompute(  # llm.c's -r
        "activation recomputation: 1 GELU's output, 2 also the layernorms' (backward makes "
        "them again; the same bits, less memory)")
    dtype: Optional[str] = fields.dtype(RUN_DTYPES, help=(
        "bf16: llm.c's mixed precision (fp32 master weights)  [default: the backend's: fp32 "
        "on the CPU]"))
    total_batch: Optional[int] = flag("-d", default=None, help=(
        "tokens per step: a multiple of B x T, the batches of a step adding into its gradient "
        "(gradient accumulation)  [default: B x T]"))
    steps: int = flag("-n", default=60, help="training steps")
    val_every: int = flag("-v", default=20, help="val loss every N steps")
    val_batches: int = flag("-m", default=4, help="val batches")
    sample_every: Optional[int] = flag("-s", default=None, help=(
        "sample every N steps and at the end; 0: never  [default: at the end]"))
    gen_tokens: int = flag("-g", default=48, help="tokens to generate")
    weight_decay: float = flag("--weight-decay", default=0.0, help="AdamW weight decay")
    grad_clip: float = flag("--grad-clip", default=1.0,
                            help="clip the gradient at this global norm (0: off)")
    seed: int = flag("--seed", default=1337, help="initialisation and sampling seed")
    tokenizer: str = flag("--tokenizer", default=TOKENIZER)
    checkpoint_every: int = flag("--checkpoint-every", default=0, help=(
        "write OUT/ckpt_STEP every K steps and at the end (0: never)"))
    keep: int = flag("--keep", default=2,
                     help="checkpoints to keep (besides --checkpoint-major's)")
    checkpoint_major: int = flag("-nm", "--checkpoint-major", default=0, help=(
        "checkpoints at multiples of K steps are never removed by --keep (0: none)"))
    skip_loss: float = flag("-sl", "--skip-loss-z", default=0.0, help=(
        "skip the update when the step's loss is more than Z standard deviations above its "
        "last 128 steps' (llm.c's outlier detector; 0: off)"))
    skip_norm: float = flag("-sg", "--skip-norm-z", default=0.0,
                            help="the same for the gradient's global norm (0: off)")
    overfit: int = flag("-a", "--overfit-single-batch", default=0,
                        help="1: every step trains on the first batch (llm.c's debugging check)")
    resume: Optional[str] = flag("--resume", default=None,
                                 help="checkpoint dir (or a run's -o dir) to continue")
    log_file: Optional[str] = flag("--log-file", default=None,
                                   help="JSON lines per step (default OUT/log.jsonl)")
    hellaswag: int = flag("-h", default=0, help=(
        "1: HellaSwag accuracy at every val step and at the end (needs -b 4 or more)"))
    hellaswag_file: str = flag("--hellaswag-file", default=os.path.join("data",
                                                                        "hellaswag_val.bin"),
                               help="llm.c's eval file for -h 1 (`prepare --hellaswag`)")
    overwrite: bool = fields.overwrite(
        "a fresh run may replace what an earlier run left in -o (its model.bin, log and "
        "checkpoints) and an existing --trace file")
    graphs: Optional[bool] = fields.graphs(
        "replay each step as a CUDA graph (a GPU alone, or over nvshmem without the "
        "overlapped dp sum)  [default: on with --backend cuda]")
    trace: Optional[str] = fields.trace()  # Chrome trace-event JSON of every rank's actions
    hellaswag_examples: tuple = ()  # validate reads them from hellaswag_file
    made_out: bool = False          # validate made -o (a run failing before step 1 removes it)
    device: Device = fields.section(Device)
    grid: Grid = fields.section(Grid)
    pipeline: Pipeline = fields.section(Pipeline)

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
    model: str = flag(argument=True, default=None, required=True)
    hellaswag: str = flag("--hellaswag", default=None, required=True, metavar="FILE",
                          help="llm.c's eval file (hellaswag_val.bin; `prepare --hellaswag` "
                               "makes it)")
    batch: int = fields.batch(16, "rows per forward: B // 4 examples")
    seq: Optional[int] = fields.seq("sequence length  [default: the file's longest context + "
                                    "completion]")
    dtype: Optional[str] = fields.dtype(VERIFY_DTYPES, help="fp64: the exact reference  "
                                                            "[default: the backend's]")
    as_json: bool = fields.as_json("print one JSON object (with every example's 4 completion "
                                   "losses)")
    examples: tuple = ()            # validate reads them from `hellaswag`
    device: Device = fields.section(Device)
    grid: Grid = fields.section(Grid)
    pipeline: Pipeline = fields.section(Pipeline)

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
    model: str = flag("--model", default=os.path.join(REFERENCE, "tiny_model.bin"), help=(
        "llm.c model file (default: the shipped one made by llm.c's PyTorch reference)"))
    state: Optional[str] = flag("--state", default=None, help=(
        "llm.c debug state file for that model  [default: NAME_debug_state.bin beside a "
        "NAME_model.bin]"))
    steps: int = flag("--steps", default=10, help="AdamW steps on the state's batch")
    lr: float = flag("--lr", default=1e-4)
    weight_decay: float = flag("--weight-decay", default=0.01, help="AdamW weight decay")
    expected: Optional[str] = flag("--expected", default=None, help=(
        "JSON with a 'losses' list to check the steps  [default: NAME_expected.json beside a "
        "NAME_model.bin, at the default --lr and --weight-decay]"))
    dtype: str = fields.dtype(VERIFY_DTYPES, "fp32", help=(
        "fp64: the gradients' exact reference; bf16: llm.c's mixed precision, against the "
        "fp32 reference at bf16's tolerances"))
    as_json: bool = fields.as_json()
    trace: Optional[str] = fields.trace()
    overwrite: bool = fields.overwrite()  # --trace may replace an existing file
    expected_losses: tuple = ()     # validate reads them from `expected`
    device: Device = fields.section(Device)
    grid: Grid = fields.section(Grid)
    pipeline: Pipeline = fields.section(Pipeline)

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
    model: str = flag("--model", default=os.path.join("out", "model.bin"))
    prompt: str = flag("--prompt", default="", help="text to continue (default: start of text)")
    max_new_tokens: int = flag("--max-new-tokens", default=64)
    temperature: float = flag("--temperature", default=1.0)
    top_k: Optional[int] = flag("--top-k", default=None)
    dtype: Optional[str] = fields.dtype(RUN_DTYPES, help=(
        "bf16: llm.c's mixed precision (fp32 master weights)  [default: the backend's: fp32 "
        "on the CPU]"))
    seed: int = flag("--seed", default=1337, help="sampling seed")
    tokenizer: str = flag("--tokenizer", default=TOKENIZER)
    kv_cache: bool = flag("--kv-cache/--no-kv-cache", default=True, help=(
        "one position per token on cached keys and values, or a whole pass"))
    device: Device = fields.section(Device)
    pipeline: Pipeline = fields.section(Pipeline, False)  # even split; one row, one pass
    grid: Grid = fields.section(Grid, False)              # a pipeline of every rank

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
    init: Optional[str] = flag("-e", default=None, help=(
        "descriptor to benchmark (as train's -e)  [default: d12 on a GPU, tiny on the CPU]"))
    batch: int = fields.batch(help=None)
    seq: Optional[int] = fields.seq()
    steps: int = flag("--steps", default=20, help="timed steps (median reported)")
    warmup: int = flag("--warmup", default=3, help="untimed steps first")
    graphs: Optional[bool] = fields.graphs("as train's  [default: on with --backend cuda]")
    recompute: int = fields.recompute("activation recomputation, as train's -r")
    dtype: Optional[str] = fields.dtype(RUN_DTYPES + ("both",), help=(
        "as train's; both: fp32 and bf16 side by side  [default: the backend's]"))
    grad_clip: float = flag("--grad-clip", default=1.0, help=(
        "the timed step clips at this global norm, as train's (0: off)"))
    profile: bool = flag("--profile", default=False, help=(
        "add a time-per-op table (GPU: CUDA events, also per kernel, eager steps; CPU: wall "
        "time per op)"))
    comm: bool = flag("--comm", default=False, help=(
        "under mpiexec: time the transport's collectives and a stage handoff from 1 KiB to "
        "64 MiB and at this model's step sizes, instead"))
    out: str = flag("--out", default="bench.json", help="JSON to write")
    device: Device = fields.section(Device)
    trace: Optional[str] = fields.trace()
    overwrite: bool = fields.overwrite()  # --out and --trace may replace existing files
    grid: Grid = fields.section(Grid)
    pipeline: Pipeline = fields.section(Pipeline)  # one process: one stage
    data: str = os.path.join(DATA, "tiny_shakespeare_train.bin")  # the batches it times

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
