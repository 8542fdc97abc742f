"""The processes of a job: how many the launcher started, how one of them fails, and how
a signal stops them all (train's Interrupt)."""
from __future__ import annotations

import contextlib
import os
import pickle
import select
import signal
import socket
import sys
import time
from typing import Callable, NoReturn

import numpy as np

from .. import CupyGPTError
from .base import Transport, poll

YEAR_S = 365 * 86400  # the most a seconds flag takes (select and thread waits overflow
#                      near 9.2e9 s; a wait longer than a year is never meant)
_FAILURES = None  # a duplicate of COMM_WORLD used only by fail(), so nothing else matches
_TIMEOUT = None   # the command's --peer-timeout, for the start's own collectives (start_mpi)


def launched_ranks() -> int:
    """World size from the MPI launcher's environment (1 when not launched by mpiexec)."""
    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS"):
        if os.environ.get(var):
            value = os.environ[var].strip()
            if not value.isdigit() or int(value) < 1:  # (int() of 'abc': a traceback)
                raise CupyGPTError(f"{var}={os.environ[var]!r} is no number of ranks: a "
                                   f"launcher's variable set by hand? unset it, or start the "
                                   f"command with mpiexec")
            return int(value)
    return 1


def world_rank() -> int:
    """This process's rank in the job (0 when not launched by mpiexec)."""
    if launched_ranks() == 1:
        return 0
    from mpi4py import MPI
    return MPI.COMM_WORLD.Get_rank()


def host_names() -> tuple[str, ...]:
    """Every rank's host name, rank 0's first (collective under mpiexec): which ranks
    share a host, its GPUs and its memory."""
    return tuple(every_rank(socket.gethostname()))


def every_rank(value: object) -> list:
    """Collective under mpiexec: each rank's value (picklable), in rank order; a rank that
    never comes (stopped, hung) is waited for --peer-timeout, then the job ends naming the
    wait (mpi4py's allgather waits for good: the ranks comparing their flags at the start
    hung on a stopped one, before any transport's bounded waits)."""
    if launched_ranks() == 1:
        return [value]
    from mpi4py import MPI
    comm, mine = MPI.COMM_WORLD, np.frombuffer(pickle.dumps(value), np.uint8)
    sizes = np.zeros(comm.size, np.int64)
    _bounded(comm.Iallgather(np.array([mine.size], np.int64), sizes))
    at = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    every = np.empty(int(sizes.sum()), np.uint8)
    _bounded(comm.Iallgatherv(mine, [every, sizes, at, MPI.BYTE]))
    return [pickle.loads(every[a:a + n].tobytes()) for a, n in zip(at, sizes)]


def _bounded(request) -> None:
    """Waits for a nonblocking collective of the start within --peer-timeout (unbounded
    before start_mpi, or for a timeout the command's checks will refuse)."""
    if _TIMEOUT is None:
        request.Wait()
        return
    poll(request.Test, _TIMEOUT, world_rank(), "the other ranks at the command's start")


def disagreement(mine: dict) -> tuple[str, str] | None:
    """Collective under mpiexec: the first key whose value differs between the ranks and who
    holds what ("rank 0 has 4, rank 1 has 8"); None where every rank has mine. A value in
    bytes (a string as the command line gave it: one name under any locale) is shown as
    this rank's string."""
    every = every_rank(mine)
    for name in mine:
        seen = [theirs.get(name, "nothing") for theirs in every]
        if len(set(seen)) > 1:
            held = {}
            for rank, value in enumerate(seen):
                held.setdefault(value, []).append(str(rank))
            shown = {v: repr(os.fsdecode(v)) if isinstance(v, bytes) else v for v in held}
            return name, ", ".join(f"rank {ranks[0]} has {shown[v]}" if len(ranks) == 1 else
                                   f"ranks {', '.join(ranks)} have {shown[v]}"
                                   for v, ranks in held.items())
    return None


def start_mpi(timeout: float) -> None:
    """Collective, at the start of every command under mpiexec. MPI's start waits for
    every rank: when one never starts (a host in the hostfile that does not answer), the
    ranks that did give up after timeout seconds, the first of each host saying why."""
    global _FAILURES, _TIMEOUT
    # (a timeout not above 0, or above a year, is refused by the command's checks, once MPI
    # has started: select could not wait that long)
    with _watchdog(timeout) if 0 < timeout <= YEAR_S else contextlib.nullcontext():
        from mpi4py import MPI
        _FAILURES = MPI.COMM_WORLD.Dup()
    _TIMEOUT = timeout if 0 < timeout <= YEAR_S else None
    said, size = launched_ranks(), MPI.COMM_WORLD.Get_size()
    if size != said:  # (a launcher's variable left set)
        raise CupyGPTError(f"the environment says this is one of {said} ranks, and MPI's "
                           f"world has {size}: a launcher's variable (PMI_SIZE, "
                           f"OMPI_COMM_WORLD_SIZE, ...) left set; unset it, or start the "
                           f"command with mpiexec")


