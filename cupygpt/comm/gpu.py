"""What the GPU transports (nccl, nvshmem) share: the overlapped all-reduce on a side
stream, so the gradient sum runs while the compute stream goes on with the backward; how
the host waits for a stream."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from .base import Transport, poll

# A host wait for the stream polls it (CUDA's synchronize never gives up on a stream stuck
# on a stopped peer) in naps of at most this: a step's time measured across it is this
# much late at most.
STREAM_NAP_S = 5e-5


def wait_stream(stream, transport: Transport, what: str) -> None:
    """Returns once stream's work has run, or raises after transport's peer timeout."""
    poll(lambda: stream.done, transport.timeout, transport.rank, what, STREAM_NAP_S)


class SideHandle:
    """An all-reduce enqueued on a side stream; `done` is that stream's event after it."""

    def __init__(self, done: Callable[[], bool]) -> None:
        self.done = done

    def progress(self) -> bool:
        """Everything is enqueued at the start: nothing to advance, only to ask."""
        return self.done.done

    def wait(self) -> None:
        """The compute stream (current) waits for the sum; the host does not."""
        from cupy import cuda
        cuda.get_current_stream().wait_event(self.done)


@contextmanager
def on_stream(stream) -> Iterator:
    """stream current inside the block, and after it the stream that was current before.
    Not CuPy's `with stream:`: leaving that makes the top of CuPy's own stack current,
    which is the legacy default stream when the backend made its compute stream current
    with use() (CuPy's issue #8377): every later launch would go there, ordered with
    nothing on the compute stream."""
    from cupy import cuda
    before = cuda.get_current_stream()
    stream.use()
    try:
        yield stream
    finally:
        before.use()


def start_on_side(side, arrs: list, all_reduce: Callable) -> SideHandle:
    """Packs arrs into one flat buffer, sums it with all_reduce(flat) and unpacks, all on
    the side stream after what the compute stream has issued so far. The buffer lives on
    the side stream only, so CuPy's pool never hands it to another stream still in use."""
    import cupy as cp
    side.wait_event(cp.cuda.get_current_stream().record())
    with on_stream(side):
        flat = cp.empty(sum(a.size for a in arrs), arrs[0].dtype)
        off = 0
        for a in arrs:
            flat[off:off + a.size] = a.reshape(-1)
            off += a.size
        all_reduce(flat)
        off = 0
        for a in arrs:
            a[...] = flat[off:off + a.size].reshape(a.shape)
            off += a.size
        return SideHandle(side.record())
