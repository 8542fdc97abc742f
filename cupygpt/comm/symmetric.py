"""What the NVSHMEM transport (nvshmem.py) keeps in symmetric memory besides its
point-to-point slots: the per-step ledger of signal counts, and the collectives' windows.

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
control is the point-to-point's: a member acks each inbox and gather area once read, and
each collective settles its window's counts at its end, so it can be captured too.

The symmetric memory is allocated with the transport (allocation is collective over all
PEs, so it cannot wait for a group's first collective: other stages may be blocked on a
receive then): a fixed window per (axis, stream) whose groups have several members, and
a collective larger than the window runs in rounds, each round a slice of every member's
chunk. So nothing depends on the runner announcing sizes, and memory stays bounded.
"""
from __future__ import annotations

import numpy as np
from numpy.typing import DTypeLike

from ..precision import wide
from .base import Transport, chunks

# bytes of each collective inbox and gather area, per axis and stream: the pipeline's group
# sums one number (the gradient norm)
WINDOW = {"dp": 16 << 20, "tp": 16 << 20, "pp": 1 << 12}
RED, RED_ACK, GAT, GAT_ACK = range(4)  # a window's signal words, g of each


class Ledger:
    """Signal words this PE waits on, counted per step (the module docstring): peers add 1
    per event; wait() waits for the next event on a word, owe() notes one that will come
    (an ack for a put); settle() waits for all owed and takes the counts back off. Each
    word is written by one peer, named with it (a wait that times out names the peer)."""

    def __init__(self, transport: Transport) -> None:
        self.transport, self.taken, self.owed, self.peer = transport, {}, {}, {}

    def owe(self, addr: int, peer: int) -> None:
        self.owed[addr] = self.owed.get(addr, 0) + 1
        self.peer[addr] = peer

    def pending(self, addr: int) -> bool:
        return self.owed.get(addr, 0) > self.taken.get(addr, 0)

    def wait(self, addr: int, peer: int) -> None:
        n = self.taken[addr] = self.taken.get(addr, 0) + 1
        self.owed[addr] = max(self.owed.get(addr, 0), n)
        self.peer[addr] = peer
        self.transport.wait_value(addr, n, peer)

    def settle(self) -> None:
        for addr, n in self.owed.items():
            if self.taken.get(addr, 0) < n:
                self.transport.wait_value(addr, n, self.peer[addr])
            self.transport.signal(addr, -n, self.transport.rank)
        self.taken, self.owed = {}, {}


class Window:
    """One group's collective channel on this PE, used from one stream: an inbox and a
    gather area of WINDOW[axis] bytes (g slots each, slot q for member q) and 4 * g signal words,
    counted by a ledger of its own and settled at the end of each collective (so a captured
    step holds whole collectives)."""

    def __init__(self, transport: Transport, members: list[int], axis: str) -> None:
        self.transport, self.members, self.me = transport, members, members.index(transport.rank)
        self.size = WINDOW[axis]
        # read only where a peer or this member wrote in the same phase: no zeroing
        self.inbox, self.gather = (transport.nv.array((self.size,), dtype="uint8")
                                   for _ in range(2))
        # a bf16 sum is added in float (rounded once, as the other transports): this many
        # floats hold a round of this member's chunk
        self.acc = transport.cp.empty(self.size // 4, transport.cp.float32)
        self.sig = transport.nv.buffer(8 * 4 * len(members))
        transport.cp.from_dlpack(self.sig, copy=False).view(transport.cp.uint64).fill(0)
        self.ledger = Ledger(transport)

    def word(self, what: int, q: int) -> int:
        return self.sig.handle + 8 * (what * len(self.members) + q)

    def run(self, n: int, dtype: DTypeLike, src=None, mine=None, out=None):
        """A collective over n elements of dtype, in rounds that fit the window. src (n,):
        this member's addend, reduced to its chunk (chunks()) in member order; mine: its
        chunk (the reduced one is written there, or, without src, read from there); out (n,):
        every member's chunk gathered. Each round takes a slice of every member's chunk."""
        g, item = len(self.members), np.dtype(dtype).itemsize
        parts, w = chunks(n, g), self.size // (g * item)
        size = parts[0][1] - parts[0][0]  # the largest chunk
        base = parts[self.me][0]
        for lo in range(0, size, w):
            cut = [(min(a + lo, b), min(a + lo + w, b)) for a, b in parts]
            a, b = cut[self.me]
            slot = self.gather.view(dtype)[self.me * w:self.me * w + b - a]
            if src is not None:
                self.phase(RED, self.inbox, [src[c:d] for c, d in cut], w, item)
                inbox = self.inbox.view(src.dtype)
                acc = slot if wide(dtype) == dtype else self.acc[:b - a]
                for q in range(g):  # the sum in member order
                    part = src[a:b] if q == self.me else inbox[q * w:q * w + b - a]
                    if q == 0:
                        acc[...] = part
                    else:
                        self.transport.cp.add(acc, part, out=acc)
                if acc is not slot:
                    slot[...] = acc
                self.read(RED)
                if mine is not None:
                    mine[a - base:b - base] = slot
            else:
                slot[...] = mine[a - base:b - base]
            if out is not None:
                self.phase(GAT, self.gather, [slot] * g, w, item)
                gathered = self.gather.view(out.dtype)
                for q, (c, d) in enumerate(cut):
                    out[c:d] = gathered[q * w:q * w + d - c]
                self.read(GAT)
        self.ledger.settle()

    def others(self) -> list[int]:
        """The other members, starting after this one (so members do not all put to the
        same one first)."""
        g = len(self.members)
        return [(self.me + i) % g for i in range(1, g)]

    def phase(self, what: int, area, parts: int, w: int, item: int):
        """Puts parts[q] into member q's area (this member's slot of it), once q has read
        what the phase before left there, then waits for every member's put here."""
        transport, led = self.transport, self.ledger
        for q in self.others():
            if led.pending(self.word(what + 1, q)):
                led.wait(self.word(what + 1, q), self.members[q])
            transport.put_at(area.data.ptr + self.me * w * item, parts[q],
                             self.word(what, self.me), self.members[q])
            led.owe(self.word(what + 1, q), self.members[q])
        for q in self.others():
            led.wait(self.word(what, q), self.members[q])

    def read(self, what: int) -> None:
        """This member has read the phase's area: the others may put there again."""
        for q in self.others():
            self.transport.signal(self.word(what + 1, self.me), 1, self.members[q])
