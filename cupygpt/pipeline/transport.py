"""The transport interface, its single-process and MPI (host-staged) forms, and the choice.

A transport moves a stage's activation forward and its residual gradient back, sums the
tied wte gradient between the first and last stage, and carries small control values
(losses, sampled tokens, verify reports) over MPI. Sends may return before the receiver
has the data; the sender may then overwrite its buffer. Receives wait, with a timeout.
"""
import os
import time

import numpy as np

from .. import CupyGPTError

TAGS = {"act": 11, "grad": 12, "tied": 13, "ctl": 14}


def launched_ranks():
    """World size from the MPI launcher's environment (1 when not launched by mpiexec)."""
    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS"):
        if os.environ.get(var):
            return int(os.environ[var])
    return 1


_FAILURES = None  # a duplicate of COMM_WORLD used only by fail(), so nothing else matches


def start_mpi():
    """Collective, at the start of every command under mpiexec."""
    global _FAILURES
    from mpi4py import MPI
    _FAILURES = MPI.COMM_WORLD.Dup()


def fail(message, window=2.0):
    """Ends this process for an error. Under mpiexec: if every rank fails within `window`
    seconds (bad input, a NaN loss) rank 0 prints the one line and all exit 1; a rank that
    fails alone prints its line, tagged with its rank, and aborts the job (no rank hangs)."""
    import sys
    if _FAILURES is None:
        print(message, file=sys.stderr, flush=True)
        sys.exit(1)
    req = _FAILURES.Ibarrier()
    deadline = time.monotonic() + window
    while not req.Test():
        if time.monotonic() > deadline:
            print(f"[pe{_FAILURES.rank}] {message}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            time.sleep(0.2)  # let the launcher forward the line before the abort tears down
            _FAILURES.Abort(1)
        time.sleep(1e-3)
    if _FAILURES.rank == 0:
        print(message, file=sys.stderr, flush=True)
    sys.exit(1)


class Local:
    """One process: no peers, control values stay where they are."""
    name, rank, size = "local", 0, 1

    def bcast(self, obj, root=0):
        return obj

    def gather(self, obj):
        return [obj]

    def barrier(self):
        pass

    def prepare(self, shapes):
        """Called once by every rank with {kind: (shape, depth)}; GPU transports allocate
        their buffers here (collectively)."""

    def any(self, flag):
        """True on every rank when flag is true on any."""
        return bool(flag)

    def finish_sends(self):
        pass


class Mpi(Local):
    """mpi4py, host-staged: works with any backend, CI runs real pipelines with it."""
    name = "mpi"

    def __init__(self, be, timeout):
        from mpi4py import MPI
        self.MPI, self.comm, self.be, self.timeout = MPI, MPI.COMM_WORLD, be, timeout
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.pending = []

    def bcast(self, obj, root=0):
        return self.comm.bcast(obj, root=root)

    def gather(self, obj):
        return self.comm.gather(obj, root=0)

    def barrier(self):
        self.wait(self.comm.Ibarrier(), "the other ranks at a barrier")

    def any(self, flag):
        """Through rank 0, point to point, so a timeout names the rank that went quiet."""
        buf = np.array([int(flag)], np.int32)
        if self.rank == 0:
            for r in range(1, self.size):
                got = np.zeros(1, np.int32)
                self.wait(self.comm.Irecv(got, source=r, tag=TAGS["ctl"]),
                          f"rank {r} to finish the step")
                buf |= got
            reqs = [self.comm.Isend(buf, dest=r, tag=TAGS["ctl"]) for r in range(1, self.size)]
            for r, req in enumerate(reqs, 1):
                self.wait(req, f"rank {r} to take the step's verdict")
        else:
            self.wait(self.comm.Isend(buf, dest=0, tag=TAGS["ctl"]), "rank 0 to finish the step")
            self.wait(self.comm.Irecv(buf, source=0, tag=TAGS["ctl"]), "rank 0's verdict")
        return bool(buf[0])

    def wait(self, req, what):
        """Waits on an MPI request, polling so a lost peer becomes an error, not a hang."""
        deadline, nap = time.monotonic() + self.timeout, 1e-5
        while not req.Test():
            if time.monotonic() > deadline:
                raise CupyGPTError(f"rank {self.rank}: timed out after {self.timeout:g}s waiting "
                                   f"for {what} (--peer-timeout); is that rank alive?")
            time.sleep(nap)
            nap = min(nap * 2, 1e-3)

    def send(self, kind, arr, peer, mb=None):
        host = np.array(self.be.to_host(arr), copy=True)
        self.pending.append((self.comm.Isend(host, dest=peer, tag=TAGS[kind]), host))
        self.pending = [(r, h) for r, h in self.pending if not r.Test()]

    def recv(self, kind, out, peer, mb=None):
        host = np.empty(out.shape, out.dtype)
        self.wait(self.comm.Irecv(host, source=peer, tag=TAGS[kind]),
                  f"{'activation' if kind == 'act' else 'gradient'} of micro-batch {mb} "
                  f"from rank {peer}")
        self.be.upload(out, host)

    def sum_tied(self, arr, peer):
        """arr becomes (first stage's + last stage's), bit-identical on both ranks."""
        mine = np.array(self.be.to_host(arr), copy=True)
        theirs = np.empty_like(mine)
        req = self.comm.Isendrecv(mine, dest=peer, sendtag=TAGS["tied"], recvbuf=theirs,
                                  source=peer, recvtag=TAGS["tied"])
        self.wait(req, f"the tied wte gradient from rank {peer}")
        first, last = (mine, theirs) if self.rank < peer else (theirs, mine)
        self.be.upload(arr, first + last)

    def finish_sends(self):
        for req, _ in self.pending:
            self.wait(req, "a send to be received")
        self.pending = []


def make_transport(name, be, timeout):
    """name: auto | mpi | nvshmem | nccl. Refuses a transport that cannot work here."""
    size = launched_ranks()
    if size == 1:
        return Local()
    if name == "auto":
        name = "nvshmem" if be.name == "cuda" else "mpi"
    if name == "mpi":
        return Mpi(be, timeout)
    if be.name != "cuda":
        raise CupyGPTError(f"--transport {name}: needs --backend cuda (GPU memory); "
                           f"use --transport mpi on the CPU")
    if name == "nvshmem":
        from .nvshmem import Nvshmem
        return Nvshmem(be, timeout)
    if name == "nccl":
        from .nccl import Nccl
        return Nccl(be, timeout)
    raise CupyGPTError(f"--transport {name}: unknown; use auto, nvshmem, nccl or mpi")
