"""The transport interface every rank's communication goes through, and the one wait loop.

A transport moves a stage's activation forward and its residual gradient back, sums the
tied wte gradient between the first and last stage, runs the collectives of the data- and
tensor-parallel groups, and carries small control values (losses, sampled tokens, verify
reports). Sends may return before the receiver has the
data; the sender may then overwrite its buffer. Every wait on a peer ends in an error
after the peer timeout, naming what it waited for, so a lost rank never hangs the job.
Peers are ranks; which rank is which stage is the Mesh's business (parallel/mesh.py).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from .. import CupyGPTError

AXES = ("dp", "tp", "pp")  # the groups every transport makes communicators for


def poll(done: Callable[[], bool], timeout: float, rank: int, what: str,
         most: float = 1e-3) -> None:
    """Waits until done() is true, or raises after timeout seconds naming `what`. The naps
    grow to `most` seconds: what it returns late by at most (a host wait for the GPU stream,
    which bench and train time, passes a small one)."""
    deadline, nap = time.monotonic() + timeout, 1e-5
    while not done():
        if time.monotonic() > deadline:
            raise CupyGPTError(f"rank {rank}: timed out after {timeout:g}s waiting for {what} "
                               f"(the peer timeout); is every rank alive?")
        time.sleep(nap)
        nap = min(nap * 2, most)


def chunks(n: int, parts: int) -> list[tuple[int, int]]:
    """[start, stop) of each member's part of an n-element flat array: ceil(n / parts)
    each, the last ones shorter (or empty). Reduce-scatter and all-gather cut this way."""
    c = -(-n // parts)
    return [(min(i * c, n), min((i + 1) * c, n)) for i in range(parts)]


class Done:
    """A finished collective's handle."""

    def progress(self) -> bool:
        """Advances it without blocking; False while it waits on its first phase."""
        return True

    def wait(self) -> None:
        pass


class Transport:
    """What the runner and the commands call. `name`, `rank` and `size` are attributes."""
    name, rank, size = "", 0, 1

    def prepare(self, shapes: dict) -> None:
        """Collective, once: {kind: (shape, depth, dtype)} of every channel (dtype: the
        run's, what its messages hold); GPU transports allocate their buffers here."""

    def send(self, kind: str, arr, peer: int, mb: int | None = None) -> None:
        raise NotImplementedError

    def recv(self, kind: str, out, peer: int, mb: int | None = None) -> None:
        raise NotImplementedError

    def sum_tied(self, arr, peer: int) -> None:
        """arr becomes (first stage's + last stage's), bit-identical on both ranks."""
        raise NotImplementedError

    # Collectives over the mesh's groups, axis "dp", "tp" or "pp" (AXES; the pipeline's
    # carries only the gradient norm's one number). Sums are taken in the group's
    # order (member 0 + member 1 + ...), whatever the timing, so every member gets the same
    # bits and a run repeats exactly (nccl: the same, but in NCCL's own order, so its bits
    # are not mpi's). With one member they are copies (the base class).

    def all_reduce(self, arr, axis: str) -> None:
        """arr (any shape) becomes the sum of the group's arrs, in place."""

    def start_all_reduce(self, arrs: list, axis: str) -> Done:
        """Starts summing the arrays (one message, every member passing the same shapes)
        and returns a handle; handle.wait() finishes it. The sums are all_reduce's bits.
        Here: done at once (one member, or a transport without non-blocking collectives)."""
        for a in arrs:
            self.all_reduce(a, axis)
        return Done()

    def reduce_scatter(self, arr, out, axis: str) -> None:
        """out (flat) = the sum over the group of this member's chunk of arr (chunks())."""
        out[...] = arr.reshape(-1)[:out.size]

    def all_gather(self, part, out, axis: str) -> None:
        """out (flat) = every member's part, in group order; part is this member's chunk of
        out (chunks()) and may be a view of it."""
        if part.size:
            out.reshape(-1)[:part.size] = part.reshape(-1)

    # Whether a step's communication is all on the compute stream (no host waits, no host
    # copies), so the runner may capture a pipelined step as a CUDA graph.
    graphable = False

    def end_step(self) -> None:
        """The end of a pass's actions, on the stream (a captured step includes it)."""

    def finish_sends(self) -> None:
        """Returns when every send of this step has been taken (or times out); on the host,
        after the pass (or its graph's replay)."""

    def bcast(self, obj: Any, root: int = 0) -> Any:
        raise NotImplementedError

    def gather(self, obj: Any) -> list | None:
        """A list of every rank's obj on rank 0, None elsewhere."""
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError

    def any(self, flag: bool) -> bool:
        """True on every rank when flag is true on any."""
        raise NotImplementedError
