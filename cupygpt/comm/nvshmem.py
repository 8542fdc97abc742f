"""NVSHMEM transport: activations forward and gradients back through symmetric CuPy
arrays, every step stream-ordered on the compute stream; control values over MPI.

Point to point: a channel is a (kind, direction of travel along the pipeline ring) pair,
so a rank that receives "act" from both ring neighbours (zero-bubble V, the interleaved
schedule's wrap from the last stage to the first) keeps the two apart. Each has `depth`
slots on every PE (prepare's). Message n on a channel goes to slot (n - 1) % depth of the
peer with put_signal, which sets that slot's data signal to n. The receiver's stream waits
until the signal reaches n (cuStreamWaitValue64: it works with two PEs on one GPU, where
NVSHMEM refuses signal_wait without MPS), copies the slot out, then signals the sender's
ack for that slot. A sender waits for the ack of message n - depth before reusing a slot,
so no slot is overwritten before it was read. Signals only grow, so nothing is ever reset.
The host never blocks on a peer, except in finish_sends, which polls the stream against
--peer-timeout.

Collectives: not NVSHMEM's teams. Its collectives exit the process with several PEs on one
GPU and no MPS server (limited MPG), the setup a one-GPU machine runs; puts, signals and
stream waits work everywhere the point-to-point does, so the collectives are built from
them, with one code path for every placement. Each round, every member puts each other
member's chunk of its array into that member's symmetric inbox (put_signal, as above);
each member adds its chunk in member order (member 0 + member 1 + ...: the interface's
order, so the bits equal the mpi transport's), then puts the sum into every member's
gather area, and everyone copies its result from there, so all members hold the same bits.
Direct puts rather than a ring: the same bytes leave each member ((g-1)/g of the array),
one signal round per phase instead of g - 1, and the fixed member order comes for free;
every PE reaches every other directly on one node (NVLink, or one shared GPU). Flow
control is the point-to-point's: a member acks each inbox and gather area once read.

The symmetric memory is allocated with the transport (allocation is collective over all
PEs, so it cannot wait for a group's first collective: other stages may be blocked on a
receive then): a fixed window per (axis, stream) whose groups have several members, and
a collective larger than the window runs in rounds, each round a slice of every member's
chunk. So nothing depends on the runner announcing sizes, and memory stays bounded.
"""
import atexit

import numpy as np

from .. import CupyGPTError
from .base import chunks, poll
from .gpu import start_on_side
from .mpi import Mpi

