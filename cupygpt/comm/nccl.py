"""NCCL transport (CuPy's NCCL), the multi-GPU baseline to compare NVSHMEM against.

One GPU per rank: NCCL refuses two ranks on one GPU. Each direction between neighbours
has its own 2-rank communicator, so a communicator is only ever used from one stream on
each side. Sends run on a send stream from a ring of staging copies (the compute stream
may overwrite the source at once, and a pending send never blocks the receives queued
behind it); receives land directly on the compute stream.
"""
from .. import CupyGPTError
from .base import poll
from .mpi import Mpi


class Nccl(Mpi):
    name = "nccl"

    def __init__(self, be, mesh, timeout):
        super().__init__(be, mesh, timeout)
        import cupy as cp
        ndev = cp.cuda.runtime.getDeviceCount()
        if ndev < self.size:
            raise CupyGPTError(f"{self.size} ranks but {ndev} GPU(s); NCCL needs one GPU per "
                               f"rank and refuses two ranks on one GPU; use nvshmem",
                               "transport", "nccl")
        from cupy.cuda import nccl
        cp.cuda.Device(mesh.device(ndev)).use()  # before any NCCL call; the backend agrees
        self.cp, self.nccl = cp, nccl
        self.comms, r = {}, self.rank
        for a, b, purpose in mesh.pairs():  # every rank takes part in every unique id
            uid = self.comm.bcast(nccl.get_unique_id() if r == 0 else None)
            if r in (a, b):
                self.comms[(a, b, purpose)] = nccl.NcclCommunicator(2, uid, 0 if r == a else 1)
        self.send_stream = cp.cuda.Stream(non_blocking=True)
        self.ring, self.n = {}, {}

    def prepare(self, shapes):
        """Staging rings for the two directions; NCCL itself needs no buffers."""
        cp = self.cp
        for kind in ("act", "grad"):
            shape, depth = shapes[kind]
            self.ring[kind] = [(cp.empty(shape, cp.float32), None) for _ in range(depth)]
            self.n[kind] = 0

    def _comm(self, kind, peer):
        a, b = min(self.rank, peer), max(self.rank, peer)
        return self.comms[(a, b, "fwd" if kind == "act" else "bwd")], 1 if peer == b else 0

    def send(self, kind, arr, peer, mb=None):
        compute = self.cp.cuda.get_current_stream()
        i = self.n[kind] % len(self.ring[kind])
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
        comm = self.comms[(min(self.rank, peer), max(self.rank, peer), "tied")]
        comm.allReduce(arr.data.ptr, arr.data.ptr, arr.size, self.nccl.NCCL_FLOAT32,
                       self.nccl.NCCL_SUM, self.cp.cuda.get_current_stream().ptr)

    def finish_sends(self):
        streams = (self.send_stream, self.cp.cuda.get_current_stream())
        poll(lambda: all(s.done for s in streams), self.timeout, self.rank,
             "this step's NCCL transfers")
