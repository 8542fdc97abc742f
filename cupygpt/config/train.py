"""train's config: a run's settings, checked by its validate() before anything is
allocated, as the other commands' (configs.py). It reads what its checks need (headers, the
HellaSwag file) and keeps none of it, and makes nothing: train's start makes -o and the
directories of --trace and --log-file (train/rundir.py)."""
import glob
import os
from dataclasses import dataclass, replace
from typing import Optional

from .. import CupyGPTError
from ..formats.checkpoint import (
    STATE,
    beside,
    check_model,
    check_resume,
    holding,
    newer,
    removed,
    reserved,
    vanished,
)
from ..formats.checkpoint import resolve as resolve_checkpoint
from ..formats.llmc import Shard, is_model_file, shard_files
from ..formats.model_spec import model_shape
from ..model.optim import LR_SCHEDULES
from ..model.shape import flops_per_token
from ..paths import DATA, check_dir, check_outputs, files_of
from . import fields
from .configs import hellaswag_seq
from .fields import flag
from .sections import (
    RUN_DTYPES,
    Device,
    Grid,
    Pipeline,
    between,
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


@dataclass(frozen=True)
class TrainConfig:
    train_pattern: str = flag("-i", default=os.path.join(DATA, "tiny_shakespeare_train.bin"),
                              help="train shards (glob)", file="in")
    val_pattern: str = flag("-j", default=os.path.join(DATA, "tiny_shakespeare_val.bin"),
                            help="val shards (glob; '': no validation)", file="in", empty=None)
    shuffle: bool = flag("--shuffle/--no-shuffle", default=True, help=(
        "train shards and the batches in each in a seeded random order per epoch (llm.c's); "
        "--no-shuffle: in file order"))
    init: Optional[str] = fields.init((
        "llm.c model file, or one of llm.c's descriptors for a fresh model: d6, d12 .. d84 "
        "(GPT-2 by depth), gpt3:c768 .. (GPT-3 by channels, T 2048), or tiny  [default: d12 "
        "on a GPU, tiny on the CPU]"))  # None: the backend's DEFAULT_RUN
    out: str = flag("-o", default="out", help="output directory", file="out",
                    empty="a directory name")
    batch: int = fields.batch()
    seq: Optional[int] = fields.seq("sequence length T  [default: 1024 on a GPU, 64 on the "
                                    "CPU]")  # None: the backend's DEFAULT_RUN
    lr: float = flag("-l", default=1e-3, help="learning rate")
    warmup: int = flag("-u", default=10, help="lr warm-up steps (none with -k constant, as "
                                              "llm.c's)")
    final_lr_frac: float = flag("-q", default=0.1, help="final lr as a fraction of -l (where "
                                                        "the schedule decays)")
    lr_schedule: str = flag("-k", default="cosine", choices=LR_SCHEDULES,
                            help="lr schedule after the warm-up (llm.c's; constant: the lr "
                                 "throughout, no warm-up)")
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
    grad_clip: float = fields.grad_clip()
    seed: int = fields.seed("initialisation and sampling seed")
    tokenizer: str = fields.tokenizer()
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
    resume: Optional[str] = flag("--resume", default=None, file="in", empty=(
        "a checkpoint directory (or a run's -o), or leave --resume out for a fresh run"),
                                 help="checkpoint dir (or a run's -o dir) to continue")
    log_file: Optional[str] = flag("--log-file", default=None, file="out",
                                   help="JSON lines per step (default OUT/log.jsonl)")
    hellaswag: int = flag("-h", default=0, help=(
        "1: HellaSwag accuracy at every val step and at the end (needs -b 4 or more)"))
    hellaswag_file: str = flag("--hellaswag-file", default=os.path.join("data",
                                                                        "hellaswag_val.bin"),
                               help="llm.c's eval file for -h 1 (`prepare --hellaswag`)",
                               file="in")
    overwrite: bool = fields.overwrite(
        "a fresh run may replace what an earlier run left in -o (its model.bin, log and "
        "checkpoints) and an existing --trace file")
    graphs: Optional[bool] = fields.graphs(
        "replay each step as a CUDA graph (a GPU alone, or over nvshmem without the "
        "overlapped dp sum)  [default: on with --backend cuda]")
    trace: Optional[str] = fields.trace()  # Chrome trace-event JSON of every rank's actions
    device: Device = fields.section(Device)
    grid: Grid = fields.section(Grid)
    pipeline: Pipeline = fields.section(Pipeline)

    @property
    def micro_steps(self):
        """Batches per step: gradient accumulation's (-d / (B x T)), once validated."""
        return self.total_batch // (self.batch * self.seq)

    def _resumed(self, c):
        """(c, the model's shape) of a resume: its checkpoint found and checked to fit. One
        that a live run's --keep removes while it is read gives way to the newest that
        stays when a run's -o was named (a live run writes a newer one before it prunes)."""
        for _ in range(3):
            found = resolve_checkpoint(c.resume)
            whole = not vanished(found)  # (else its own error: not a checkpoint)
            try:
                return self._fits(replace(c, resume=found))
            except (CupyGPTError, OSError):
                if not (whole and vanished(found)):
                    raise
                if os.path.normpath(found) == os.path.normpath(c.resume):  # (it was named)
                    raise removed(found) from None
        raise removed(found)

    def _fits(self, c):
        """(c, the model's shape) when c.resume's checkpoint fits this run's settings."""
        check_model(c.resume)  # (a model.bin swapped in is damage, not the user's settings)
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
        if c.lr * c.weight_decay >= 1:  # (AdamW's decoupled decay scales weights by 1 - lr wd)
            raise CupyGPTError(f"with -l {c.lr:g} each update scales the weights by 1 - "
                               f"{c.lr * c.weight_decay:g}, erasing them; give a weight decay "
                               f"below 1 / lr = {1 / c.lr:g}", "weight_decay", c.weight_decay)
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
        c = place(c, be, world, shape, c.seq, c.batch, ("init", c.init))
        if c.hellaswag not in (0, 1):
            raise CupyGPTError("0 (off) or 1 (HellaSwag at every val step)", "hellaswag",
                               c.hellaswag)
        if c.hellaswag:
            hellaswag_seq(c.hellaswag_file, c.batch, c.seq, shape)
        log_file = default(c.log_file, os.path.join(c.out, "log.jsonl"))
        check_outputs([("out", c.out), ("out", os.path.join(c.out, "model.bin")),
                       ("log_file", log_file), ("trace", c.trace)], self._inputs(c))
        for name, path in (("log_file", log_file), ("trace", c.trace)):
            own = reserved(c.out, path) if path else None
            if own:  # (the log written over `latest`, or removed with a checkpoint)
                raise CupyGPTError(f"lies at {own} in -o {c.out}, a name the run's checkpoints "
                                   f"take; give another name", name, path)
        self._overwritten(c)
        # in the order train's start makes their directories (rundir)
        out_file("trace", c.trace, c.overwrite)
        out_file("log_file", c.log_file)
        check_dir("out", c.out)
        out_file("log_file", log_file)  # (the default: only not a directory)
        in_vocab(c, shape, scan_limit(shape, c.seq, c.total_batch, be.peak_flops(c.dtype)))
        return replace(c, log_file=log_file), shape

    def _overwritten(self, c):
        """What --overwrite would remove must not be this run's input (-e inside one of
        -o's checkpoints), and a resume that goes back to an earlier checkpoint of its own
        -o leaves no later one behind (a later --resume of -o would take that, another
        run's future): refused, or with --overwrite removed (rundir) ."""
        own = c.resume and beside(c.out, c.resume)  # (its -o's earlier checkpoints stay)
        for path in (self._inputs(c) if c.overwrite and not own and os.path.isdir(c.out)
                     else []):
            ckpt = holding(c.out, path)
            if ckpt:
                raise CupyGPTError(f"--overwrite removes its earlier checkpoints, {ckpt} "
                                   f"among them, which holds this run's input {path}; copy "
                                   f"that out of -o first, or give another -o", "out", c.out)
        later = newer(c.out, c.resume) if c.resume and os.path.isdir(c.out) else []
        if later and not c.overwrite:
            raise CupyGPTError(f"holds checkpoints after the resumed "
                               f"{os.path.basename(os.path.normpath(c.resume))} "
                               f"({', '.join(later)}): continuing here would leave them as "
                               f"if this run wrote them; add --overwrite to remove them, or "
                               f"give another -o", "out", c.out)

    @staticmethod
    def _inputs(c):
        """Every file the run reads: shards, the model or checkpoint, the tokenizer."""
        model = c.init if is_model_file(c.init) else None
        resumed = [os.path.join(c.resume, f) for f in ("model.bin", STATE)] if c.resume else []
        return [*glob.glob(c.train_pattern), *(glob.glob(c.val_pattern) if c.val_pattern
                                               else []),
                *files_of(model), *resumed, *files_of(c.tokenizer),
                *(files_of(c.hellaswag_file) if c.hellaswag else [])]


# a token read (from the page cache) and compared takes about a nanosecond; a backend that
# names no peak (the CPU's) is taken at 1e11 FLOP/s
SCAN_TOKENS_PER_S, HOST_FLOPS = 1e9, 1e11


def scan_limit(shape, seq, total_batch, peak_flops):
    """The most tokens a scan of the shards reads in the time of one training step."""
    step_s = flops_per_token(shape, seq) * total_batch / (peak_flops or HOST_FLOPS)
    return int(step_s * SCAN_TOKENS_PER_S)


def in_vocab(c, shape, limit):
    """Refuses -i's or -j's shards holding a token outside the model's vocab, read whole
    when that costs less than a step (at most limit tokens); larger ones the loader checks
    batch by batch, and an error mid-run keeps the steps trained (train/loop.py)."""
    for name in (n for n in ("train_pattern", "val_pattern") if getattr(c, n)):
        shards = [Shard(path) for path in shard_files(getattr(c, name), name)]
        if sum(s.size for s in shards) <= limit:
            _scan(c, name, shards, shape)


def _scan(c, name, shards, shape):
    for s in shards:
        found = s.outside(shape.V)
        if found:
            shard = "" if s.path == getattr(c, name) else f"{s.path}: "
            raise CupyGPTError(f"{shard}token {found[1]} (the shard's token {found[0]:,}) is "
                               f"outside the model's vocab (V={shape.V}); was it tokenized "
                               f"for this model?", name, getattr(c, name))