@contextlib.contextmanager
def _watchdog(timeout):
    """Ends this process after timeout seconds inside the block. A forked child keeps the
    time: MPI's start holds the interpreter's lock, so no thread or signal handler here
    would run."""
    done, told = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(told)
        if not select.select([done], [], [], timeout)[0]:
            if os.environ.get("MPI_LOCALRANKID",  # (hydra's; Open MPI's)
                              os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")) == "0":
                print(f"error: --peer-timeout {timeout:g}: the job's ranks did not all start "
                      f"within {timeout:g} s (MPI's start takes a second or more); does every "
                      f"host in mpiexec's hostfile answer (and reach this one, "
                      f"{socket.gethostname()})?", file=sys.stderr, flush=True)
                time.sleep(0.5)  # the launcher forwards the line before it tears down
                os.kill(os.getppid(), signal.SIGKILL)
            # the launcher ends the job when one rank dies: the one saying why dies first
            elif not select.select([done], [], [], 2)[0]:
                os.kill(os.getppid(), signal.SIGKILL)
        os._exit(0)
    os.close(done)
    try:
        yield
    finally:
        os.close(told)  # the child sees the pipe closed and goes
        os.waitpid(pid, 0)


class Stopped(SystemExit):
    """Stops this process at once (a second signal); what it unwinds removes what was half
    written, then stop_job ends the job."""


def stop_job(code: int) -> None:
    """Under mpiexec the other ranks may be waiting on this one: the job is aborted."""
    if _FAILURES is not None:
        sys.stdout.flush()
        _FAILURES.Abort(code)
    sys.exit(code)


def fail(message: str, undo: Callable[[], None] = lambda: None,
         window: float = 2.0) -> NoReturn:
    """Ends this process for an error, undo() first removing what it made. Under mpiexec:
    if every rank fails within `window` seconds (bad input, a NaN loss) one line is
    printed, the first failure's (a rank failing for its own reason makes the others fail
    on what it left: theirs are its consequences), and all exit 1; a rank that fails
    alone prints its line, tagged with its rank, and aborts the job (no rank hangs). undo
    waits for that outcome: until then the other ranks may be using what it removes (rank
    0 writes the -o another rank made)."""
    if _FAILURES is None:
        undo()
        print(message, file=sys.stderr, flush=True)
        sys.exit(1)
    when = time.time()
    req = _FAILURES.Ibarrier()
    deadline = time.monotonic() + window
    while not req.Test():
        if time.monotonic() > deadline:
            print(f"[pe{_FAILURES.rank}] {message}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            time.sleep(0.2)  # let the launcher forward the line before the abort tears down
            undo()
            _FAILURES.Abort(1)
        time.sleep(1e-3)
    undo()
    failures = _FAILURES.gather((when, message), root=0)
    if _FAILURES.rank == 0:
        first = min(range(len(failures)), key=lambda r: failures[r][0])
        same = all(m == message for _, m in failures)
        print(message if same else f"[pe{first}] {failures[first][1]}", file=sys.stderr,
              flush=True)
    sys.exit(1)


# HUP: the terminal closed; USR1: what SLURM's --signal sends ahead of a time limit; XCPU:
# a CPU-time limit (ulimit -t) reached, SIGKILL to follow at its hard limit
STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGXCPU)


def stopping() -> list[int]:
    """The signals that stop a command: SIGHUP too, unless ignored (nohup: left so)."""
    return [s for s in STOPPING
            if not (s == signal.SIGHUP and signal.getsignal(s) == signal.SIG_IGN)]


def stop_at_once(signum: int, _) -> NoReturn:
    """Every command's handler of the STOPPING signals (SIGTERM: what SLURM and Kubernetes
    send before a kill) outside train's loop: Stopped unwinds through what is being written
    (atomic_write, checkpoint.save, prepare's --out remove what they half wrote or made)
    and the CLI exits 128 + the signal, quietly."""
    raise Stopped(128 + signum)


def on_signals() -> None:
    for s in stopping():
        signal.signal(s, stop_at_once)


class Interrupt:
    """train's handler: a STOPPING signal sets a flag, which the loop's phases (each step's
    end, and between the batches of validation, HellaSwag and sampling) combine over the
    ranks (stopping), so a signal to one rank stops all within a batch, the run's state
    kept. A second signal stops at once (stop_at_once)."""

    def __init__(self) -> None:
        self.hit = None
        self.old = {s: signal.signal(s, self.handle) for s in stopping()}

    def handle(self, signum: int, _) -> None:
        if self.hit:
            os.write(2, f"{signal.Signals(signum).name} again: stopping now; nothing "
                        f"half-written is left\n".encode())
            stop_at_once(signum, _)
        self.hit = signum

    def stopping(self, transport: Transport) -> bool:
        """Collective: whether any rank has been signalled."""
        return transport.any(self.hit is not None)

    def code(self, transport: Transport) -> int | None:
        """Collective: 128 + the signal the lowest signalled rank got, on every rank."""
        hits = transport.gather(self.hit)
        return transport.bcast(128 + next(h for h in hits if h) if hits else None)

    def restore(self) -> None:
        for s, handler in self.old.items():
            signal.signal(s, handler)
