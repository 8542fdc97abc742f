"""cudasim: the part of CuPy that cupygpt's CUDA backend uses, on the CPU.

Put this folder first on PYTHONPATH and `import cupy` gets this module, so the real
backend code runs unchanged: its kernels_cu sources compiled by g++ (sim.h, one fiber
per CUDA thread), its cuBLASLt matmuls done by NumPy from the very pointers, layouts and
attributes it passes (nvmath/bindings/cublasLt.py here), its CUDA graphs recorded and
replayed. It is strict
where CUDA is unforgiving, so a mistake shows up here rather than on a lent GPU:

- kernel arguments must have exactly the C parameter's type (np.int32 for int, a device
  array of float32 for float*, ...), pointers must be C-contiguous device arrays;
- launch shapes must be within CUDA's limits;
- a gemm's leading dimensions are checked as cuBLAS does, and every matrix it touches
  must lie inside one live device allocation; CuPy's own cuBLAS wrappers refuse to run
  while the current stream captures, with CuPy 14's message;
- `empty` memory is filled with NaN (ints with -1), so reading it before writing shows;
- a capture follows CuPy and CUDA (Stream, Event, ndarray.set and get below): a host copy
  on a capturing stream is refused in CuPy's words, synchronizing or querying one is
  CUDA's error and invalidates the capture, an event recorded in one is no graph node,
  other streams join a capture by waiting on its events and must be joined back; cudasim
  also refuses allocating while the current stream captures (CuPy's relaxed mode would
  allow it: see ndarray); a replayed graph reuses the arguments it captured, pointers
  included, so a freed buffer is reported;
- with CUDASIM_ORDER=random (the streams section), stream work runs on a device thread,
  streams interleaved at random and the host seeing work only after waiting for it, and
  each grid's blocks run in a random order (sim_runtime.h), so a missing wait between
  streams, or blocks that write each other's memory, change results from run to run.
TF32 compute rounds the gemm inputs to TF32 (10-bit mantissa), as tensor cores do.
bf16 is ml_dtypes.bfloat16, as in CuPy: device arrays of it, `__nv_bfloat16*` kernel
parameters (cuda_bf16.h here gives g++ CUDA's type), and GEMMs with fp32 compute.
It reports CUDASIM_DEVICES GPUs (default 1): the nccl transport, which wants one per
rank, runs with it set to the number of ranks (cudasim_nccl.py is its NCCL).
"""
import bisect
import collections
import ctypes
import hashlib
import importlib.util
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
import types
import weakref

import ml_dtypes
import numpy as np

from cupygpt.backends.cuda.kernels import kernels_in

__version__ = "cudasim"
uint8, uint16, uint64, float32, float64 = np.uint8, np.uint16, np.uint64, np.float32, np.float64
BF16 = np.dtype(ml_dtypes.bfloat16)
HERE = os.path.dirname(os.path.abspath(__file__))
GIB = 2**30
MEMORY = int(float(os.environ.get("CUDASIM_MEMORY_GIB", "80")) * GIB)


# --- streams and graphs ------------------------------------------------------------------
#
# CUDASIM_ORDER picks when stream work runs:
# - unset (or ""): when it is issued, on the calling thread; streams and waits are
#   trivially in order (fast, but it cannot show a missing wait between streams);
# - "random": a device thread runs each stream's work in issue order, picking at random
#   among the streams whose next operation may run (an event waited on has run; a wait on
#   a memory word is satisfied), and now and then idling so the host runs ahead. So one
#   stream's work may land arbitrarily early or late against another's, and the host sees
#   a stream's work only after waiting for it (synchronize, done, a device-to-host copy):
#   what CUDA promises, no more. CUDASIM_SEED fixes the choices (default: random).
ORDER = os.environ.get("CUDASIM_ORDER", "")
if ORDER not in ("", "random"):
    raise ValueError(f"CUDASIM_ORDER={ORDER!r}: '' (run when issued) or 'random'")
# the longest a stream operation may wait (a deadlock past it is reported)
WAIT_S = float(os.environ.get("CUDASIM_WAIT_S", "120"))
_streams = weakref.WeakValueDictionary()  # ptr -> Stream, for handles passed as integers


class CUDARuntimeError(RuntimeError):
    """CuPy's (cupy_backends.cuda.api.runtime, check_status): "name: CUDA's string"."""

    def __init__(self, status):
        super().__init__("%s: %s" % _CUDA_ERRORS[status])


# cudaGetErrorName and cudaGetErrorString of the errors cudasim raises (CUDA's
# driver_types.h; HIP's hip_error.cpp repeats the strings)
_CUDA_ERRORS = {
    400: ("cudaErrorInvalidResourceHandle", "invalid resource handle"),
    401: ("cudaErrorIllegalState", "the operation cannot be performed in the present state"),
    600: ("cudaErrorNotReady", "device not ready"),
    900: ("cudaErrorStreamCaptureUnsupported", "operation not permitted when stream is capturing"),
    901: ("cudaErrorStreamCaptureInvalidated",
          "operation failed due to a previous error during capture"),
    902: ("cudaErrorStreamCaptureMerge",
          "operation would result in a merge of separate capture sequences"),
    903: ("cudaErrorStreamCaptureUnmatched",
          "capture was not ended in the same stream as it began"),
    904: ("cudaErrorStreamCaptureUnjoined", "capturing stream has unjoined work"),
    905: ("cudaErrorStreamCaptureIsolation",
          "dependency created on uncaptured work in another stream"),
    907: ("cudaErrorCapturedEvent",
          "operation not permitted on an event last recorded in a capturing stream"),
}
CAPTURE_UNSUPPORTED, CAPTURE_INVALIDATED, CAPTURE_MERGE, CAPTURE_UNMATCHED = 900, 901, 902, 903
CAPTURE_UNJOINED, CAPTURE_ISOLATION, CAPTURED_EVENT = 904, 905, 907
NOT_READY, INVALID_HANDLE, ILLEGAL_STATE = 600, 400, 401


