"""The GPU as the CUDA backend sees it: its memory, the host's waits for its stream, the
stamps of --trace, CUDA graphs and the workspaces kept for the process. All work goes to
one non-blocking stream (configure makes it current)."""
from __future__ import annotations

import socket
import time
from collections.abc import Callable, Hashable

import cupy as cp
import numpy as np
from numpy.typing import DTypeLike

from ... import CupyGPTError
from ...precision import BF16


def stream_synchronize(stream) -> None:
    """CUDA's own wait for a stream: the host's wait until a transport bounds it."""
    stream.synchronize()


class Device:
    """The CudaBackend's memory, waits, stamps and graphs (its state: CudaBackend's
    workspaces, host_wait and origin)."""

    def device_name(self) -> str:
        """The run table's name of the GPU this rank computes on."""
        return f"GPU {cp.cuda.Device().id} ({cp.cuda.Device().pci_bus_id})"

    def memory_domain(self) -> Hashable:
        """What ranks with the same answer allocate from: this rank's GPU, by its PCI bus id
        (a device index counts only the GPUs this process is shown)."""
        return socket.gethostname(), cp.cuda.Device().pci_bus_id

    def _ws(self, key: str, n: int, dtype: DTypeLike = np.float32, zeroed: bool = False):
        """A workspace buffer of at least n elements of dtype, kept for the process (zeroed:
        made with zeros, for a user that leaves it zeroed)."""
        buf = self.workspaces.get((key, np.dtype(dtype)))
        if buf is None or buf.size < n:
            buf = self.workspaces[key, np.dtype(dtype)] = (cp.zeros if zeroed else cp.empty)(
                n, dtype)
        return buf[:n]

    def zeros(self, n: int, dtype: DTypeLike = np.float32):
        try:
            return cp.zeros(n, dtype)
        except cp.cuda.memory.OutOfMemoryError:
            free, total = cp.cuda.runtime.memGetInfo()
            raise CupyGPTError(f"out of GPU memory allocating "
                               f"{n * np.dtype(dtype).itemsize / 2**30:.2f} GiB "
                               f"({free / 2**30:.2f} GiB free of {total / 2**30:.2f}); lower "
                               f"the batch size or sequence length, or use more pipeline "
                               f"stages") from None

    # Copies name the stream: before CuPy 14 a copy without one went through the legacy
    # default stream, which does not wait for work on our non-blocking stream.

    def upload(self, dst, host: np.ndarray) -> None:
        """Copies a host array into an existing device array (no allocation), in stream
        order."""
        dst.set(np.ascontiguousarray(host, dtype=dst.dtype), stream=cp.cuda.get_current_stream())

    # How the host waits for a stream: CUDA's synchronize, unless a transport whose peers'
    # signals the stream waits on bounded it (bound_host_waits): a stream waiting on a
    # stopped peer never finishes, and a synchronize (or a copy to pageable host memory)
    # never gives up.

    def bound_host_waits(self, wait: Callable) -> None:
        """wait(stream): returns once the stream's work has run, or raises; every host wait
        of this backend goes through it from now on."""
        self.host_wait = wait

    def _compute_stream(self):
        """The current stream, checked to be the compute stream configure made current: a
        step's work left on another stream (the legacy one, after a `with stream:` ended)
        would run unordered with it, and every result would be in doubt."""
        stream = cp.cuda.get_current_stream()
        if self.stream is not None and stream != self.stream:
            raise CupyGPTError(f"internal error: the current CUDA stream is {stream}, not the "
                               f"backend's compute stream {self.stream}: work was issued off "
                               f"it (CuPy's `with stream:` restores its own stack's top, not "
                               f"a stream set with use(); use comm.gpu.on_stream)")
        return stream

    def to_host(self, a) -> np.ndarray:
        """A host copy of a, once the work queued before it has finished: the stream is
        waited for first, so the copy itself has nothing left to wait on."""
        stream = self._compute_stream()
        self.host_wait(stream)
        out = a.get(stream=stream)
        stream.synchronize()
        return out

    def synchronize(self) -> None:
        self.host_wait(self._compute_stream())

    def all_finite(self, a) -> bool:
        if a.dtype == BF16:  # a bf16 is finite when its exponent bits are not all ones
            return bool(self.to_host(((a.view(cp.uint16) & 0x7F80) != 0x7F80).all()))
        return bool(self.to_host(cp.isfinite(a).all()))

    def stamp(self):
        """A CUDA event recorded on the compute stream (--trace): when the GPU got there."""
        if self.origin is None:  # (an event and the host's time, taken together once)
            self.synchronize()
            e = cp.cuda.Event()
            e.record()
            self.synchronize()
            self.origin = (e, time.perf_counter())
        e = cp.cuda.Event()
        e.record()
        return e

    def stamp_seconds(self, marks: list) -> list[float]:
        """Host-clock seconds of recorded events: the origin's host time plus GPU elapsed."""
        self.synchronize()
        e0, h0 = self.origin
        return [h0 + cp.cuda.get_elapsed_time(e0, m) / 1e3 for m in marks]

    def capture(self, fn: Callable):
        """Records fn's launches on the current stream as a CUDA graph (nothing runs yet).
        Every matmul in fn must have run eagerly once (its cuBLASLt plan is made then; the
        workspace is our own, allocated with the first); a step is captured only once."""
        stream = self._compute_stream()
        stream.begin_capture()
        try:
            fn()
        finally:
            graph = stream.end_capture()
        return graph

    def replay(self, graph) -> None:
        graph.launch(cp.cuda.get_current_stream())

    def memory_in_use(self) -> int:
        return cp.get_default_memory_pool().total_bytes()

    def device_memory(self) -> int | None:
        """Free device memory, bytes (the driver's free plus what CuPy's pool holds
        unused)."""
        return cp.cuda.runtime.memGetInfo()[0] + cp.get_default_memory_pool().free_bytes()
