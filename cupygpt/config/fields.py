"""Each setting declared once: a config field carries its command-line spelling (flags, help,
choices) in its metadata, and cli/ makes every click option from the fields, so a default
is written in one place and the library's defaults are the CLI's. The factories below are
the flags several commands share (-b, -t, --dtype, --trace, ...), each declared here once."""
import dataclasses
from dataclasses import MISSING, field

from ..parallel.pipeline.schedule import SCHEDULES
from ..paths import TOKENIZER


def flag(*decls, default=MISSING, help=None, choices=None, shown=None, metavar=None,
         argument=False, required=False, nargs=None, multiple=False, path=False):
    """A field that is also a command-line parameter: decls are click's spellings
    ("-b", "--graphs/--no-graphs", aliases "--overwrite", "--force"; none for an argument),
    shown the [default: ...] text where the default is worked out later (None until
    validate resolves it); nargs=-1 an argument taking every word left, multiple an option
    given again for each value (both a tuple), path a file path (click checks one that
    exists is readable)."""
    return field(default=default, metadata=dict(
        decls=decls, help=help, choices=choices, shown=shown, metavar=metavar,
        argument=argument, required=required, nargs=nargs, multiple=multiple, path=path))


def section(cls, flags=True):
    """A config's share of a section (Device, Grid, Pipeline); flags=False where the command
    sets it itself (sample's pipeline of every rank), so the section's flags are not its."""
    return field(default_factory=cls, metadata=dict(section=flags))


def batch(default=4, help="batch size B"):
    return flag("-b", default=default, help=help)


def seq(help="sequence length  [default: 1024 on a GPU, 64 on the CPU]"):
    return flag("-t", default=None, help=help)


def dtype(choices, default=None, help=None):
    return flag("--dtype", default=default, choices=choices, help=help)


def graphs(help):
    return flag("--graphs/--no-graphs", default=None, help=help)


def recompute(help="activation recomputation (llm.c's -r): 1 keeps no GELU output, 2 also "
                   "no layernorm output; each recomputed in the backward"):
    return flag("-r", default=0, help=help)


def grad_clip(help="clip the gradient at this global norm (0: off)"):
    return flag("--grad-clip", default=1.0, help=help)


def tokenizer(help=None):
    return flag("--tokenizer", default=TOKENIZER, help=help)


def schedule(*aliases):
    return flag("--schedule", *aliases, default="1f1b", choices=tuple(SCHEDULES))


def virtual_stages(*aliases):
    return flag("--virtual-stages", *aliases, default=None, help=(
        "model chunks per rank (interleaved; zbv holds 2)  [default: 2 with interleaved, "
        "else 1]"))  # None: the schedule's own (chunks_per_rank)


def trace():
    return flag("--trace", default=None, metavar="PATH", help=(
        "write every rank's pipeline actions (start, end) as one Chrome trace-event JSON "
        "(open in Perfetto or chrome://tracing)"))


def overwrite(help="replace the files this command writes (--out, --trace) where they exist",
              *aliases):
    """(aliases: convert's and prepare's --force, the older name they still take)"""
    return flag("--overwrite", *aliases, default=False, help=help)


def init(help):
    return flag("-e", default=None, help=help)


def seed(help):
    return flag("--seed", default=1337, help=help)


def as_json(help="print one JSON object"):
    return flag("--json", default=False, help=help)


def values(config):
    """A config's (field, value's repr) pairs, its sections' fields in their place: what
    ranks compare to know they run one command alike."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            yield from values(value)
        else:
            yield f.name, repr(value)