class _Capture:
    """One capture sequence, as CUDA keeps it (the programming guide's "CUDA Graphs":
    "Cross-stream Dependencies and Events", "Prohibited and Unhandled Operations",
    "Invalidation"): the work recorded, in issue order; the streams in it (the origin, and
    each stream that waited on an event recorded in it: a fork, which must join the origin
    again before the capture ends); and whether an invalid operation invalidated it: then
    every further use of its streams fails, and so does end_capture."""

    def __init__(self, origin):
        self.ops, self.origin, self.invalid, self.open = [], origin, False, True
        self.issued = {origin: 0}  # stream -> work it issued in the capture

    def fail(self, status):
        """An invalid operation: the capture is invalidated, and the call fails."""
        self.invalid = True
        raise CUDARuntimeError(status)

    def record(self, stream, op, ready):
        if self.invalid:
            raise CUDARuntimeError(CAPTURE_INVALIDATED)
        self.ops.append((op, ready))
        self.issued[stream] += 1


class Stream:
    """CuPy's Stream. null: the legacy default stream (ptr 0, device_id -1), which under
    CUDASIM_ORDER=random waits for the work of every blocking stream issued before, and
    every blocking stream waits for its work (CUDA's implicit synchronization); a
    non_blocking stream has no such order with it."""

    def __init__(self, null=False, non_blocking=False):
        self.ptr = 0 if null else id(self)
        self.device_id = -1 if null else _state["device"]
        self._non_blocking = bool(non_blocking) and not null
        self._capture = None  # the capture sequence this stream is in
        self._joined = {}     # stream -> its work (in this capture) this stream waited for
        self._last = None  # under CUDASIM_ORDER=random: the last work issued here
        _streams[self.ptr] = self
        if not null and not self._non_blocking:
            _blocking.add(self)

    def use(self):
        """CuPy's: this stream current on its device; the `with` stack is left as it is."""
        _threads.set_current(self, _device_match(self))
        return self

    def __enter__(self):
        """CuPy's: pushed on its device's stack of this thread, and made current."""
        device = _device_match(self)
        _threads.stack(device).append(self)
        _threads.pushed.append(device)
        _threads.set_current(self, device)
        return self

    def __exit__(self, *exc):
        """CuPy's: popped, and the stack's new top made current. That is the default stream
        when the stream current before the `with` was set by use() (never pushed), not that
        stream: leaving a `with` after use() moves later work to the legacy stream (CuPy's
        issue #8377)."""
        device = _threads.pushed.pop()
        stack = _threads.stack(device)
        stack.pop()
        _threads.set_current(stack[-1], device)

    def synchronize(self):
        """cudaStreamSynchronize: a capturing stream cannot be waited for (it runs nothing),
        and trying invalidates its capture (CuPy's runtime.streamSynchronize raises it)."""
        if self._capture is not None:
            self._capture.fail(CAPTURE_UNSUPPORTED)
        _finished(self._last)

    def record(self, event=None):
        event = event or Event()
        event.record(self)
        return event

    def wait_event(self, event):
        """Work issued here after this waits for the event's last record. An event recorded
        in a capture is a point of that graph: a stream outside any capture that waits on
        it joins the capture (a fork), and the origin waiting on an event recorded after
        the fork's work joins that work back. A capturing stream may not wait on an event
        recorded outside its capture (cudaStreamWaitEvent without cudaEventWaitExternal,
        which CuPy never passes) or in another capture."""
        cap, seen = event._capture, event._seen
        if self._capture is not None and cap is not self._capture:
            self._capture.fail(CAPTURE_MERGE if cap is not None else CAPTURE_ISOLATION)
        if cap is not None:
            if not cap.open:  # the event stands for no work that will run
                raise CUDARuntimeError(CAPTURED_EVENT)
            if cap.invalid:
                raise CUDARuntimeError(CAPTURE_INVALIDATED)
            if self._capture is None:  # a fork
                self._capture, self._joined = cap, {}
                cap.issued[self] = 0
            for s, n in seen.items():
                self._joined[s] = max(self._joined.get(s, 0), n)
            return
        mark = event._mark
        if _DEVICE is not None and mark is not None:
            _enqueue(lambda: None, ready=lambda: mark.done, stream=self)

    @property
    def done(self):
        """cudaStreamQuery: CuPy's runtime.streamQuery returns the status unchecked and
        `done` compares it with 0, so a capturing stream is never done (and the query has
        invalidated its capture)."""
        if self._capture is not None:
            self._capture.invalid = True
            return False
        return _finished(self._last, block=False)

    def is_capturing(self):
        """CuPy's runtime.streamIsCapturing raises for an invalidated capture."""
        if self._capture is not None and self._capture.invalid:
            raise RuntimeError("the stream was capturing, but an error has invalidated the "
                               "capture sequence")
        return self._capture is not None

    def begin_capture(self, mode=None):
        """CuPy's: relaxed mode (allocation would be allowed; cudasim refuses it anyway,
        see ndarray), not on the legacy stream, not twice."""
        if self.ptr == 0:
            raise RuntimeError("cannot capture on the default (legacy) stream")
        if mode not in (None, runtime.streamCaptureModeRelaxed):  # global, thread-local
            raise NotImplementedError("cudasim captures in CuPy's default mode, relaxed")
        if self._capture is not None:
            raise CUDARuntimeError(ILLEGAL_STATE)
        self._capture, self._joined = _Capture(self), {}

    def end_capture(self):
        """Ends the capture of every stream in it; fails where CUDA's cudaStreamEndCapture
        does: not the origin, a forked stream's work not joined back, an invalidated
        capture."""
        cap = self._capture
        if cap is None:
            raise CUDARuntimeError(ILLEGAL_STATE)
        if cap.origin is not self:
            cap.fail(CAPTURE_UNMATCHED)
        unjoined = any(n > self._joined.get(s, 0) for s, n in cap.issued.items() if s is not self)
        for s in list(cap.issued):
            s._capture, s._joined = None, {}
        cap.open = False
        if cap.invalid or unjoined:
            raise CUDARuntimeError(CAPTURE_INVALIDATED if cap.invalid else CAPTURE_UNJOINED)
        return Graph(cap.ops)


