"""What a run is: one frozen config per command, checked by its validate() before anything
is allocated (train's is in train.py; the parts they share, and the field checks, are in
sections.py).

The CLI builds a config from its flags (each field is named as the flag's parameter) and
calls validate(backend, world), which resolves what depends on the device (the default
model and T) once, and raises CupyGPTError naming the field at fault; the CLI shows it as
its flag. A validate reads what its checks need and keeps none of it (the command reads
its examples or losses itself), and makes no directory (the command does, at its start).
Checks that need the files' contents beyond their headers (token ranges, the checkpoint's
identity) stay with the readers.
"""
import os
from dataclasses import dataclass, replace
from typing import Optional

from .. import CupyGPTError
from ..formats.hellaswag import check_fits, longest_row, read_eval
from ..formats.llmc import is_model_file, read_expected, read_state_header
from ..formats.model_spec import model_shape
from ..model.shape import PRESETS, preset
from ..paths import DATA, REFERENCE, check_outputs, files_of
from . import fields
from .fields import flag
from .sections import (
    RUN_DTYPES,
    VERIFY_DTYPES,
    Device,
    Grid,
    Pipeline,
    default,
    existing,
    fits,
    graphs_on,
    out_file,
    place,
    positive,
    recompute_level,
    run_dtype,
)


def hellaswag_seq(path, batch, seq, shape, option="hellaswag_file"):
    """T for the eval file at path (seq; None: its longest row), its examples read to check
    them: 4 rows of a batch each, fitting T, the model's context and its vocab (eval's
    --hellaswag, train's -h 1). The command reads them again: a config holds no loaded
    data."""
    if batch < 4:
        raise CupyGPTError("HellaSwag puts an example's 4 completions in 4 rows of a batch: "
                           "give -b 4 or more", "batch", batch)
    existing(option, path, "`cupygpt prepare hellaswag_val.jsonl --hellaswag` (HellaSwag's "
             "published jsonl)")
    examples = read_eval(path)
    longest = longest_row(examples)
    if longest > shape.maxT:  # no -t helps: say what the model takes
        raise CupyGPTError(f"its longest example is {longest} tokens (context + completion), "
                           f"more than the model's context takes (maxT = {shape.maxT}); give "
                           f"a file whose examples fit, or a model with a longer context",
                           option, path)
    seq = default(seq, longest)
    fits(seq, shape)
    check_fits(path, examples, seq, shape.V, option)
    return seq


@dataclass(frozen=True)
class EvalConfig:
    model: str = flag(argument=True, default=None, required=True, file="in")
    hellaswag: str = flag("--hellaswag", default=None, required=True, metavar="FILE", file="in",
                          help="llm.c's eval file (hellaswag_val.bin; `prepare --hellaswag` "
                               "makes it)")
    batch: int = fields.batch(16, "rows per forward: B // 4 examples")
    seq: Optional[int] = fields.seq("sequence length  [default: the file's longest context + "
                                    "completion]")
    dtype: Optional[str] = fields.dtype(VERIFY_DTYPES, help="fp64: the exact reference  "
                                                            "[default: the backend's]")
    as_json: bool = fields.as_json("print one JSON object (with every example's 4 completion "
                                   "losses)")
    device: Device = fields.section(Device)
    grid: Grid = fields.section(Grid)
    pipeline: Pipeline = fields.section(Pipeline)

    def validate(self, be, world):
        positive(self, "batch")
        if self.seq is not None:
            positive(self, "seq")
        c = run_dtype(self, be, VERIFY_DTYPES)
        shape = model_shape(c.model, "model")  # (a file, or a transformers directory)
        c = replace(c, seq=hellaswag_seq(c.hellaswag, c.batch, c.seq, shape, "hellaswag"))
        return place(c, be, world, shape, c.seq, c.batch, ("model", c.model)), shape


@dataclass(frozen=True)
class VerifyConfig:
    model: str = flag("--model", default=os.path.join(REFERENCE, "tiny_model.bin"), file="in",
                      help="llm.c model file (default: the shipped one made by llm.c's "
                           "PyTorch reference)")
    state: Optional[str] = flag("--state", default=None, file="in", help=(
        "llm.c debug state file for that model  [default: NAME_debug_state.bin beside a "
        "NAME_model.bin]"))
    steps: int = flag("--steps", default=10, help="AdamW steps on the state's batch")
    lr: float = flag("--lr", default=1e-4)
    weight_decay: float = flag("--weight-decay", default=0.01, help="AdamW weight decay")
    expected: Optional[str] = flag("--expected", default=None, file="in", help=(
        "JSON with a 'losses' list to check the steps  [default: NAME_expected.json beside a "
        "NAME_model.bin, at the default --lr and --weight-decay]"))
    dtype: str = fields.dtype(VERIFY_DTYPES, "fp32", help=(
        "fp64: the gradients' exact reference; bf16: llm.c's mixed precision, against the "
        "fp32 reference at bf16's tolerances"))
    as_json: bool = fields.as_json()
    trace: Optional[str] = fields.trace()
    overwrite: bool = fields.overwrite("replace --trace's file where it exists")
    device: Device = fields.section(Device)
    grid: Grid = fields.section(Grid)
    pipeline: Pipeline = fields.section(Pipeline)

    def validate(self, be, world):
        positive(self, "steps", "lr")
        positive(self, "weight_decay", zero_ok=True)
        c = run_dtype(self, be, VERIFY_DTYPES)
        if c.expected is not None:  # (checked: the command reads the losses)
            read_expected(c.expected)
        shape = model_shape(c.model, "model")
        if c.state is None:  # (the CLI looked beside the model)
            raise CupyGPTError(f"no NAME_debug_state.bin beside {c.model}: give the "
                               f"model's llm.c debug state with --state")
        B, T = read_state_header(c.state, shape)
        c = place(c, be, world, shape, T, B, ("model", c.model))
        check_outputs([("trace", c.trace)],
                      [*files_of(c.model), c.state, *files_of(c.expected)])
        out_file("trace", c.trace, c.overwrite)
        return c, shape


