"""mpi4py, host-staged: works with any backend, so CI runs real pipelines with it; the
GPU transports (nccl, nvshmem) also carry their control values over it."""
from __future__ import annotations

import pickle
from typing import Any

import numpy as np

from ..backends.protocol import Backend
from ..precision import BF16, wide
from .base import AXES, Done, Transport, chunks, poll

TAGS = {"act": 11, "grad": 12, "tied": 13, "ctl": 14}


class Mpi(Transport):
    name = "mpi"

    def __init__(self, be: Backend, mesh, timeout: float) -> None:
        from mpi4py import MPI
        self.comm, self.be, self.timeout = MPI.COMM_WORLD, be, timeout
        self.rank, self.size = mesh.rank, mesh.size
        self.pending = []
        # one communicator per group; Split is collective, every rank calls it per axis
        self.groups = {}
        for axis in AXES:
            mine = [i for i, g in enumerate(mesh.groups(axis)) if self.rank in g][0]
            self.groups[axis] = self.comm.Split(mine, self.rank)
        # overlapped all-reduces start their all-gathers when their all-to-all has landed,
        # which may interleave with later all-to-alls: on a communicator of their own, so
        # each communicator's collectives start in the same order on every member
        self.gather_groups = {axis: c.Dup() for axis, c in self.groups.items()}

    # Control values travel pickled, through non-blocking collectives polled against the
    # peer timeout (mpi4py's pickling bcast and gather block for good on a stopped rank).

    def bcast(self, obj: Any, root: int = 0) -> Any:
        data = pickle.dumps(obj) if self.rank == root else b""
        n = np.array([len(data)], np.int64)
        what = (f"rank {root}'s broadcast" if self.rank != root else
                "the other ranks to take this rank's broadcast")
        self.wait(self.comm.Ibcast(n, root=root), what)
        buf = np.frombuffer(data, np.uint8).copy() if self.rank == root else np.empty(
            int(n[0]), np.uint8)
        self.wait(self.comm.Ibcast(buf, root=root), what)
        return obj if self.rank == root else pickle.loads(buf.tobytes())

    def gather(self, obj: Any) -> list | None:
        data = np.frombuffer(pickle.dumps(obj), np.uint8)
        sizes = np.zeros(self.size, np.int64)
        what = ("rank 0 to take this rank's part of a gather" if self.rank else
                "the parts of a gather from " + ", ".join(f"rank {q}" for q in range(1, self.size)))
        mine = np.array([data.size], np.int64)  # (named: a nonblocking call's buffers must
        self.wait(self.comm.Igather(mine, sizes, root=0), what)  # outlive it, not be freed)
        got = np.empty(int(sizes.sum()) if self.rank == 0 else 0, np.uint8)
        counts = sizes.astype(np.int32)
        self.wait(self.comm.Igatherv(data, [got, counts], root=0), what)
        if self.rank:
            return None
        ends = np.cumsum(sizes)
        return [pickle.loads(got[e - n:e].tobytes()) for n, e in zip(sizes, ends)]

    def barrier(self) -> None:
        others = ", ".join(f"rank {q}" for q in range(self.size) if q != self.rank)
        self.wait(self.comm.Ibarrier(), f"the other ranks ({others}) at a barrier")

    def any(self, flag: bool) -> bool:
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

    def wait(self, req, what: str) -> None:
        """Waits on an MPI request, polling so a lost peer becomes an error, not a hang."""
        poll(req.Test, self.timeout, self.rank, what)

    def send(self, kind: str, arr, peer: int, mb: int | None = None) -> None:
        host = np.array(self.be.to_host(arr), copy=True)
        self.pending.append((self.comm.Isend(_raw(host), dest=peer, tag=TAGS[kind]), host))
        self.pending = [(r, h) for r, h in self.pending if not r.Test()]

    def recv(self, kind: str, out, peer: int, mb: int | None = None) -> None:
        host = np.empty(out.shape, out.dtype)
        self.wait(self.comm.Irecv(_raw(host), source=peer, tag=TAGS[kind]),
                  f"{'activation' if kind == 'act' else 'gradient'} of micro-batch {mb} "
                  f"from rank {peer}")
        self.be.upload(out, host)

    def sum_tied(self, arr, peer: int) -> None:
        mine = np.array(self.be.to_host(arr), copy=True)
        theirs = np.empty_like(mine)
        req = self.comm.Isendrecv(_raw(mine), dest=peer, sendtag=TAGS["tied"],
                                  recvbuf=_raw(theirs), source=peer, recvtag=TAGS["tied"])
        self.wait(req, f"the tied wte gradient from rank {peer}")
        first, last = (mine, theirs) if self.rank < peer else (theirs, mine)
        self.be.upload(arr, _member_sum([first, last]))

    def _reduce_chunk(self, arr, comm, axis):
        """This member's chunk of the group's sum, on the host: every member sends each
        member its chunk (all-to-all), which adds what it got in member order."""
        req, bufs = self._exchange(np.asarray(self.be.to_host(arr)).reshape(-1), comm)
        self.wait(req, f"the {axis} group's reduce (all-to-all)")
        return _member_sum(bufs[1])

    @staticmethod
    def _exchange(flat, comm):
        """Starts the all-to-all; returns the request and (send, receive) buffers, which
        must outlive it (MPI reads and writes them until it completes)."""
        n = comm.size
        c = chunks(flat.size, n)[0][1]  # the largest chunk: every member's share
        send = np.zeros(n * c, flat.dtype)
        send[:flat.size] = flat
        got = np.empty_like(send).reshape(n, c)
        return comm.Ialltoall(_raw(send), _raw(got)), (send, got)

    def start_all_reduce(self, arrs: list, axis: str) -> Done:
        comm = self.groups[axis]
        if comm.size == 1:
            return super().start_all_reduce(arrs, axis)
        flat = np.concatenate([np.asarray(self.be.to_host(a)).reshape(-1) for a in arrs])
        return _Overlapped(self, comm, axis, arrs, *self._exchange(flat, comm))

    def _gather_chunks(self, chunk, comm, axis, n_out):
        c = chunks(n_out, comm.size)[0][1]
        send = np.zeros(c, chunk.dtype)
        send[:chunk.size] = chunk
        got = np.empty(comm.size * c, chunk.dtype)
        self.wait(comm.Iallgather(_raw(send), _raw(got)), f"the {axis} group's all-gather")
        return got[:n_out]

    def all_reduce(self, arr, axis: str) -> None:
        comm = self.groups[axis]
        if comm.size > 1:
            acc = self._reduce_chunk(arr, comm, axis)
            self.be.upload(arr, self._gather_chunks(acc, comm, axis, arr.size).reshape(arr.shape))

    def reduce_scatter(self, arr, out, axis: str) -> None:
        comm = self.groups[axis]
        if comm.size == 1:
            return super().reduce_scatter(arr, out, axis)
        self.be.upload(out, self._reduce_chunk(arr, comm, axis)[:out.size])

    def all_gather(self, part, out, axis: str) -> None:
        comm = self.groups[axis]
        if comm.size == 1:
            return super().all_gather(part, out, axis)
        a, b = chunks(out.size, comm.size)[comm.rank]
        assert part.size == b - a, "all_gather: part is not this member's chunk"
        host = np.asarray(self.be.to_host(part)).reshape(-1)
        self.be.upload(out, self._gather_chunks(host, comm, axis, out.size).reshape(out.shape))

    def finish_sends(self) -> None:
        for req, _ in self.pending:
            self.wait(req, "a send to be received")
        self.pending = []