_blocking = weakref.WeakSet()  # the streams made without non_blocking (and not null)


def _device_match(stream):
    """CuPy's check_stream_device_match: a stream is used on the device it was made on."""
    current = _state["device"]
    if stream.device_id not in (-1, current):
        raise RuntimeError(f"The device that the stream is created on ({stream.device_id}) "
                           f"does not match with the current device ({current})")
    return current


class _ThreadStreams(threading.local):
    """CuPy's _ThreadLocal (cupy/cuda/stream.pyx): per thread and device, the current
    stream and the stack `with` pushes and pops, both starting at the default stream."""

    def __init__(self):
        self.current, self.stacks, self.pushed = {}, {}, []

    def stack(self, device):
        return self.stacks.setdefault(device, [_NULL])

    def set_current(self, stream, device):
        self.current[device] = stream

    def get(self):
        return self.current.get(_state["device"], _NULL)


_threads = _ThreadStreams()


class Graph:
    def __init__(self, ops):
        self._ops = ops  # (op, ready) as _enqueue took them

    def launch(self, stream=None):
        _not_capturing("graph launch")
        for op, ready in self._ops:
            _enqueue(op, ready, stream=stream or _threads.get())


class _Work:
    """One stream operation: op runs once ready() (None: at once) is true."""

    def __init__(self, op, ready, keep):
        self.op, self.ready, self.keep, self.done = op, ready, keep, False


class _Device:
    """CUDASIM_ORDER=random's GPU: one thread running every stream's queue (above)."""

    def __init__(self, seed):
        self.rng = random.Random(seed)
        self.queues = collections.defaultdict(collections.deque)  # Stream -> its _Work
        self.cv = threading.Condition()
        self.error = None
        threading.Thread(target=self.run, daemon=True, name="cudasim-device").start()

    def put(self, stream, work):
        with self.cv:
            self.queues[stream].append(work)
            stream._last = work
            self.cv.notify_all()

    def _pick(self):
        """A random stream's next work among those that may run, or None."""
        heads = [q for q in self.queues.values() if q and (q[0].ready is None or q[0].ready())]
        return self.rng.choice(heads) if heads else None

    def run(self):
        while True:
            with self.cv:
                q = self._pick()
                while q is None:  # idle, or every head waits (on a peer's signal: poll)
                    self.cv.wait(1e-4 if any(self.queues.values()) else None)
                    q = self._pick()
                work = q[0]
            if self.rng.random() < 0.05:
                time.sleep(self.rng.random() * 2e-3)  # the host runs ahead meanwhile
            try:
                if self.error is None:  # after a fault nothing more runs (a sticky error)
                    work.op()
            except BaseException as e:  # noqa: BLE001 (reported at the host's next wait)
                self.error = e
            with self.cv:
                q.popleft()
                work.done, work.keep = True, None
                self.cv.notify_all()

    def wait(self, work, block):
        """Whether work (None: nothing issued) has run; with block, waits for it first.
        A fault on the device raises here, as CUDA reports it at the next synchronize."""
        with self.cv:
            deadline = time.monotonic() + WAIT_S
            while block and work is not None and not work.done and self.error is None:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"cudasim: a stream waited {WAIT_S:g}s: a deadlock")
                self.cv.wait(0.05)
            if self.error is not None:
                raise RuntimeError(f"cudasim: a stream operation failed: {self.error}") \
                    from self.error
            return work is None or work.done


_DEVICE = _Device(int(os.environ["CUDASIM_SEED"]) if os.environ.get("CUDASIM_SEED")
                  else None) if ORDER == "random" else None


def _enqueue(op, ready=None, keep=None, stream=None):
    """Issues op on stream (default: the current one) once ready() (a memory word's wait)
    holds: recorded when the stream captures, else run now (waiting for ready() here, up to
    WAIT_S) or, under CUDASIM_ORDER=random, queued for the device thread. keep: what must
    stay alive until it runs (as CuPy's pool keeps a freed block for its stream)."""
    stream = stream or _threads.get()
    if stream._capture is not None:
        stream._capture.record(stream, op, ready)
    elif _DEVICE is not None:
        after = _legacy_order(stream)
        if after:
            wait = ready
            ready = lambda: all(w.done for w in after) and (wait is None or wait())  # noqa: E731
        _DEVICE.put(stream, _Work(op, ready, keep))
    else:
        deadline = time.monotonic() + WAIT_S
        while ready is not None and not ready():
            if time.monotonic() > deadline:
                raise RuntimeError(f"cudasim: a stream wait ({ready}) waited {WAIT_S:g}s: a "
                                   f"deadlock")
            time.sleep(1e-5)
        op()