@dataclass(frozen=True)
class SampleConfig:
    model: str = flag("--model", default=os.path.join("out", "model.bin"), file="in")
    prompt: str = flag("--prompt", default="", help="text to continue (default: start of text)")
    max_new_tokens: int = flag("--max-new-tokens", default=64)
    temperature: float = flag("--temperature", default=1.0)
    top_k: Optional[int] = flag("--top-k", default=None)
    dtype: Optional[str] = fields.dtype(RUN_DTYPES, help=(
        "bf16: llm.c's mixed precision (fp32 master weights)  [default: the backend's: fp32 "
        "on the CPU]"))
    seed: int = fields.seed("sampling seed")
    tokenizer: str = fields.tokenizer()
    kv_cache: bool = flag("--kv-cache/--no-kv-cache", default=True, help=(
        "one position per token on cached keys and values, or a whole pass"))
    device: Device = fields.section(Device)
    pipeline: Pipeline = fields.section(Pipeline, False)  # even split; one row, one pass
    grid: Grid = fields.section(Grid, False)              # a pipeline of every rank

    def validate(self, be, world):
        positive(self, "max_new_tokens", "temperature", "seed", zero_ok=True)
        c = run_dtype(self, be)
        shape = model_shape(c.model, "model")
        if c.top_k is not None and not 0 < c.top_k <= shape.V:
            raise CupyGPTError(f"must be between 1 and the vocab size {shape.V}", "top_k",
                               c.top_k)
        # every rank a stage of the pipeline (its grid's default); one row, a whole context
        return place(c, be, world, shape, shape.maxT, 1, ("model", c.model)), shape


@dataclass(frozen=True)
class BenchConfig:
    init: Optional[str] = fields.init((
        "descriptor to benchmark (as train's -e)  [default: d12 on a GPU, tiny on the CPU]"))
    batch: int = fields.batch(help=None)
    seq: Optional[int] = fields.seq()
    steps: int = flag("--steps", default=20, help="timed steps (median reported)")
    warmup: int = flag("--warmup", default=3, help="untimed steps first")
    graphs: Optional[bool] = fields.graphs("as train's  [default: on with --backend cuda]")
    recompute: int = fields.recompute("activation recomputation, as train's -r")
    dtype: Optional[str] = fields.dtype(RUN_DTYPES + ("both",), help=(
        "as train's; both: fp32 and bf16 side by side  [default: the backend's]"))
    grad_clip: float = fields.grad_clip(
        "the timed step clips at this global norm, as train's (0: off)")
    profile: bool = flag("--profile", default=False, help=(
        "add a time-per-op table (GPU: CUDA events, also per kernel, eager steps; CPU: wall "
        "time per op)"))
    comm: bool = flag("--comm", default=False, help=(
        "under mpiexec: time the transport's collectives and a stage handoff from 8 B to "
        "64 MiB and at this model's step sizes, instead (--steps messages per timing, after "
        "--warmup)"))
    against: Optional[str] = flag("--against", default=None,
                                  choices=("nvshmem", "nccl", "mpi"), help=(
        "with --comm: time this transport too, in the same run, size by size (the crossover "
        "is where it becomes the faster)"))
    out: str = flag("--out", default="bench.json", help="JSON to write", file="out")
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
        # --comm: every rank in one group (the collectives span the world), and no step
        c = place(replace(c, grid=Grid(dp=world)) if c.comm else c, be, world, shape,
                  None if c.comm else c.seq, c.batch, ("init", c.init), both=True)
        if c.against is not None:
            run = be.TRANSPORTS[0] if c.device.transport == "auto" else c.device.transport
            if not c.comm or c.against == run or c.against not in be.TRANSPORTS:
                raise CupyGPTError(
                    "compares a second transport's timings with --comm's" if not c.comm else
                    f"is the run's transport already (--transport {c.device.transport})"
                    if c.against == run else f"the {be.name} backend's arrays travel by "
                    f"{', '.join(be.TRANSPORTS)} only", "against", c.against)
        if c.comm:
            if world < 2:
                raise CupyGPTError("bench --comm measures communication between ranks: run "
                                   "it under mpiexec -n 2 or more")
            return c, shape
        check_outputs([("trace", c.trace)], [c.data])
        out_file("trace", c.trace, c.overwrite)
        return c, shape
