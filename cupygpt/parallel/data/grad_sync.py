"""The step's gradient sums, after (or during) its last backward: GPT-2's tied wte (the
embedding's and the head's ends) and the data-parallel replicas' sum, overlapped with the
backward or not, handed to ZeRO-1's reduce-scatter or not."""
from __future__ import annotations

from collections.abc import Callable

from ...comm.base import Transport
from ...model.layout import PARAM_NAMES, WHOLE
from ...model.stage import Stage


class GradSync:
    """stages: this rank's; tied_peer: the rank holding wte's other end (None when both ends
    are here, or neither); zero: ZeRO-1 (the optimizer reduce-scatters what is not summed
    here); overlap: the replicas' all-reduce starts layer by layer during each chunk's
    last backward (with ZeRO-1 each replica then updates its slice of the sums instead of
    reduce-scattering after the backward: twice the bytes, hidden behind the backward)."""

    def __init__(self, stages: list[Stage], transport: Transport, *, tied_peer: int | None, dp: int,
                 zero: bool, overlap: bool) -> None:
        self.stages, self.transport, self.tied_peer = stages, transport, tied_peer
        self.zero, self.dp = zero, dp
        self.overlap = overlap and dp > 1
        self.summed = not zero  # whether the step's gradients are the replicas' sums
        self.in_flight = []
        self.embed = next((st for st in stages if st.embed), None)
        self.head = next((st for st in stages if st.head), None)

    def layer_hook(self, stage: Stage, last_backward: bool) -> Callable | None:
        """What a backward calls as each layer's gradients become final: in the chunk's last
        backward with overlap, the start of that layer's sum; else nothing (None)."""
        if not (self.overlap and last_backward):
            return None
        return lambda l: self._layer_done(stage, l)

    def _layer_done(self, st, l):
        """Layer l's gradients are final (the step's last backward passed it), so the
        replicas start summing them while the layers below are computed."""
        for h in self.in_flight:  # in start order, stopping at the first not ready
            if not h.progress():
                break
        self.in_flight.append(self.transport.start_all_reduce(
            [st.g[n][l] for n in PARAM_NAMES if n in st.g and n not in WHOLE], "dp"))

    def finish(self) -> None:
        """After the step's last backward: the embedding's and the head's wte gradients are
        summed (through the transport when they are on two ranks); then the replicas'
        (with ZeRO-1 and no overlap, the optimizer reduce-scatters them instead)."""
        if self.tied_peer is not None:
            self.transport.sum_tied((self.embed or self.head).g["wte"], self.tied_peer)
        elif self.embed is not None and self.head is not None and self.embed is not self.head:
            e, h = self.embed.g["wte"], self.head.g["wte"]
            e += h          # the order sum_tied adds in: the embedding's + the head's
            h[...] = e
        self.summed = bool(self.in_flight) or not self.zero
        if self.in_flight:  # overlapped: the layers' sums are under way; add the rest
            rest = [st.g[n] for st in self.stages for n in WHOLE if n in st.g]
            if rest:  # (a middle chunk has none)
                self.in_flight.append(self.transport.start_all_reduce(rest, "dp"))
            for h in self.in_flight:
                h.wait()
            self.in_flight = []
        elif not self.zero:
            for st in self.stages:
                self.transport.all_reduce(st.grads, "dp")

    def summed_grads(self, st: Stage) -> dict:
        """Stage st's gradient views, summed over the replicas (a copy when ZeRO-1 left the
        sum to the optimizer); collective over the dp group."""
        if self.summed:
            return st.g
        whole = st.grads.copy()
        self.transport.all_reduce(whole, "dp")
        return st.layout.views(whole)