def _legacy_order(stream):
    """The work stream's next operation waits for under CUDA's legacy default stream: on
    the default stream, the last work of every blocking stream; on a blocking stream, the
    default stream's last; on a non-blocking one, nothing."""
    if stream is _NULL:
        return [s._last for s in list(_blocking) if s._last is not None]
    return [] if stream._non_blocking or _NULL._last is None else [_NULL._last]


def _finished(work, block=True):
    """Whether work issued on a stream has run (waiting for it with block)."""
    return True if _DEVICE is None else _DEVICE.wait(work, block)


def _host_reads():
    """The host is about to read device memory after the current stream's work, as a
    device-to-host copy on it would."""
    _finished(_threads.get()._last)


def _copies_to_host(stream):
    """A device-to-host copy on stream, then its synchronize, as CuPy's ndarray.get: its
    copy_to_host_async refuses a stream that captures."""
    if stream.is_capturing():
        raise RuntimeError("the current stream is capturing, so D2H transfers are disallowed")
    stream.synchronize()


def _stream_of(handle):
    """The Stream a raw handle (its ptr) names."""
    return _streams[int(handle)]


def _not_capturing(what):
    if _threads.get()._capture is not None:
        raise RuntimeError(f"cudaErrorStreamCaptureUnsupported: {what} while the stream is "
                           f"capturing a graph")


def get_current_stream(device_id=-1):
    """CuPy's: the current stream of device_id (-1: the current device) on this thread."""
    if device_id == -1:
        return _threads.get()
    return _threads.current.get(device_id, _NULL)


class Event:
    def __init__(self):
        self._t = None
        self._mark = None  # the work of its last record (CUDASIM_ORDER=random)
        self._capture = None  # the capture its last record was made in
        self._seen = {}  # then: each stream's work in the capture it follows (for joins)

    def record(self, stream=None):
        """On a capturing stream a record is no graph node (cudaEventRecord without
        cudaEventRecordExternal): it marks a point of the capture that other streams may
        wait on, and nothing sets the event when the graph runs."""
        stream = stream or _threads.get()
        cap = stream._capture
        if cap is not None:
            if cap.invalid:
                raise CUDARuntimeError(CAPTURE_INVALIDATED)
            self._capture, self._mark = cap, None
            self._seen = {**stream._joined, stream: cap.issued[stream]}
            return
        self._capture, self._seen = None, {}
        _enqueue(lambda: setattr(self, "_t", time.perf_counter()), stream=stream)
        self._mark = stream._last

    def _not_captured(self):
        if self._capture is not None:
            raise CUDARuntimeError(CAPTURED_EVENT)

    def synchronize(self):
        """cudaEventSynchronize: refused for an event last recorded in a capture."""
        self._not_captured()
        _finished(self._mark)

    @property
    def done(self):
        """cudaEventQuery, unchecked by CuPy (runtime.eventQuery): an event last recorded
        in a capture answers cudaErrorCapturedEvent, so it is never done."""
        return self._capture is None and _finished(self._mark, block=False)


def get_elapsed_time(start_event, end_event):
    """cudaEventElapsedTime through CuPy's check_status: an event last recorded in a
    capture, or one that has not happened yet, is an error."""
    for e in (start_event, end_event):
        e._not_captured()
        if not e.done:
            raise CUDARuntimeError(NOT_READY)
        if e._t is None:  # never recorded
            raise CUDARuntimeError(INVALID_HANDLE)
    return (end_event._t - start_event._t) * 1e3


# --- memory ------------------------------------------------------------------------------

_allocs = {}    # start address -> (end address, weakref to the owning array)
_starts = []    # sorted keys of _allocs
_table = threading.RLock()  # the two above (CUDASIM_ORDER=random's device thread reads them)


def _forget(start):
    with _table:
        _allocs.pop(start, None)
        i = bisect.bisect_left(_starts, start)
        if i < len(_starts) and _starts[i] == start:
            _starts.pop(i)


def _owner_array(ptr):
    """The live device array whose allocation holds ptr (None: none does)."""
    i = bisect.bisect_right(_starts, ptr) - 1
    if i < 0 or _owner(ptr) is None:
        return None
    return _allocs[_starts[i]][1]()


def _owner(ptr, nbytes=1):
    """The live allocation holding [ptr, ptr + nbytes), or None."""
    with _table:
        i = bisect.bisect_right(_starts, ptr) - 1
        if i < 0:
            return None
        start = _starts[i]
        end, ref = _allocs[start]
    return (start, end) if ptr + nbytes <= end and ref() is not None else None


def _register(start, nbytes, owner):
    """Device memory [start, start + nbytes), alive as long as owner is."""
    with _table:
        _forget(start)
        _allocs[start] = (start + nbytes, weakref.ref(owner, lambda _, s=start: _forget(s)))
        bisect.insort(_starts, start)


