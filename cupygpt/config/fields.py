"""Each setting declared once: a config field carries its command-line spelling (flags, help,
choices) in its metadata, and cli/ makes every click option from the fields, so a default
is written in one place and the library's defaults are the CLI's. The factories below are
the flags several commands share (-b, -t, --dtype, --trace, ...), each declared here once."""
import dataclasses
import glob
import hashlib
import os
from dataclasses import MISSING, field

from ..parallel.pipeline.schedule import SCHEDULES
from ..paths import TOKENIZER, not_regular

WHOLE = 1 << 30  # the input bytes ranks hash whole to compare (held); beyond, sampled


def flag(*decls, default=MISSING, help=None, choices=None, shown=None, metavar=None,
         argument=False, required=False, nargs=None, multiple=False, path=False, file=None,
         empty="a file name"):
    """A field that is also a command-line parameter: decls are click's spellings
    ("-b", "--graphs/--no-graphs", aliases "--overwrite", "--force"; none for an argument),
    shown the [default: ...] text where the default is worked out later (None until
    validate resolves it); nargs=-1 an argument taking every word left, multiple an option
    given again for each value (both a tuple), path a file path (click checks one that
    exists is readable); file what ranks compare of a path (values): "in" an input's
    content, "out" the real path of an output, "model" -e's (a file's content, or a
    descriptor as given); empty what to give instead of '' for a path (a variable left unset,
    --resume "$CKPT", names nothing: refused by cli/), None where '' means something (-j '':
    no validation)."""
    return field(default=default, metadata=dict(
        decls=decls, help=help, choices=choices, shown=shown, metavar=metavar,
        argument=argument, required=required, nargs=nargs, multiple=multiple, path=path,
        file=file, empty=empty if file else None))


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
    return flag("--tokenizer", default=TOKENIZER, help=help, file="in")


def schedule(*aliases):
    return flag("--schedule", *aliases, default="1f1b", choices=tuple(SCHEDULES))


def virtual_stages(*aliases):
    return flag("--virtual-stages", *aliases, default=None, help=(
        "model chunks per rank (interleaved; zbv holds 2)  [default: 2 with interleaved, "
        "else 1]"))  # None: the schedule's own (chunks_per_rank)


def trace():
    return flag("--trace", default=None, metavar="PATH", file="out", help=(
        "write every rank's pipeline actions (start, end) as one Chrome trace-event JSON "
        "(open in Perfetto or chrome://tracing)"))


def overwrite(help="replace the files this command writes (--out, --trace) where they exist",
              *aliases):
    """(aliases: convert's and prepare's --force, the older name they still take)"""
    return flag("--overwrite", *aliases, default=False, help=help)


def init(help):
    return flag("-e", default=None, help=help, file="model")


def seed(help):
    return flag("--seed", default=1337, help=help)


def as_json(help="print one JSON object"):
    return flag("--json", default=False, help=help)


def values(config, contents=True):
    """A config's (field, value) pairs as ranks compare them to know they run one command
    alike, its sections' fields in their place: a string as the bytes it was given (one
    name under any locale), an output as the real path it names (-o run and -o $PWD/run
    agree), an input file by what it holds (copies on each node that differ are found; the
    same data under two names agrees), or left out (contents=False: compared before).
    Bytes are shown as the string, a str is shown as it is."""
    for f in dataclasses.fields(config):
        value, kind = getattr(config, f.name), f.metadata.get("file")
        if dataclasses.is_dataclass(value):
            yield from values(value, contents)
        elif not isinstance(value, str):
            yield f.name, repr(value)
        elif kind == "out" and value:
            yield f.name, os.fsencode(os.path.realpath(value))
        elif kind == "in" and value and os.path.isdir(value):
            yield f.name, os.fsencode(os.path.realpath(value))  # (a checkpoint directory)
        elif value and (kind == "in" or kind == "model" and os.path.isfile(value)):
            if contents:
                yield f.name, held(value)
        else:
            yield f.name, os.fsencode(value)


def held(pattern, whole=WHOLE, block=1 << 16, samples=256):
    """What the files a path or glob names hold: their count, bytes and a 128-bit hash of
    their bytes: all of them up to `whole` bytes in all (every dataset here: a start-up read
    of each file once), beyond that each file's size, first and last block and `samples`
    blocks spread between (a FineWeb's 20 GB in 16 MiB a shard). The path as given where it
    names no file; what it is where one is not a regular file (a FIFO's open blocked every
    rank before any check: validation refuses it, after the ranks agree)."""
    paths = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
    try:
        stats = [os.stat(p) for p in paths]
    except OSError:
        return os.fsencode(pattern)
    odd = next(filter(None, map(not_regular, stats)), None)
    if odd or not paths:
        return f"<{odd}>" if odd else os.fsencode(pattern)
    size, digest = sum(st.st_size for st in stats), hashlib.blake2b(digest_size=16)
    try:
        for path, st in zip(paths, stats):
            with open(path, "rb") as f:
                digest.update(st.st_size.to_bytes(8, "little"))
                at = range(0, st.st_size, block) if size <= whole else sorted({
                    0, max(0, st.st_size - block),
                    *(k * st.st_size // samples // block * block for k in range(samples))})
                for a in at:
                    digest.update(os.pread(f.fileno(), block, a))
    except OSError:
        return os.fsencode(pattern)
    return (f"<{len(paths)} file{'s' * (len(paths) > 1)}: {size:,} bytes, "
            f"{'hash' if size <= whole else 'sampled hash'} {digest.hexdigest()}>")