WINDOW = 16 << 20  # bytes of each collective inbox and gather area (per axis and stream)
RED, RED_ACK, GAT, GAT_ACK = range(4)  # a window's signal words, g of each
_live = []  # this process's transports: NVSHMEM is initialized once, finalized after the last


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
        if not _live:  # the first transport of the process (bench --comm makes two)
            nv.init(device=dev, mpi_comm=self.comm, initializer_method="emulated_mpi")
        _live.append(self)
        self.mesh, self.Stream, self.streams = mesh, Stream, {}
        self.chan, self.sent, self.got = {}, {}, {}
        self.side = cp.cuda.Stream(non_blocking=True)
        self.windows = {}
        for axis in ("dp", "tp"):
            members = next(g for g in mesh.groups(axis) if self.rank in g)
            if len(members) > 1:  # groups along an axis are equally large: same on every PE
                for on_side in (False, True):
                    self.windows[(axis, on_side)] = _Window(self, members)
        cp.cuda.get_current_stream().synchronize()
        self.barrier()  # every PE's signal words are zero before anyone signals
        atexit.register(self.close)  # before MPI's own exit handler (atexit runs LIFO)

    def prepare(self, shapes):
        """Collective: allocates every channel's symmetric slots and signals on all PEs
        (the same sizes everywhere, as NVSHMEM requires). shapes: {kind: (shape, depth)}.
        act and grad get a set per direction when a rank has two ring neighbours; tied has
        one peer."""
        cp = self.cp
        for kind, (shape, depth) in shapes.items():
            ways = 2 if self.mesh.pp > 2 and kind != "tied" else 1
            for way in range(ways):
                slots = [self.nv.array(shape, dtype="float32") for _ in range(depth)]
                data = [self.nv.buffer(8) for _ in range(depth)]
                ack = [self.nv.buffer(8) for _ in range(depth)]
                for b in data + ack:
                    cp.from_dlpack(b, copy=False).view(cp.uint64).fill(0)
                self.chan[(kind, way)] = (slots, data, ack)
                self.sent[(kind, way)] = self.got[(kind, way)] = 0
        cp.cuda.get_current_stream().synchronize()
        self.barrier()

    def _way(self, kind, peer, step):
        """The channel of a message to (step 1) or from (step -1) peer: 0 when it travels up
        the ring (stage s to s + 1 mod pp), 1 down; with one set, always 0."""
        return 0 if (kind, 1) not in self.chan or peer == self.mesh.ring(step) else 1

    def wait_value(self, addr, value):
        """The current stream waits until the 64-bit word at addr is >= value."""
        d = self.driver
        (err,) = d.cuStreamWaitValue64(d.CUstream(self.cp.cuda.get_current_stream().ptr),
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

    def buffer(self, ptr, nbytes, owner=None):
        return self.Buffer.from_handle(ptr, nbytes, owner=owner)

    def put_at(self, dst, src, signal, value, pe):
        """dst (a symmetric address) on pe = src (a CuPy array), then pe's signal word =
        value; with nothing to copy, the signal alone."""
        if not src.size:
            return self.signal(signal, value, pe)
        to, sig = self.buffer(dst, src.nbytes), self.buffer(signal, 8)
        frm, stream = self.buffer(src.data.ptr, src.nbytes, src), self.stream()
        self.nv.put_signal(to, frm, sig, value, self.SET, remote_pe=pe, stream=stream)

    def signal(self, signal, value, pe):
        self.nv.signal_op(self.buffer(signal, 8), value, self.SET, remote_pe=pe,
                          stream=self.stream())

    def send(self, kind, arr, peer, mb=None):
        way = self._way(kind, peer, 1)
        slots, data, ack = self.chan[(kind, way)]
        n = self.sent[(kind, way)] = self.sent[(kind, way)] + 1
        i = (n - 1) % len(slots)
        if n > len(slots):
            self.wait_value(ack[i].handle, n - len(slots))
        self.put_at(slots[i].data.ptr, arr.reshape(-1), data[i].handle, n, peer)

    def recv(self, kind, out, peer, mb=None):
        way = self._way(kind, peer, -1)
        slots, data, ack = self.chan[(kind, way)]
        n = self.got[(kind, way)] = self.got[(kind, way)] + 1
        i = (n - 1) % len(slots)
        self.wait_value(data[i].handle, n)
        out[...] = slots[i].reshape(-1)[:out.size].reshape(out.shape)
        self.signal(ack[i].handle, n, peer)

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

    # --- collectives (the module docstring): one engine, three entry points -------------

    def all_reduce(self, arr, axis):
        on_side = self.cp.cuda.get_current_stream().ptr == self.side.ptr
        w = self.windows.get((axis, on_side))
        if w is None:
            return super().all_reduce(arr, axis)
        flat = arr.reshape(-1)
        w.run(flat.size, flat.dtype, src=flat, out=flat)

    def start_all_reduce(self, arrs, axis):
        if (axis, True) not in self.windows:
            return super().start_all_reduce(arrs, axis)
        return start_on_side(self.side, arrs, lambda flat: self.all_reduce(flat, axis))

    def reduce_scatter(self, arr, out, axis):
        w = self.windows.get((axis, False))
        if w is None:
            return super().reduce_scatter(arr, out, axis)
        a, b = chunks(arr.size, len(w.members))[w.me]
        assert out.size == b - a, "reduce_scatter: out is not this member's chunk"
        flat = arr.reshape(-1)
        w.run(flat.size, flat.dtype, src=flat, mine=out.reshape(-1))

    def all_gather(self, part, out, axis):
        w = self.windows.get((axis, False))
        if w is None:
            return super().all_gather(part, out, axis)
        a, b = chunks(out.size, len(w.members))[w.me]
        assert part.size == b - a, "all_gather: part is not this member's chunk"
        w.run(out.size, out.dtype, mine=part.reshape(-1), out=out.reshape(-1))

    def finish_sends(self):
        """Waits for this rank's stream (its puts included) with the peer timeout."""
        stream = self.cp.cuda.get_current_stream()
        poll(lambda: stream.done, self.timeout, self.rank,
             "this step's transfers (a peer's data or ack)")

    def close(self):
        """Collective, at exit: frees the symmetric memory in the same order on every PE
        (NVSHMEM's frees are collective), then finalizes NVSHMEM."""
        self.cp.cuda.get_current_stream().synchronize()
        self.side.synchronize()
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


class _Window:
    """One group's collective channel on this PE, used from one stream: an inbox and a
    gather area of WINDOW bytes (g slots each, slot q for member q) and 4 * g signal words.
    Counts of reduce and gather phases run on it are the same on every member, since the
    members run the same collectives in the same order; signals carry them."""

    def __init__(self, tr, members):
        self.tr, self.members, self.me = tr, members, members.index(tr.rank)
        # read only where a peer or this member wrote in the same phase: no zeroing
        self.inbox, self.gather = (tr.nv.array((WINDOW,), dtype="uint8") for _ in range(2))
        self.sig = tr.nv.buffer(8 * 4 * len(members))
        tr.cp.from_dlpack(self.sig, copy=False).view(tr.cp.uint64).fill(0)
        self.phases = [0, 0]  # reduce phases, gather phases

    def word(self, what, q):
        return self.sig.handle + 8 * (what * len(self.members) + q)

    def run(self, n, dtype, src=None, mine=None, out=None):
        """A collective over n elements of dtype, in rounds that fit the window. src (n,):
        this member's addend, reduced to its chunk (chunks()) in member order; mine: its
        chunk (the reduced one is written there, or, without src, read from there); out (n,):
        every member's chunk gathered. Each round takes a slice of every member's chunk."""
        g, item = len(self.members), np.dtype(dtype).itemsize
        parts, w = chunks(n, g), WINDOW // (g * item)
        size = parts[0][1] - parts[0][0]  # the largest chunk
        base = parts[self.me][0]
        for lo in range(0, size, w):
            cut = [(min(a + lo, b), min(a + lo + w, b)) for a, b in parts]
            a, b = cut[self.me]
            slot = self.gather.view(dtype)[self.me * w:self.me * w + b - a]
            if src is not None:
                self.reduce(src, cut, slot, w, item)
                if mine is not None:
                    mine[a - base:b - base] = slot
            else:
                slot[...] = mine[a - base:b - base]
            if out is not None:
                self.all_gather(slot, cut, out, w, item)

    def others(self):
        """The other members, starting after this one (so members do not all put to the
        same one first)."""
        g = len(self.members)
        return [(self.me + i) % g for i in range(1, g)]

    def reduce(self, src, cut, acc, w, item):
        tr, k = self.tr, self.phases[0] + 1
        self.phases[0] = k
        for q in self.others():
            if k > 1:  # q has read its inbox of the phase before
                tr.wait_value(self.word(RED_ACK, q), k - 1)
            a, b = cut[q]
            tr.put_at(self.inbox.data.ptr + self.me * w * item, src[a:b], self.word(RED, self.me),
                   k, self.members[q])
        a, b = cut[self.me]
        for q in self.others():
            tr.wait_value(self.word(RED, q), k)
        inbox = self.inbox.view(src.dtype)
        for q in range(len(self.members)):
            part = src[a:b] if q == self.me else inbox[q * w:q * w + b - a]
            if q == 0:
                acc[...] = part
            else:
                tr.cp.add(acc, part, out=acc)
        for q in self.others():
            tr.signal(self.word(RED_ACK, self.me), k, self.members[q])

    def all_gather(self, mine, cut, out, w, item):
        tr, k = self.tr, self.phases[1] + 1
        self.phases[1] = k
        for q in self.others():
            if k > 1:  # q has copied its gather area of the phase before out
                tr.wait_value(self.word(GAT_ACK, q), k - 1)
            tr.put_at(self.gather.data.ptr + self.me * w * item, mine, self.word(GAT, self.me), k,
                   self.members[q])
        for q in self.others():
            tr.wait_value(self.word(GAT, q), k)
        gathered = self.gather.view(out.dtype)
        for q, (a, b) in enumerate(cut):
            out[a:b] = gathered[q * w:q * w + b - a]
        for q in self.others():
            tr.signal(self.word(GAT_ACK, self.me), k, self.members[q])