class ndarray(np.ndarray):
    """A device array: NumPy memory that only kernels, gemms and copies may touch."""

    def __array_finalize__(self, obj):
        if self.base is not None or self.nbytes == 0:
            return  # a view: its owner is registered
        if _threads.get()._capture is not None:
            # cudasim's rule, not CuPy's: its relaxed capture lets the pool allocate, but
            # the graph keeps only the pointer, so an array made here and dropped is
            # handed to the next allocation while replays still write it
            raise RuntimeError("cudasim: device memory allocated while the stream is "
                               "capturing a graph (a captured step must allocate nothing)")
        free = MEMORY - _in_use()
        if self.nbytes > free:
            raise memory.OutOfMemoryError(self.nbytes, _in_use())
        _register(self.ctypes.data, self.nbytes, self)

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ctypes.data)

    def set(self, arr, stream=None):
        """A host-to-device copy on the stream (the host array is read now, as CUDA stages
        pageable memory), with CuPy's checks (ndarray.set, MemoryPointer.
        copy_from_host_async: the stream given, not the current one, may not capture)."""
        if not isinstance(arr, np.ndarray):
            raise TypeError("Only numpy.ndarray can be set to cupy.ndarray")
        if self.dtype != arr.dtype:
            raise TypeError(f"{arr.dtype} array cannot be set to {self.dtype} array")
        if self.shape != arr.shape:
            raise ValueError(f"Shape mismatch. Old shape: {self.shape}, new shape: {arr.shape}")
        if not (self.flags.c_contiguous or self.flags.f_contiguous):
            raise RuntimeError("Cannot set to non-contiguous array")
        stream = stream or _threads.get()
        if stream.is_capturing():
            raise RuntimeError("the current stream is capturing, so H2D transfers are "
                               "disallowed")
        host = np.array(arr, copy=True)
        _enqueue(lambda: np.copyto(self.view(np.ndarray), host), keep=self, stream=stream)

    def get(self, stream=None):
        """A device-to-host copy on the stream, then its synchronize (CuPy's ndarray.get,
        blocking; copy_to_host_async refuses a stream that captures)."""
        stream = stream or _threads.get()
        if self.size == 0:
            return np.ndarray(self.shape, self.dtype)
        _copies_to_host(stream)
        return np.array(self.view(np.ndarray), copy=True)

    def copy(self, order="C"):
        """A device copy (after the current stream's work)."""
        _host_reads()
        return np.ndarray.copy(self, order)

    def fill(self, value):
        """A memset or fill kernel on the stream; CuPy's fill takes a scalar only."""
        if np.ndim(value):
            kind = "cupy" if isinstance(value, ndarray) else "numpy"
            raise ValueError(f"non-scalar {kind}.ndarray cannot be used for fill")
        _enqueue(lambda: np.ndarray.fill(self, value), keep=self)

    def __array_ufunc__(self, ufunc, method, *inputs, **kw):
        """NumPy arithmetic on device arrays runs at once, so a graph would not hold it:
        refused while capturing (CuPy's would be a recorded kernel; cudasim records only
        kernels, cuBLAS calls, copies, fills, += and the ops it wraps)."""
        _not_capturing(f"numpy.{ufunc.__name__} on device arrays (not recorded)")
        _host_reads()  # it reads device memory now: after the stream's work
        host = [x.view(np.ndarray) if isinstance(x, ndarray) else x for x in inputs]
        outs = kw.get("out")
        if outs:
            kw["out"] = tuple(x.view(np.ndarray) if isinstance(x, ndarray) else x for x in outs)
        got = getattr(ufunc, method)(*host, **kw)
        if outs:
            return outs[0] if len(outs) == 1 else outs

        def device(r):  # a fresh result is fresh device memory, as CuPy's would be
            if not isinstance(r, np.ndarray):
                return r
            d = ndarray(r.shape, r.dtype)
            np.copyto(d.view(np.ndarray), r)
            return d
        return tuple(map(device, got)) if isinstance(got, tuple) else device(got)

    def __iadd__(self, other):
        """An elementwise kernel on the stream, like CuPy's."""
        _device_operand(other)
        src = other.view(np.ndarray) if isinstance(other, ndarray) else other
        _enqueue(lambda: np.add(self.view(np.ndarray), src, out=self.view(np.ndarray)),
                 keep=(self, other))
        return self

    def __getitem__(self, key):
        """A view, or an element read on the host: CuPy gives a 0-d view, whose value
        reaches the host by get (refused while the stream captures)."""
        got = np.ndarray.__getitem__(self, key)
        if isinstance(got, np.ndarray):
            return got
        _copies_to_host(_threads.get())
        return got

    def __setitem__(self, key, value):
        """CuPy's _scatter_op: from a device array, a copy on the stream (recorded while
        capturing, read from the source when it runs); anything else is fill's, a scalar
        (CuPy refuses a host array here, cupy#2079: upload it with set)."""
        if not isinstance(value, ndarray) and np.ndim(value):
            raise ValueError("non-scalar numpy.ndarray cannot be used for fill")
        src = value.view(np.ndarray) if isinstance(value, ndarray) else value
        _enqueue(lambda: np.ndarray.__setitem__(self.view(np.ndarray), key, src),
                 keep=(self, value))

    def all(self):
        _host_reads()
        return asarray(np.ndarray.all(self.view(np.ndarray)))


def _in_use():
    with _table:
        return sum(end - start for start, (end, ref) in _allocs.items() if ref() is not None)


