"""NVSHMEM transport: activations forward and gradients back through symmetric CuPy
arrays, every step stream-ordered on the compute stream; control values over MPI.

Point to point: a channel is a (kind, direction of travel along the pipeline ring) pair,
so a rank that receives "act" from both ring neighbours (zero-bubble V, the interleaved
schedule's wrap from the last stage to the first) keeps the two apart. Each has `depth`
slots on every PE (prepare's). A step's message n on a channel goes to slot (n - 1) % depth
of the peer with put_signal, which adds 1 to that slot's data signal. The receiver's
stream waits until the signal counts this step's messages in the slot (cuStreamWaitValue64:
it works with two PEs on one GPU, where NVSHMEM refuses signal_wait without MPS), copies the
slot out, then adds 1 to the sender's ack for that slot. A sender waits for the ack of
message n - depth before reusing a slot, so no slot is overwritten before it was read.
The host waits on a peer only when it waits for the stream (finish_sends, and every copy
to the host or synchronize of the backend, bound_host_waits): CUDA's own waits never give
up on a stream stuck on a stopped peer's signal, so these poll the stream against
--peer-timeout and the error names the peers its waits are on.

Counted per step (Ledger): the values a stream waits for are fixed when the step is
captured as a CUDA graph, so every replay must wait for the same ones. At the end of a step
(end_step, on the stream) each PE waits for every ack still owed to it (its peers have read
all it sent, so the next step may reuse slot 0) and takes the step's counts back off its own
signal words (an atomic add of minus the count): they count from 0 again. A peer's signal
of the next step that lands before that only adds, so nothing is lost and no barrier is
needed between steps; the eager step runs the same protocol.

Collectives: built from the same puts, signals and stream waits (symmetric.py says how
and why).
"""
from __future__ import annotations

import atexit
import math

import numpy as np

from .. import CupyGPTError
from ..backends.protocol import Backend
from .base import AXES, Done, chunks
from .gpu import start_on_side, wait_stream
from .launch import fail
from .mpi import Mpi
from .symmetric import Ledger, Window

_live = []  # this process's transports: NVSHMEM is initialized once, finalized after the last


