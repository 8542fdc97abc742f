"""NVSHMEM transport: activations forward and gradients back through symmetric CuPy
arrays, every step stream-ordered on the compute stream; control values over MPI.

A channel (kind) has `depth` slots on every PE (prepare's). Message n of a kind goes to
slot (n - 1) % depth of the peer with put_signal, which sets that slot's data signal to n.
The receiver's stream waits until the signal reaches n (cuStreamWaitValue64: it works
with two PEs on one GPU, where NVSHMEM refuses signal_wait without MPS), copies the slot
out, then signals the sender's ack for that slot. A sender waits for the ack of message
n - depth before reusing a slot, so no slot is overwritten before it was read.
Signals only grow, so nothing is ever reset. The host never blocks on a peer, except
in finish_sends, which polls the stream against --peer-timeout.
"""
import atexit

from .. import CupyGPTError
from .base import poll
from .mpi import Mpi


class Nvshmem(Mpi):
    name = "nvshmem"

    def __init__(self, be, mesh, timeout):
        super().__init__(be, mesh, timeout)
        import cupy as cp
        import nvshmem.core as nv
        from cuda.bindings import driver
        from cuda.core import Buffer, Device, Stream
        from nvshmem.core.direct import SignalOp
        self.cp, self.nv, self.driver, self.Buffer, self.SET = cp, nv, driver, Buffer, SignalOp.SIGNAL_SET
        ndev = cp.cuda.runtime.getDeviceCount()
        dev = Device(mesh.device(ndev))
        dev.set_current()
        cp.cuda.Device(mesh.device(ndev)).use()
        nv.init(device=dev, mpi_comm=self.comm, initializer_method="emulated_mpi")
        self.Stream, self.stream, self.stream_ptr = Stream, None, None
        self.chan, self.sent, self.got = {}, {}, {}
        atexit.register(self.close)  # before MPI's own exit handler (atexit runs LIFO)

    def prepare(self, shapes):
        """Collective: allocates every channel's symmetric slots and signals on all PEs
        (the same sizes everywhere, as NVSHMEM requires). shapes: {kind: (shape, depth)}."""
        cp = self.cp
        for kind, (shape, depth) in shapes.items():
            slots = [self.nv.array(shape, dtype="float32") for _ in range(depth)]
            data = [self.nv.buffer(8) for _ in range(depth)]
            ack = [self.nv.buffer(8) for _ in range(depth)]
            for b in data + ack:
                cp.from_dlpack(b, copy=False).view(cp.uint64).fill(0)
            self.chan[kind] = (slots, data, ack)
            self.sent[kind] = self.got[kind] = 0
        cp.cuda.get_current_stream().synchronize()
        self.barrier()

    def _wait_value(self, buf, value):
        """The compute stream waits until the 64-bit word in buf is >= value."""
        d = self.driver
        (err,) = d.cuStreamWaitValue64(d.CUstream(self.cp.cuda.get_current_stream().ptr),
                                       d.CUdeviceptr(int(buf.handle)), value,
                                       d.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)
        if err != d.CUresult.CUDA_SUCCESS:
            raise CupyGPTError(f"rank {self.rank}: cuStreamWaitValue64 failed ({err}); this "
                               f"GPU or driver lacks stream memory operations")

    def _refresh_stream(self):
        """nvshmem4py wants a cuda.core Stream: wrap CuPy's current one (once per stream)."""
        ptr = self.cp.cuda.get_current_stream().ptr
        if ptr != self.stream_ptr:
            self.stream, self.stream_ptr = self.Stream.from_handle(ptr), ptr

    def send(self, kind, arr, peer, mb=None):
        slots, data, ack = self.chan[kind]
        self._refresh_stream()
        n = self.sent[kind] = self.sent[kind] + 1
        i = (n - 1) % len(slots)
        if n > len(slots):
            self._wait_value(ack[i], n - len(slots))
        src = self.Buffer.from_handle(arr.data.ptr, arr.nbytes, owner=arr)
        self.nv.put_signal(slots[i], src, data[i], n, self.SET, remote_pe=peer, stream=self.stream)

    def recv(self, kind, out, peer, mb=None):
        slots, data, ack = self.chan[kind]
        self._refresh_stream()
        n = self.got[kind] = self.got[kind] + 1
        i = (n - 1) % len(slots)
        self._wait_value(data[i], n)
        out[...] = slots[i].reshape(out.shape)
        self.nv.signal_op(ack[i], n, self.SET, remote_pe=peer, stream=self.stream)

    def sum_tied(self, arr, peer):
        """Both ranks put their wte gradient into the other's slot, then add in the same
        order (first stage's + last stage's), so both copies stay bit-identical."""
        cp = self.cp
        mine = cp.array(arr, copy=True)
        self.send("tied", mine, peer)
        theirs = cp.empty_like(arr)
        self.recv("tied", theirs, peer)
        first, last = (mine, theirs) if self.rank < peer else (theirs, mine)
        cp.add(first, last, out=arr)

    def finish_sends(self):
        """Waits for this rank's stream (its puts included) with the peer timeout."""
        stream = self.cp.cuda.get_current_stream()
        poll(lambda: stream.done, self.timeout, self.rank,
             "this step's transfers (a peer's data or ack)")

    def close(self):
        """Collective, at exit: frees the symmetric memory in the same order on every PE
        (NVSHMEM's frees are collective), then finalizes NVSHMEM."""
        self.cp.cuda.get_current_stream().synchronize()
        for slots, data, ack in self.chan.values():
            for a in slots:
                self.nv.free_array(a)
            for b in data + ack:
                self.nv.free(b)
        self.chan = {}
        self.nv.finalize()