def _alloc(shape, dtype, value):
    a = ndarray(shape, dtype)
    if value is None:  # uninitialized: poison it
        value = (np.nan if np.dtype(dtype).kind == "f" or np.dtype(dtype) == BF16
                 else ~np.zeros((), dtype))  # every bit set: -1, or unsigned's largest
    np.ndarray.fill(a, value)
    return a


def empty(shape, dtype=np.float32):
    return _alloc(shape, dtype, None)


def zeros(shape, dtype=np.float32):
    return _alloc(shape, dtype, 0)


def empty_like(prototype):
    return empty(prototype.shape, prototype.dtype)


def zeros_like(a):
    return zeros(a.shape, a.dtype)


def ones_like(a):
    return _alloc(a.shape, a.dtype, 1)


def asarray(a, dtype=None):
    host = np.ascontiguousarray(a, dtype)
    out = empty(host.shape, host.dtype)
    out.set(host)
    return out


def array(obj, *, copy=True):
    return obj.copy() if isinstance(obj, ndarray) else asarray(obj)


def from_dlpack(array, *, copy=None):
    """A view of a registered buffer (cudasim's nvshmem buffers), as nvshmem4py makes."""
    if _owner(array.handle, array.size) is None:
        raise RuntimeError("from_dlpack: not device memory")
    return array.owner.view(ndarray)


def _device_operand(x):
    """CuPy's kernels take device arrays and scalars; a host array is no scalar
    (_kernel.pyx's _preprocess_arg, _scalar.pyx's CScalar)."""
    if isinstance(x, np.ndarray) and not isinstance(x, ndarray):
        raise TypeError(f"Unsupported type {type(x)}")


def add(a, b, out):
    _device_operand(a)
    _device_operand(b)
    _enqueue(lambda: np.add(a.view(np.ndarray), b.view(np.ndarray), out=out.view(np.ndarray)),
             keep=(a, b, out))
    return out


def asnumpy(a):
    return a.get() if isinstance(a, ndarray) else np.array(a, copy=True)


def isfinite(a):
    return asarray(np.isfinite(asnumpy(a)))


class _Pool:
    def total_bytes(self):
        return _in_use()

    used_bytes = total_bytes

    def free_bytes(self):
        return 0


def get_default_memory_pool():
    return _POOL


# --- kernels -----------------------------------------------------------------------------

_C_SCALARS = {"int": np.int32, "unsigned": np.uint32, "long long": np.int64,
              "float": np.float32, "double": np.float64}
_C_POINTEES = {"int": np.int32, "unsigned": np.uint32, "unsigned short": np.uint16,
               "long long": np.int64,
               "float": np.float32, "double": np.float64, "__nv_bfloat16": BF16}
_CTYPES = {np.int32: ctypes.c_int32, np.uint32: ctypes.c_uint32, np.int64: ctypes.c_int64,
           np.float32: ctypes.c_float, np.float64: ctypes.c_double}


def _signatures(code, options=()):
    """{kernel: [(C type without const, parameter name)]} for each extern "C" kernel, its
    types' macros (-DNAME=TYPE options, as floatX) replaced as the compiler would."""
    macros = dict(o[2:].split("=", 1) for o in options if o.startswith("-D") and "=" in o)
    out = {}
    for name, params in kernels_in(code).items():
        out[name] = []
        for p in params.split(","):
            ctype, pname = re.match(r"(.*?)\s*(\w+)$", " ".join(p.split())).groups()
            words = ctype.replace("const", "").replace("*", " * ").split()
            out[name].append((" ".join(macros.get(w, w) for w in words), pname))
    return out


def _key_flag(flag):
    """A flag as the cache key holds it: an include directory by the files in it, and a
    path into this folder (the forced include of sim.h, whose text the key holds) without
    where the folder is, so an installed copy of kernels_cu, or another clone, reuses the
    build."""
    if not flag.startswith("-I"):
        return flag.replace(HERE, "<cudasim>")
    d = flag[2:]
    return "-I" + "".join(f"\0{n}\0{open(os.path.join(d, n), errors='replace').read()}"
                          for n in sorted(os.listdir(d)) if os.path.isfile(os.path.join(d, n)))


def _compile(code, options):
    """The shared library for code, built once and cached on disk (like CuPy's cache)."""
    sigs = _signatures(code, options)
    wrappers = []
    for name, params in sigs.items():
        call = ", ".join(f"*({t.replace(' *', '*')}*)a[{i}]" for i, (t, _) in enumerate(params))
        wrappers.append(f'extern "C" const char* cudasim_{name}(unsigned gx, unsigned gy, '
                        f'unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned smem, '
                        f'void** a) {{\n'
                        f'    return sim::launch({{gx, gy, gz}}, {{bx, by, bz}}, smem, [&] {{ '
                        f'{name}({call}); }});\n}}\n')
    src = code + '\n#include "sim_runtime.h"\n' + "".join(wrappers)
    # of CuPy's options, the include directories and the macros (the launch geometry, the
    # storage type); not the CUDA toolkit's headers, which are for nvcc (here: cuda_bf16.h)
    flags = ["-std=c++17", "-O2", "-fPIC", "-shared", "-x", "c++", "-include",
             os.path.join(HERE, "sim.h"), f"-I{HERE}",
             *(o for o in options if o.startswith("-D") or o.startswith("-I") and not
               os.path.isfile(os.path.join(o[2:], "cuda_runtime.h")))]
    key = hashlib.sha256("\0".join([src, *map(_key_flag, flags),
                                    *(open(os.path.join(HERE, h)).read()
                                      for h in ("sim.h", "sim_runtime.h", "sim_mma.h"))]).encode())
    cache = os.environ.get("CUDASIM_CACHE") or os.path.join(tempfile.gettempdir(),
                                                            f"cudasim-{os.getuid()}")
    os.makedirs(cache, exist_ok=True)
    lib = os.path.join(cache, key.hexdigest()[:24] + ".so")
    if not os.path.exists(lib):
        tmp = f"{lib}.{os.getpid()}.tmp"
        res = subprocess.run(["g++", *flags, "-", "-o", tmp], input=src, text=True,
                             capture_output=True)
        if res.returncode:
            raise RuntimeError(f"cudasim: g++ failed:\n{res.stderr}")
        os.replace(tmp, lib)
    return ctypes.CDLL(lib), sigs


