"""Per-rank output: one prefix and colour per rank (pe0 blue, pe1 magenta, ...); colour only
on a terminal. Standard output and error that outlive their reader, and a standard output
that cannot be written (closed, a full disk) reported as coreutils do. And train's
JSON-lines log, reopened on a resume."""
import errno
import fcntl
import io
import os
import sys

from .paths import atomic_write, loads

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


FDS = {"stdout": 1, "stderr": 2}  # their fds (guard_streams: a closed one's stand-in)
CLOSED = set()  # fds closed when the command started, now /dev/null: writing is an error
FAILED = []     # standard output's write error, said once: the command ends in exit 1


def write_fd(fd, data):
    """All of data to fd. A reader that closed its end (`train | head -2`) costs nothing:
    the fd is pointed at /dev/null, so this write and every later one, from any writer,
    succeed, and the command goes on (a run writes its model and log) and ends as it would
    have, quietly, as Unix tools do. Any other failure (`>&-`: closed; `> /dev/full`: no
    space; EIO) loses what stdout shows, so it is a write error, as coreutils' is: said
    once on stderr, then the same /dev/null; the command still does its work (a training
    run keeps training, its log and model intact) and exits 1 at its end (entry)."""
    if fd in CLOSED:
        CLOSED.discard(fd)
        return failed(fd, os.strerror(errno.EBADF))
    while data:
        try:
            data = data[os.write(fd, data):]
        except BrokenPipeError:
            to_null(fd)
        except OSError as e:
            to_null(fd)
            return failed(fd, e.strerror)


def to_null(fd):
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, fd)
    os.close(null)


def failed(fd, why):
    """stdout's write error, said once (stderr's own has nowhere to be said)."""
    if fd == FDS["stdout"] and not FAILED:
        FAILED.append(why)
        write_fd(FDS["stderr"], f"error: standard output: write error ({why}); what the "
                 f"command prints is lost, it goes on and exits 1 at its end\n".encode())


class _Raw(io.RawIOBase):
    """fd's writes through write_fd."""

    def __init__(self, fd):
        super().__init__()
        self.fd = fd

    def writable(self):
        return True

    def write(self, b):
        write_fd(self.fd, bytes(b))
        return len(b)

    def fileno(self):
        return self.fd

    def isatty(self):
        return os.isatty(self.fd)


def guard_streams():
    """sys.stdout and sys.stderr, as they are (encoding, buffering), but writing through
    write_fd: every writer (click.echo, print, emit) survives a closed pipe. One closed when
    the command started (None: `>&-`) becomes /dev/null whose first write is the error.
    (A captured stream, in-process tests, is left alone.)"""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None:  # (a new fd, not dup2 onto 1 or 2: a file may hold that number)
            fd = os.open(os.devnull, os.O_WRONLY)
            CLOSED.add(fd)
            stream = io.TextIOWrapper(io.BytesIO(), encoding="utf-8",  # (its settings only:
                                      errors="backslashreplace")  # no second /dev/null fd)
        else:
            try:
                fd = stream.fileno()
            except (AttributeError, OSError, ValueError):
                continue
        if isinstance(getattr(stream, "buffer", None), io.BufferedWriter) and \
                isinstance(stream.buffer.raw, _Raw):
            continue  # (already guarded)
        stream.flush()
        FDS[name] = fd
        # (a text its encoding cannot hold, PYTHONIOENCODING=latin-1 and a sample in
        # Japanese, was a UnicodeEncodeError: escaped instead)
        errors = "backslashreplace" if stream.errors == "strict" else stream.errors
        setattr(sys, name, io.TextIOWrapper(
            io.BufferedWriter(_Raw(fd)), encoding=stream.encoding, errors=errors,
            line_buffering=stream.line_buffering or name == "stderr",
            write_through=stream.write_through))


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
    write_fd(fd, text.encode(errors="surrogateescape"))  # (a path's bytes, as given)


def open_log(path, start, note=None):
    """The log, open to append: a fresh run starts it; a resume keeps what came before its
    first step (a run that went on past its checkpoint logged steps the resume repeats:
    train records up to `start`, val records before it, since step `start` validates), and
    tells note(line) how many unreadable lines it dropped (one cut short by a kill).
    Either way a new file replaces the name (an earlier log hard-linked elsewhere was
    rewritten in place, the other name's file with it)."""
    keep, dropped, later = [], 0, []
    if start and os.path.exists(path):
        with open(path, encoding="utf-8-sig", errors="replace") as f:  # (-sig: an editor's BOM)
            for line in f:
                try:
                    rec = loads(line)
                    step = rec["step"] + ("val_loss" in rec or "hellaswag_acc" in rec)
                except (ValueError, TypeError, KeyError):
                    dropped += bool(line.strip())
                    continue
                if isinstance(step, int) and step <= start:
                    keep.append(line if line.endswith("\n") else line + "\n")
                elif "train_loss" in rec and type(rec["step"]) is int:
                    later.append(rec["step"])
    if dropped and note:
        note(f"note: {path}: dropped {dropped} unreadable line{'s' * (dropped > 1)} (a run "
             f"stopped while writing one, or an edit)")
    if later and note:  # (the run went on past its newest checkpoint: those steps are redone)
        note(f"note: {path} went on to step {max(later)}, past the checkpoint's {start}: "
             f"its records after step {start} are dropped, this run writing its own")
    with atomic_write(path) as f:
        f.write("".join(keep).encode())
        # train's claim holds the log (paths.hold): this file, which replaces it, too
        held = os.dup(f.fileno())
        fcntl.flock(held, fcntl.LOCK_EX)
    return os.fdopen(held, "a")
