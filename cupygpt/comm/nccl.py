"""NCCL transport (CuPy's NCCL), the multi-GPU baseline to compare NVSHMEM against.

One GPU per rank: NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), except from
2.30 on with NCCL_MULTI_RANK_GPU_ENABLE=1 (experimental there; under an MPS server the
ranks' kernels run at once, without it they take turns on the GPU).

Point to point: a 2-rank communicator for each (sender, receiver, kind) of Mesh.pairs(),
every directed pair of pipeline-ring neighbours, so a communicator is only ever used from
one stream on each side (the sender's send stream, the receiver's compute stream). Sends
run on the send stream from a ring of staging copies (the compute stream may overwrite the
source at once, and a pending send never blocks the receives queued behind it); receives
land directly on the compute stream.

Collectives: a communicator per dp and per tp group, and per stream (the compute stream's;
the side stream's for the overlapped all-reduce), with NCCL's allReduce, reduceScatter and
allGather. NCCL gives every member the same bits and a run repeats them, but it adds in its
own order (its ring or tree, picked by size and topology), not in member order as the mpi
transport does: the sums equal mpi's to rounding, not bit for bit. NCCL wants the same
count from every member, and chunks() gives the last members less: an uneven array goes
through a staging buffer of g * ceil(n / g) elements. A rank's collectives run in the
order it issues them, whichever stream each is on (_in_order).

Not yet safe by NCCL's rules: a receive on the compute stream and a send on the send
stream run at once only if the GPU holds both kernels (cudasim's one-operation-at-a-time
device deadlocks a --tp 2 --pp 2 grid under CUDASIM_ORDER=random); a GPU with free SMs
runs them, which NCCL does not promise.
"""
from __future__ import annotations

import os

import numpy as np

from .. import CupyGPTError
from ..backends.protocol import Backend
from ..precision import BF16
from .base import AXES, Done, chunks, poll
from .gpu import start_on_side, wait_stream
from .mpi import Mpi

# NCCL's version code from which NCCL_MULTI_RANK_GPU_ENABLE=1 lets ranks share a GPU
MULTI_RANK_GPU = 23000


def shares_gpus(version: int) -> bool:
    """Whether this NCCL takes several ranks on one GPU (its version, and the variable it
    reads when a communicator is made)."""
    return version >= MULTI_RANK_GPU and os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") == "1"