class RawModule:
    def __init__(self, code, *, options=()):
        self._lib, self._sigs = _compile(code, options)

    def get_function(self, name):
        if name not in self._sigs:
            raise RuntimeError(f"CUDA_ERROR_NOT_FOUND: no kernel {name}")
        fn = getattr(self._lib, f"cudasim_{name}")
        fn.restype = ctypes.c_char_p
        return _Kernel(name, fn, self._sigs[name])


def _dims(d):
    d = tuple(int(x) for x in (d if isinstance(d, tuple) else (d,)))
    return d + (1,) * (3 - len(d))


SHARED_DEFAULT = 48 * 1024  # CUDA's per-block limit without the opt-in


def _shared_opt_in():
    """The per-block opt-in the device reports: sm_90's 227 KiB, or CUDASIM_SMEM_OPTIN's
    bytes (read at each call, so a test can pretend a 99 KiB sm_86/89/120 device)."""
    return int(os.environ.get("CUDASIM_SMEM_OPTIN", 227 * 1024))



class _Kernel:
    def __init__(self, name, fn, params):
        self.name, self._fn, self._params = name, fn, params
        self._max_dynamic = SHARED_DEFAULT

    @property
    def max_dynamic_shared_size_bytes(self):
        return self._max_dynamic

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, n):  # cuFuncSetAttribute's opt-in
        if not 0 <= n <= _shared_opt_in():
            raise RuntimeError(f"cudaErrorInvalidValue: {self.name}: {n} bytes of dynamic "
                               f"shared memory (at most {_shared_opt_in()})")
        self._max_dynamic = int(n)

    def _arg(self, i, value):
        ctype, pname = self._params[i]
        where = f"kernel {self.name}, argument {i} ({ctype} {pname})"
        if ctype.endswith("*"):
            want = _C_POINTEES[ctype[:-1].strip()]
            if not isinstance(value, ndarray) or value.dtype != want:
                raise TypeError(f"{where}: needs a {np.dtype(want).name} device array, got "
                                f"{type(value).__name__} {getattr(value, 'dtype', '')}")
            if not value.flags.c_contiguous:
                raise TypeError(f"{where}: a strided view; kernels index it as contiguous")
            return ctypes.c_void_p(value.ctypes.data), value.nbytes
        want = _C_SCALARS[ctype]
        if type(value) is not want:
            raise TypeError(f"{where}: needs np.{np.dtype(want).name}, got "
                            f"{type(value).__name__} (CuPy would pass it with another size)")
        return _CTYPES[want](value), None

    def __call__(self, grid, block, args, *, shared_mem=0):
        (gx, gy, gz), (bx, by, bz) = _dims(grid), _dims(block)
        if not (0 < bx <= 1024 and 0 < by <= 1024 and 0 < bz <= 64 and bx * by * bz <= 1024
                and 0 < gx < 2**31 and 0 < gy < 65536 and 0 < gz < 65536):
            raise RuntimeError(f"cudaErrorInvalidConfiguration: {self.name} grid "
                               f"{(gx, gy, gz)} block {(bx, by, bz)}")
        if len(args) != len(self._params):
            raise TypeError(f"kernel {self.name}: {len(args)} arguments for "
                            f"{len(self._params)} parameters")
        if not 0 <= shared_mem <= self._max_dynamic:
            raise RuntimeError(f"cudaErrorInvalidValue: {self.name}: {shared_mem} bytes of "
                               f"dynamic shared memory, above its {self._max_dynamic} (set "
                               f"max_dynamic_shared_size_bytes first)")
        held = [self._arg(i, a) for i, a in enumerate(args)]
        argv = (ctypes.c_void_p * len(held))(*[ctypes.addressof(h) for h, _ in held])

        def run():
            for i, (h, nbytes) in enumerate(held):
                if nbytes is not None and _owner(h.value, nbytes) is None:
                    raise RuntimeError(f"kernel {self.name}, argument {i}: its buffer was "
                                       f"freed (a graph replayed past a reallocation?)")
            err = self._fn(gx, gy, gz, bx, by, bz, int(shared_mem), argv)
            if err:
                raise RuntimeError(f"kernel {self.name}: {err.decode()}")
        _enqueue(run, keep=args)


# --- cuBLAS ------------------------------------------------------------------------------