def _member_sum(parts):
    """The parts added in member order, in float32 for bf16 parts (rounded once at the
    end, as a bf16 kernel adds)."""
    acc = parts[0].astype(wide(parts[0].dtype))
    for part in parts[1:]:
        acc += part
    return acc.astype(parts[0].dtype, copy=False)


def _raw(a):
    """a as MPI takes it: bf16 (which it has no type for) as its 16-bit words."""
    return a.view(np.uint16) if a.dtype == BF16 else a


class _Overlapped:
    """An all-reduce in flight: the all-to-all, then (once it has landed, at a progress()
    or the wait) the member-order sum and the all-gather; wait() writes the arrays back."""

    def __init__(self, transport, comm, axis, arrs, req, bufs):
        self.transport, self.comm, self.axis, self.arrs = transport, comm, axis, arrs
        self.req, self.bufs, self.gathered = req, bufs, None  # bufs: alive while in flight

    def progress(self):
        """Advances without blocking: once the all-to-all has landed, adds and starts the
        all-gather. True when the all-gather has started. Callers advance handles in the
        order they were started and stop at the first that is not ready, so the gathers
        start in the same order on every member."""
        if self.gathered is None and self.req.Test():
            mine = _member_sum(self.bufs[1])
            self.gathered = np.empty(self.comm.size * mine.size, mine.dtype)
            comm = self.transport.gather_groups[self.axis]
            self.req, self.bufs = comm.Iallgather(_raw(mine), _raw(self.gathered)), (mine,)
        return self.gathered is not None

    def wait(self):
        what = f"the {self.axis} group's overlapped gradient sum"
        poll(self.progress, self.transport.timeout, self.transport.rank, what)
        self.transport.wait(self.req, what)
        off = 0
        for a in self.arrs:
            self.transport.be.upload(a, self.gathered[off:off + a.size].reshape(a.shape))
            off += a.size
