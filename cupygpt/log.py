"""Per-rank output: one prefix and colour per rank (pe0 blue, pe1 magenta, ...); colour only
on a terminal."""
import os
import sys

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