class Nvshmem(Mpi):
    name = "nvshmem"

    def __init__(self, be: Backend, mesh, timeout: float) -> None:
        super().__init__(be, mesh, timeout)
        import cupy as cp
        import nvshmem.core as nv
        from cuda.bindings import driver
        from cuda.core import Buffer, Device, Stream
        from nvshmem.core.direct import SignalOp
        self.cp, self.nv, self.driver, self.Buffer = cp, nv, driver, Buffer
        self.ADD = SignalOp.SIGNAL_ADD
        self.ledger = Ledger(self)  # the point-to-point channels' signal words
        ndev = cp.cuda.runtime.getDeviceCount()
        dev = Device(mesh.device(ndev))
        dev.set_current()
        cp.cuda.Device(mesh.device(ndev)).use()
        if not _live:  # the first transport of the process (bench --comm makes two)
            nv.init(device=dev, mpi_comm=self.comm, initializer_method="emulated_mpi")
        _live.append(self)
        self.mesh, self.Stream, self.streams = mesh, Stream, {}
        self.chan, self.sent, self.got = {}, {}, {}
        self.side = cp.cuda.Stream(non_blocking=True)
        # stream ptr -> peers whose signals it has waited for (a replayed graph waits on
        # those its capture did, so none is forgotten)
        self.waits_on = {}
        be.bound_host_waits(self.host_wait)
        self.windows = {}
        for axis in AXES:
            members = next(g for g in mesh.groups(axis) if self.rank in g)
            if len(members) > 1:  # groups along an axis are equally large: same on every PE
                for on_side in (False, True):
                    self.windows[(axis, on_side)] = Window(self, members, axis)
        cp.cuda.get_current_stream().synchronize()
        self.barrier()  # every PE's signal words are zero before anyone signals
        atexit.register(self.close)  # before MPI's own exit handler (atexit runs LIFO)

    def prepare(self, shapes: dict) -> None:
        """Collective: allocates every channel's symmetric slots and signals on all PEs
        (the same sizes everywhere, as NVSHMEM requires). shapes: {kind: (shape, depth,
        dtype)}. act and grad get a set per direction when a rank has two ring neighbours;
        tied has one peer. A slot is raw bytes, read as the message's dtype: a smaller
        dtype's message (bench --comm's bf16) fits the slot of the largest."""
        cp = self.cp
        for kind, (shape, depth, dtype) in shapes.items():
            ways = 2 if self.mesh.pp > 2 and kind != "tied" else 1
            nbytes = math.prod(shape) * np.dtype(dtype).itemsize
            for way in range(ways):
                slots = [self.nv.array((nbytes,), dtype="uint8") for _ in range(depth)]
                data = [self.nv.buffer(8) for _ in range(depth)]
                ack = [self.nv.buffer(8) for _ in range(depth)]
                for b in data + ack:
                    cp.from_dlpack(b, copy=False).view(cp.uint64).fill(0)
                self.chan[(kind, way)] = (slots, data, ack)
                self.sent[(kind, way)] = self.got[(kind, way)] = 0
        if "tied" in shapes:  # sum_tied's copies, kept: a captured step allocates nothing
            self.tied = [cp.empty(shapes["tied"][0], shapes["tied"][2]) for _ in range(2)]
        cp.cuda.get_current_stream().synchronize()
        self.barrier()

    def _way(self, kind, peer, step):
        """The channel of a message to (step 1) or from (step -1) peer: 0 when it travels up
        the ring (stage s to s + 1 mod pp), 1 down; with one set, always 0."""
        return 0 if (kind, 1) not in self.chan or peer == self.mesh.ring(step) else 1

    def wait_value(self, addr: int, value: int, peer: int) -> None:
        """The current stream waits until the 64-bit word at addr (peer writes it) is >=
        value."""
        d, ptr = self.driver, self.cp.cuda.get_current_stream().ptr
        self.waits_on.setdefault(ptr, set()).add(peer)
        (err,) = d.cuStreamWaitValue64(d.CUstream(ptr),
                                       d.CUdeviceptr(int(addr)), value,
                                       d.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)
        if err != d.CUresult.CUDA_SUCCESS:
            raise CupyGPTError(f"rank {self.rank}: cuStreamWaitValue64 failed ({err}); this "
                               f"GPU or driver lacks stream memory operations")

    def stream(self):
        """nvshmem4py wants a cuda.core Stream: CuPy's current one, wrapped once."""
        ptr = self.cp.cuda.get_current_stream().ptr
        if ptr not in self.streams:
            self.streams[ptr] = self.Stream.from_handle(ptr)
        return self.streams[ptr]

    def buffer(self, ptr: int, nbytes: int, owner=None):
        return self.Buffer.from_handle(ptr, nbytes, owner=owner)

    def put_at(self, dst: int, src, signal: int, pe: int) -> None:
        """dst (a symmetric address) on pe = src (a CuPy array), then 1 added to pe's signal
        word; with nothing to copy, the signal alone."""
        if not src.size:
            return self.signal(signal, 1, pe)
        to, sig = self.buffer(dst, src.nbytes), self.buffer(signal, 8)
        frm, stream = self.buffer(src.data.ptr, src.nbytes, src), self.stream()
        self.nv.put_signal(to, frm, sig, 1, self.ADD, remote_pe=pe, stream=stream)

    def signal(self, signal: int, value: int, pe: int) -> None:
        """Adds value (negative: taken back, modulo 2^64 as the word wraps) to pe's word."""
        self.nv.signal_op(self.buffer(signal, 8), value % (1 << 64), self.ADD, remote_pe=pe,
                          stream=self.stream())

    def send(self, kind: str, arr, peer: int, mb: int | None = None) -> None:
        way = self._way(kind, peer, 1)
        slots, data, ack = self.chan[(kind, way)]
        n = self.sent[(kind, way)] = self.sent[(kind, way)] + 1
        i = (n - 1) % len(slots)
        if n > len(slots):  # message n - depth's ack
            self.ledger.wait(ack[i].handle, peer)
        self.put_at(slots[i].data.ptr, arr.reshape(-1), data[i].handle, peer)
        self.ledger.owe(ack[i].handle, peer)

    def recv(self, kind: str, out, peer: int, mb: int | None = None) -> None:
        way = self._way(kind, peer, -1)
        slots, data, ack = self.chan[(kind, way)]
        n = self.got[(kind, way)] = self.got[(kind, way)] + 1
        i = (n - 1) % len(slots)
        self.ledger.wait(data[i].handle, peer)
        out[...] = slots[i][:out.nbytes].view(out.dtype).reshape(out.shape)
        self.signal(ack[i].handle, 1, peer)

    def end_step(self) -> None:
        """Every ack owed, then the counts back to 0 (the module docstring)."""
        self.ledger.settle()
        self.sent = dict.fromkeys(self.sent, 0)
        self.got = dict.fromkeys(self.got, 0)

    graphable = True  # every wait and transfer above is on the stream

    def sum_tied(self, arr, peer: int) -> None:
        """Both ranks put their wte gradient into the other's slot, then add in the same
        order (first stage's + last stage's), so both copies stay bit-identical."""
        mine, theirs = (b.reshape(-1)[:arr.size].reshape(arr.shape) for b in self.tied)
        mine[...] = arr
        self.send("tied", mine, peer)
        self.recv("tied", theirs, peer)
        first, last = (mine, theirs) if self.rank < peer else (theirs, mine)
        self.cp.add(first, last, out=arr)

    # --- collectives (the module docstring): one engine, three entry points -------------

    def all_reduce(self, arr, axis: str) -> None:
        on_side = self.cp.cuda.get_current_stream().ptr == self.side.ptr
        w = self.windows.get((axis, on_side))
        if w is None:
            return super().all_reduce(arr, axis)
        flat = arr.reshape(-1)
        w.run(flat.size, flat.dtype, src=flat, out=flat)

    def start_all_reduce(self, arrs: list, axis: str) -> Done:
        if (axis, True) not in self.windows:
            return super().start_all_reduce(arrs, axis)
        return start_on_side(self.side, arrs, lambda flat: self.all_reduce(flat, axis))

    def _scattered(self, axis, n, mine):
        """The compute stream's window of axis (None: one member), mine checked to be this
        member's chunk (chunks()) of n elements."""
        w = self.windows.get((axis, False))
        if w is not None:
            a, b = chunks(n, len(w.members))[w.me]
            assert mine.size == b - a, "not this member's chunk of the collective"
        return w

    def reduce_scatter(self, arr, out, axis: str) -> None:
        w = self._scattered(axis, arr.size, out)
        if w is None:
            return super().reduce_scatter(arr, out, axis)
        flat = arr.reshape(-1)
        w.run(flat.size, flat.dtype, src=flat, mine=out.reshape(-1))

    def all_gather(self, part, out, axis: str) -> None:
        w = self._scattered(axis, out.size, part)
        if w is None:
            return super().all_gather(part, out, axis)
        w.run(out.size, out.dtype, mine=part.reshape(-1), out=out.reshape(-1))

    def finish_sends(self) -> None:
        """Waits for this rank's stream (its puts included) with the peer timeout."""
        self.host_wait(self.cp.cuda.get_current_stream())

    def host_wait(self, stream) -> None:
        """Returns once stream's work has run, or raises after the peer timeout naming the
        peers whose signals it waits for (the module docstring)."""
        peers = sorted(self.waits_on.get(stream.ptr, ()))
        named = ", ".join(f"rank {p}" for p in peers) or "no peer"
        wait_stream(stream, self, f"the GPU stream, whose waits are on {named} (their "
                                  f"data, acks or collective parts)")

    def close(self) -> None:
        """Collective, at exit: frees the symmetric memory in the same order on every PE
        (NVSHMEM's frees are collective), then finalizes NVSHMEM. Each free waits for every
        PE without a timeout, so every PE is met here first, within the peer timeout; a
        stopped one is one line and the job aborted (at exit, an exception would only be
        printed as a traceback, and the frees would hang)."""
        try:
            self.host_wait(self.cp.cuda.get_current_stream())
            self.host_wait(self.side)
            self.barrier()
        except CupyGPTError as e:
            fail(f"error: {e}")
        for w in self.windows.values():
            for a in (w.inbox, w.gather):
                self.nv.free_array(a)
            self.nv.free(w.sig)
        for slots, data, ack in self.chan.values():
            for a in slots:
                self.nv.free_array(a)
            for b in data + ack:
                self.nv.free(b)
        self.chan, self.windows = {}, {}
        _live.remove(self)
        if not _live:
            self.nv.finalize()