def _matrix(ptr, rows, cols, ld, stride, batch, what, dtype=np.float32):
    """The column-major rows x cols matrices (batched) of dtype at ptr, as a NumPy view."""
    if ld < max(1, rows):
        raise RuntimeError(f"CUBLAS_STATUS_INVALID_VALUE: ld{what}={ld} < {rows} rows")
    item = np.dtype(dtype).itemsize
    extent = (batch - 1) * stride + (cols - 1) * ld + rows if rows and cols and batch else 0
    if extent and _owner(ptr, extent * item) is None:
        raise RuntimeError(f"cuBLAS: matrix {what} ({batch}x{rows}x{cols}, ld {ld}, stride "
                           f"{stride}) reaches outside the device allocation at {ptr:#x}")
    buf = (ctypes.c_char * (max(extent, 1) * item)).from_address(ptr)
    flat = np.frombuffer(buf, dtype, max(extent, 1))
    return np.lib.stride_tricks.as_strided(flat, (batch, rows, cols),
                                           (stride * item, item, ld * item))


def _tf32(a):
    u = np.ascontiguousarray(a, np.float32).view(np.uint32)
    return ((u + np.uint32(0xFFF) + ((u >> 13) & 1)) & np.uint32(0xFFFFE000)).view(np.float32)


def _set_stream(handle, stream):
    """CuPy 14's cublas.setStream: refused while that stream captures (CuPy's own words),
    and every CuPy cuBLAS wrapper calls it with the current stream first, so no cuBLAS call
    through CuPy can be captured. The backend calls cuBLASLt instead (nvmath stand-in)."""
    s = _streams.get(stream)
    if s is not None and s.is_capturing():
        raise NotImplementedError("calling cuBLAS API during stream capture is currently "
                                  "unsupported")


def _sgemm_strided_batched(handle, transa, transb, m, n, k, alpha, A, lda, strideA, B, ldb,
                           strideB, beta, C, ldc, strideC, batchCount):
    _set_stream(handle, _threads.get().ptr)
    a_ = ctypes.c_float.from_address(alpha).value  # host pointer mode: read at call time
    b_ = ctypes.c_float.from_address(beta).value
    opA = _matrix(A, *((m, k) if transa == 0 else (k, m)), lda, strideA, batchCount, "A")
    opB = _matrix(B, *((k, n) if transb == 0 else (n, k)), ldb, strideB, batchCount, "B")
    outC = _matrix(C, m, n, ldc, strideC, batchCount, "C")

    def run():
        x = opA if transa == 0 else opA.transpose(0, 2, 1)
        y = opB if transb == 0 else opB.transpose(0, 2, 1)
        r = np.float32(a_) * np.matmul(x, y)
        outC[...] = r if b_ == 0 else r + np.float32(b_) * outC  # beta 0: C is not read
    _enqueue(run)


cublas = types.SimpleNamespace(setStream=_set_stream, sgemmStridedBatched=_sgemm_strided_batched)


# --- the cupy.cuda namespace ---------------------------------------------------------------

class Device:
    def __init__(self, device=None):
        self.id = _state["device"] if device is None else device
        if not 0 <= self.id < _DEVICES:
            raise RuntimeError(f"cudaErrorInvalidDevice: device {self.id}")

    def use(self):
        _state["device"] = self.id

    @property
    def pci_bus_id(self):
        return f"0000:{self.id + 1:02x}:00.0"

    @property
    def attributes(self):  # (CuPy's holds every cudaDeviceAttr; the backend reads this one)
        return {"MaxSharedMemoryPerBlockOptin": _shared_opt_in()}


class _OutOfMemoryError(MemoryError):
    def __init__(self, size, total, limit=0):  # CuPy's: total is what is allocated so far
        super().__init__(f"Out of memory allocating {size:,} bytes (allocated so far: "
                         f"{total:,} bytes)")


_DEVICES = int(os.environ.get("CUDASIM_DEVICES", "1"))
# the name the device reports (a test gives a GPU's to reach code keyed by it, e.g. MFU's peak)
_NAME = os.environ.get("CUDASIM_DEVICE_NAME", "cudasim (CPU)").encode()
_POOL = _Pool()
_state = {"device": 0}
_NULL = Stream(null=True)
Stream.null = _NULL
memory = types.SimpleNamespace(OutOfMemoryError=_OutOfMemoryError)
runtime = types.SimpleNamespace(
    CUDARuntimeError=CUDARuntimeError, streamCaptureModeRelaxed=2,
    getDeviceCount=lambda: _DEVICES,
    memGetInfo=lambda: (MEMORY - _in_use(), MEMORY),
    getDeviceProperties=lambda device: {"name": _NAME, "totalGlobalMem": MEMORY},
    driverGetVersion=lambda: 0, runtimeGetVersion=lambda: 0)
cuda = types.SimpleNamespace(
    Stream=Stream, Event=Event, Device=Device, Graph=Graph, get_current_stream=get_current_stream,
    set_allocator=lambda allocator=None: None,  # no pool to turn off
    get_elapsed_time=get_elapsed_time, runtime=runtime, memory=memory,
    device=types.SimpleNamespace(get_cublas_handle=lambda: 1))

# `from cupy.cuda import nccl` finds cudasim's NCCL (cudasim_nccl.py)
sys.modules["cupy.cuda"] = cuda
_spec = importlib.util.spec_from_file_location("cupy.cuda.nccl",
                                               os.path.join(HERE, "cudasim_nccl.py"))
cuda.nccl = sys.modules["cupy.cuda.nccl"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cuda.nccl)

# `from cupy_backends.cuda.libs import cublas` finds these
for _name in ("cupy_backends", "cupy_backends.cuda", "cupy_backends.cuda.libs"):
    sys.modules[_name] = types.ModuleType(_name)
sys.modules["cupy_backends.cuda.libs"].cublas = cublas
