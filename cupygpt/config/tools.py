"""The configs of the commands beside training (prepare, convert, schedule, plot,
timeline), one frozen dataclass each: every field declares its flag as configs.py's do, so
each option and its default are written here once and cli/tools.py makes them from the
fields. Their checks stay with the commands' work (nothing here depends on a device)."""
import os
from dataclasses import dataclass
from typing import Optional

from .. import CupyGPTError
from ..parallel.pipeline.schedule import SCHEDULES
from . import fields
from .fields import flag
from .sections import RUN_DTYPES

# what plot and timeline draw into, by --out's extension (matplotlib's writers; none: PNG)
IMAGES = ("png", "pdf", "svg", "jpg", "jpeg", "webp", "tif", "tiff", "eps", "ps")
IMAGE_HELP = "image to write, its kind by its extension (png, pdf, svg, jpg, webp, tiff, eps)"


def image_format(out):
    """matplotlib's format for an image written to out: its extension's (a .jpg file holding
    PNG data fooled every reader that trusts the name), PNG without one; another refused."""
    ext = os.path.splitext(out)[1][1:].lower()
    if ext and ext not in IMAGES:
        raise CupyGPTError(f"cannot write .{ext} images; give --out an extension of "
                           f"{', '.join(IMAGES)}", "out", out)
    return ext or "png"


@dataclass(frozen=True)
class PrepareConfig:
    inputs: tuple[str, ...] = flag(argument=True, nargs=-1, required=True, file="in")
    out: str = flag("--out", default="data", help="output directory", file="out",
                    empty="a directory name")
    tokenizer: str = fields.tokenizer()
    name: Optional[str] = flag("--name", default=None, help=(
        "shard name prefix  [default: the first input's file name without its extension]"))
    shard_size: Optional[int] = flag("--shard-size", default=None, help=(
        "tokens per shard: the corpus mode, llm.c's FineWeb script (its default with several "
        "inputs or jsonl/parquet: 100,000,000)"))  # None: commands/prepare.py's SHARD_SIZE
    force: bool = fields.overwrite("replace shards already there (--force: its older name)",
                                  "--force")
    workers: Optional[int] = flag("--workers", default=None, help=(
        "tokenizing processes in the corpus mode  [default: one per core]"))
    hellaswag: bool = flag("--hellaswag", default=False, help=(
        "the one input is HellaSwag's jsonl (ctx, endings, label): write llm.c's eval file "
        "OUT/NAME.bin for `eval` and train's -h 1, tokenized as llm.c's script"))


@dataclass(frozen=True)
class ConvertConfig:
    src: str = flag(argument=True, required=True, file="in", empty="a path")
    dst: str = flag(argument=True, required=True, file="out", empty="a path")
    dtype: str = fields.dtype(RUN_DTYPES, default="fp32", help="the llm.c file's")
    tokenizer: str = fields.tokenizer("its vocab.json, merges.txt go beside a model with its vocab")
    force: bool = fields.overwrite(
        "replace an existing llm.c model file DST (--force: its older name)", "--force")


@dataclass(frozen=True)
class ScheduleConfig:
    stages: int = flag("--stages", "-p", default=4)
    micro_batches: int = flag("--micro-batches", "-m", default=8)
    schedule: str = fields.schedule()
    virtual_stages: Optional[int] = fields.virtual_stages("-v")
    backward_cost: float = flag("--backward-cost", default=2.0, help=(
        "time of a backward relative to a forward (split: half B, half W)"))


@dataclass(frozen=True)
class PlotConfig:
    log: str = flag(argument=True, required=True, path=True, file="in")
    out: str = flag("--out", default="loss.png", help=IMAGE_HELP, file="out")
    overwrite: bool = fields.overwrite("replace --out's file where it exists")


@dataclass(frozen=True)
class TimelineConfig:
    trace: str = flag(argument=True, required=True, path=True, file="in")
    out: str = flag("--out", default="timeline.png", help=IMAGE_HELP, file="out")
    schedule: Optional[str] = flag("--schedule", default=None, choices=tuple(SCHEDULES),
                                   help="the run's schedule, for the prediction  [default: "
                                        "the trace's]")
    overwrite: bool = fields.overwrite("replace --out's file where it exists")