class Nccl(Mpi):
    name = "nccl"

    def __init__(self, be: Backend, mesh, timeout: float) -> None:
        super().__init__(be, mesh, timeout)
        import cupy as cp
        from cupy.cuda import nccl
        ndev = cp.cuda.runtime.getDeviceCount()
        self.version = nccl.get_version()  # e.g. 23203 for 2.32.3
        if ndev < self.size and not shares_gpus(self.version):
            raise CupyGPTError(f"{self.size} ranks but {ndev} GPU(s); NCCL needs one GPU per "
                               f"rank and refuses two ranks on one GPU (from NCCL 2.30 on, "
                               f"unless NCCL_MULTI_RANK_GPU_ENABLE=1; this is "
                               f"{self.version // 10000}.{self.version // 100 % 100}); use "
                               f"nvshmem", "transport", "nccl")
        cp.cuda.Device(mesh.device(ndev)).use()  # before any NCCL call; the backend agrees
        self.cp, self.nccl, r = cp, nccl, self.rank
        self.dtypes = {np.dtype(np.float32): nccl.NCCL_FLOAT32,
                       np.dtype(np.float64): nccl.NCCL_FLOAT64, BF16: nccl.NCCL_BFLOAT16}
        self.comms = {}  # every rank takes part in every unique id, in the same order
        for a, b, kind in mesh.pairs():
            uid = self.comm.bcast(nccl.get_unique_id() if r == 0 else None)
            if r in (a, b):
                self.comms[(a, b, kind)] = nccl.NcclCommunicator(2, uid, 0 if r == a else 1)
        self.coll = {}  # (axis, on the side stream): (communicator, group size, my place)
        for axis in AXES:
            for on_side in (False, True):
                for g in mesh.groups(axis):
                    if len(g) > 1:
                        uid = self.comm.bcast(nccl.get_unique_id() if r == 0 else None)
                        if r in g:
                            self.coll[(axis, on_side)] = (
                                nccl.NcclCommunicator(len(g), uid, g.index(r)), len(g), g.index(r))
        # a host wait for a stream whose NCCL calls wait on a stopped peer never ends
        peers = sorted({q for pair in self.comms for q in pair[:2]} | {
            q for g in (g for axis in AXES for g in mesh.groups(axis)) if r in g
            for q in (g if len(g) > 1 else ())} - {r})
        what = ("the GPU stream's NCCL transfers and collectives with "
                + ", ".join(f"rank {q}" for q in peers))
        be.bound_host_waits(lambda s: wait_stream(s, self, what))
        self.send_stream = cp.cuda.Stream(non_blocking=True)
        self.side = cp.cuda.Stream(non_blocking=True)
        self.last_collective = None  # (stream ptr, event after it) of this rank's latest
        self.ring, self.n = {}, {}

    def prepare(self, shapes: dict) -> None:
        """Staging rings for the two directions; NCCL itself needs no buffers."""
        cp = self.cp
        for kind in ("act", "grad"):
            shape, depth, dtype = shapes[kind]
            self.ring[kind] = [(cp.empty(shape, dtype), None) for _ in range(depth)]
            self.n[kind] = 0

    def send(self, kind: str, arr, peer: int, mb: int | None = None) -> None:
        compute = self.cp.cuda.get_current_stream()
        i = self.n[kind] % len(self.ring[kind])
        self.n[kind] += 1
        buf, done = self.ring[kind][i]
        if done is not None:
            compute.wait_event(done)         # the send that last used this copy is finished
        buf.reshape(-1)[:arr.size] = arr.reshape(-1)  # prepare's shape holds the largest
        self.send_stream.wait_event(compute.record())
        self.comms[(self.rank, peer, kind)].send(buf.data.ptr, arr.size, self.dtypes[arr.dtype],
                                                 1, self.send_stream.ptr)
        self.ring[kind][i] = (buf, self.send_stream.record())

    def recv(self, kind: str, out, peer: int, mb: int | None = None) -> None:
        self.comms[(peer, self.rank, kind)].recv(out.data.ptr, out.size, self.dtypes[out.dtype],
                                                 0, self.cp.cuda.get_current_stream().ptr)

    def sum_tied(self, arr, peer: int) -> None:
        """A 2-rank allreduce: NCCL gives both ranks the same sum, bit for bit."""
        comm = self.comms[(min(self.rank, peer), max(self.rank, peer), "tied")]
        stream = self._in_order()
        comm.allReduce(arr.data.ptr, arr.data.ptr, arr.size, self.dtypes[arr.dtype],
                       self.nccl.NCCL_SUM, stream.ptr)
        self._issued(stream)

    def _in_order(self):
        """The current stream, made to wait for this rank's previous collective when that
        ran on another stream. NCCL's kernels block until their peers arrive, and
        operations on several communicators may not run at once unless every rank issues
        them in one order (NCCL's "Using multiple NCCL communicators concurrently"): the
        side stream's replicas' sum and the compute stream's tp sums would otherwise run in
        whichever order each GPU picks, and two ranks picking differently wait on each
        other for ever."""
        stream = self.cp.cuda.get_current_stream()
        if self.last_collective is not None and self.last_collective[0] != stream.ptr:
            stream.wait_event(self.last_collective[1])
        return stream

    def _issued(self, stream) -> None:
        self.last_collective = (stream.ptr, stream.record())

    def _group(self, axis):
        """(communicator, size, place) for the current stream's collectives, or None when
        the group has one member; the stream."""
        stream = self.cp.cuda.get_current_stream()
        return self.coll.get((axis, stream.ptr == self.side.ptr)), stream

    def _padded(self, flat, size):
        """flat itself when it has size elements, else a zero-padded copy."""
        if flat.size == size:
            return flat
        out = self.cp.zeros(size, flat.dtype)
        out[:flat.size] = flat
        return out

    def all_reduce(self, arr, axis: str) -> None:
        group, stream = self._group(axis)
        if group is None:
            return super().all_reduce(arr, axis)
        self._in_order()
        group[0].allReduce(arr.data.ptr, arr.data.ptr, arr.size, self.dtypes[arr.dtype],
                           self.nccl.NCCL_SUM, stream.ptr)
        self._issued(stream)

    def start_all_reduce(self, arrs: list, axis: str) -> Done:
        if (axis, True) not in self.coll:
            return super().start_all_reduce(arrs, axis)
        return start_on_side(self.side, arrs, lambda flat: self.all_reduce(flat, axis))

    def _even(self, group, stream, n, src, dst, scatter):
        """NCCL's reduceScatter (scatter: src the whole n elements, dst this member's chunk)
        or allGather (src the chunk, dst the whole): NCCL wants the same count from every
        member, and chunks() gives the last ones less, so both sides go through
        zero-padded staging of the largest chunk c where their sizes differ."""
        comm, g, me = group
        parts = chunks(n, g)
        c, (a, b) = parts[0][1], parts[me]
        assert (dst if scatter else src).size == b - a, "not this member's chunk"
        send = self._padded(src.reshape(-1), g * c if scatter else c)
        size = c if scatter else g * c
        got = dst if dst.size == size else self.cp.empty(size, dst.dtype)
        args = (send.data.ptr, got.data.ptr, c, self.dtypes[dst.dtype])
        self._in_order()
        if scatter:
            comm.reduceScatter(*args, self.nccl.NCCL_SUM, stream.ptr)
        else:
            comm.allGather(*args, stream.ptr)
        self._issued(stream)
        if got is not dst:
            dst[...] = got[:dst.size].reshape(dst.shape)

    def reduce_scatter(self, arr, out, axis: str) -> None:
        group, stream = self._group(axis)
        if group is None:
            return super().reduce_scatter(arr, out, axis)
        self._even(group, stream, arr.size, arr, out, scatter=True)

    def all_gather(self, part, out, axis: str) -> None:
        group, stream = self._group(axis)
        if group is None:
            return super().all_gather(part, out, axis)
        self._even(group, stream, out.size, part, out, scatter=False)

    def finish_sends(self) -> None:
        streams = (self.send_stream, self.cp.cuda.get_current_stream())
        poll(lambda: all(s.done for s in streams), self.timeout, self.rank,
             "this step's NCCL transfers")
