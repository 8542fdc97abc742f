"""NCCL transport (CuPy's NCCL), the multi-GPU baseline to compare NVSHMEM against.

One GPU per rank: NCCL refuses two ranks on one GPU. Each direction between neighbours
has its own 2-rank communicator, so a communicator is only ever used from one stream on
each side. Sends run on a send stream from a ring of staging copies (the compute stream
may overwrite the source at once, and a pending send never blocks the receives queued
behind it); receives land directly on the compute stream.
"""
import time

from .. import CupyGPTError
from .transport import Mpi

DEPTH = 2


class Nccl(Mpi):
    name = "nccl"

    def __init__(self, be, timeout):
        super().__init__(be, timeout)
        import cupy as cp
        ndev = cp.cuda.runtime.getDeviceCount()
        if ndev < self.size:
            raise CupyGPTError(f"--transport nccl: {self.size} ranks but {ndev} GPU(s); NCCL needs "
                               f"one GPU per rank and refuses two ranks on one GPU; use "
                               f"--transport nvshmem")
        from cupy.cuda import nccl
        cp.cuda.Device(self.rank).use()  # before any NCCL call; Session.configure agrees
        self.cp, self.nccl = cp, nccl
        self.comms = {}
        p, r = self.size, self.rank
        # (a, b, name): pairs in ascending order, so initialisation cannot wait in a cycle
        pairs = [(a, a + 1, d) for a in range(p - 1) for d in ("fwd", "bwd")] + [(0, p - 1, "tied")]
        for a, b, d in pairs:
            uid = self.comm.bcast(nccl.get_unique_id() if r == 0 else None)
            if r in (a, b):
                self.comms[(a, b, d)] = nccl.NcclCommunicator(2, uid, 0 if r == a else 1)
        self.send_stream = cp.cuda.Stream(non_blocking=True)
        self.ring, self.n = {}, {}

    def prepare(self, shapes):
        cp = self.cp
        for kind in ("act", "grad"):
            shape, _ = shapes[kind]
            self.ring[kind] = [(cp.empty(shape, cp.float32), None) for _ in range(DEPTH)]
            self.n[kind] = 0

    def _comm(self, kind, peer):
        a, b = min(self.rank, peer), max(self.rank, peer)
        return self.comms[(a, b, "fwd" if kind == "act" else "bwd")], 1 if peer == b else 0

    def send(self, kind, arr, peer, mb=None):
        compute = self.cp.cuda.get_current_stream()
        i = self.n[kind] % DEPTH
        self.n[kind] += 1
        buf, done = self.ring[kind][i]
        if done is not None:
            compute.wait_event(done)         # the send that last used this copy is finished
        buf[...] = arr.reshape(buf.shape)
        self.send_stream.wait_event(compute.record())
        comm, peer_idx = self._comm(kind, peer)
        comm.send(buf.data.ptr, buf.size, self.nccl.NCCL_FLOAT32, peer_idx, self.send_stream.ptr)
        self.ring[kind][i] = (buf, self.send_stream.record())

    def recv(self, kind, out, peer, mb=None):
        comm, peer_idx = self._comm(kind, peer)
        comm.recv(out.data.ptr, out.size, self.nccl.NCCL_FLOAT32, peer_idx,
                  self.cp.cuda.get_current_stream().ptr)

    def sum_tied(self, arr, peer):
        """A 2-rank allreduce: NCCL gives both ranks the same sum, bit for bit."""
        comm = self.comms[(0, self.size - 1, "tied")]
        comm.allReduce(arr.data.ptr, arr.data.ptr, arr.size, self.nccl.NCCL_FLOAT32,
                       self.nccl.NCCL_SUM, self.cp.cuda.get_current_stream().ptr)

    def finish_sends(self):
        deadline = time.monotonic() + self.timeout
        for stream in (self.send_stream, self.cp.cuda.get_current_stream()):
            while not stream.done:
                if time.monotonic() > deadline:
                    raise CupyGPTError(f"rank {self.rank}: timed out after {self.timeout:g}s "
                                       f"waiting for NCCL transfers; is every rank alive?")
                time.sleep(1e-4)
