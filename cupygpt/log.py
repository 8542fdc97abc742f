"""Per-rank output: one prefix and colour per rank (pe0 blue, pe1 magenta, ...); colour only
on a terminal. And train's JSON-lines log, reopened on a resume."""
import json
import os
import sys

from .files import atomic_write

COLORS = (34, 35, 36, 33, 32, 31, 94, 95)  # ANSI: blue, magenta, cyan, yellow, green, ...


class Log:
    def __init__(self, rank=0, size=1):
        self.rank, self.size = rank, size

    def __call__(self, msg, every_rank=False, rank=0):
        """Prints on `rank` only (rank 0 unless told), or on every rank when every_rank."""
        if not every_rank and self.rank != rank:
            return
        if self.size > 1:
            tag = f"[pe{self.rank}]"
            if sys.stdout.isatty():
                tag = f"\033[{COLORS[self.rank % len(COLORS)]}m{tag}\033[0m"
            msg = "\n".join(f"{tag} {line}" for line in str(msg).split("\n"))
        emit(f"{msg}\n")


def emit(text):
    """One write per message: under mpiexec the ranks share one terminal or pipe, and a line
    written in pieces (print writes the text, then the newline) interleaves with the other
    ranks' (a pipe keeps a write of up to 4 KiB whole)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # a captured stdout (in-process tests)
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    sys.stdout.flush()  # what click.echo left in the buffer goes first
    data = text.encode()
    while data:
        data = data[os.write(fd, data):]


def open_log(path, start):
    """The log, open to append: a fresh run starts it; a resume keeps what came before its
    first step (a run that went on past its checkpoint logged steps the resume repeats:
    train records up to `start`, val records before it, since step `start` validates)."""
    if not start:
        return open(path, "w")
    keep = []
    if os.path.exists(path):
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                    step = rec["step"] + ("val_loss" in rec or "hellaswag_acc" in rec)
                except (ValueError, TypeError, KeyError):
                    continue  # (a line cut short by a kill)
                if isinstance(step, int) and step <= start:
                    keep.append(line if line.endswith("\n") else line + "\n")
    with atomic_write(path) as f:
        f.write("".join(keep).encode())
    return open(path, "a")
