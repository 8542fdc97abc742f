"""cudasim's nvshmem4py (0.4 API, as the installed package defines it): the calls the
nvshmem transport makes, between processes on the CPU.

Symmetric memory is one file per (allocation, PE) in /dev/shm, mapped by every PE, so a
put is a copy into the peer's mapping and a signal an 8-byte store into it (x86 keeps
the two in order). Any address inside an allocation is symmetric (a Buffer made from
it reaches the same offset on the peer), as in NVSHMEM. Allocations and frees are
collective, as in NVSHMEM: every PE must make the same ones in the same order. With it
come the pieces of cuda.core and cuda.bindings.driver the transport uses. Puts, signals and
cuStreamWaitValue64 are operations of the stream they name: run when issued (the calling
thread waits for the word), or under CUDASIM_ORDER=random in that stream's order on
cudasim's device thread, where a wait holds only its own stream; a satisfied wait lags
LAG_S more.
"""
import atexit
import bisect
import ctypes
import fcntl
import mmap
import os
import sys
import time
import types
import uuid

import cupy
import numpy as np

from .direct import SignalOp

# A satisfied wait holds its PE back a little, so a sender that does not wait for its
# receiver (flow control) runs ahead and overwrites a slot before it is read.
LAG_S = float(os.environ.get("CUDASIM_LAG_S", "0.02"))
SHM = "/dev/shm" if os.path.isdir("/dev/shm") else None
_job = {"comm": None, "tag": None, "count": 0, "own": [], "buffers": {}, "starts": [],
        "symmetric": {}}  # starts: sorted local addresses of the live allocations


class Buffer:
    """cuda.core's Buffer: a device pointer, a size, and what keeps the memory alive."""

    def __init__(self, ptr, size, owner=None):
        self.handle, self.size, self.owner = int(ptr), int(size), owner

    @staticmethod
    def from_handle(ptr, size, mr=None, owner=None):
        return Buffer(ptr, size, owner)


class _Symmetric(Buffer):
    def __init__(self, size, maps):
        self._maps = maps  # maps[pe]: that PE's mmap of this allocation
        local = np.frombuffer(maps[_job["comm"].Get_rank()], np.uint8, count=size)
        super().__init__(local.ctypes.data, size, local)

    def _peer(self, pe):
        return ctypes.addressof(ctypes.c_char.from_buffer(self._maps[pe]))


def _remote(buf, pe):
    """The address on pe of buf's first byte, which must lie in symmetric memory."""
    i = bisect.bisect_right(_job["starts"], buf.handle) - 1
    sym = _job["symmetric"].get(_job["starts"][i]) if i >= 0 else None
    if sym is None or buf.handle + buf.size > sym.handle + sym.size:
        raise RuntimeError(f"nvshmem: {buf.handle:#x} (+{buf.size}) is not symmetric memory")
    return sym._peer(pe) + buf.handle - sym.handle


def init(device=None, uid=None, rank=None, nranks=None, mpi_comm=None, initializer_method=""):
    if initializer_method not in ("mpi", "uid", "emulated_mpi") or mpi_comm is None:
        raise ValueError("cudasim's nvshmem supports MPI-based init only")
    _job["comm"] = mpi_comm
    _job["tag"] = mpi_comm.bcast(uuid.uuid4().hex[:12] if mpi_comm.Get_rank() == 0 else None)
    if mpi_comm.Get_rank() == 0:
        _job["own"].append(_lock_path())  # removed at finalize, after its barrier
    atexit.register(_unlink_own)


def _path(index, pe):
    return os.path.join(SHM or "/tmp", f"cudasim-{_job['tag']}-{index}-{pe}")


def buffer(size, release=False, except_on_del=True):
    """Collective: every PE creates its part, then maps everyone's."""
    comm, index = _job["comm"], _job["count"]
    _job["count"] += 1
    size = max(8, int(size))
    own = _path(index, comm.Get_rank())
    with open(own, "wb") as f:
        f.truncate(size)
    _job["own"].append(own)
    comm.Barrier()
    maps = []
    for pe in range(comm.Get_size()):
        with open(_path(index, pe), "r+b") as f:
            maps.append(mmap.mmap(f.fileno(), size))
    buf = _Symmetric(size, maps)
    cupy._register(buf.handle, size, buf.owner)
    bisect.insort(_job["starts"], buf.handle)
    _job["symmetric"][buf.handle] = buf
    return buf


def array(shape, dtype="float32", release=False, morder="C", except_on_del=True):
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    buf = buffer(n)
    arr = cupy.from_dlpack(buf, copy=False).view(dtype).reshape(shape)
    _job["buffers"][arr.data.ptr] = buf
    return arr


def array_get_buffer(array):
    buf = _job["buffers"].get(array.data.ptr)
    if buf is None:
        raise RuntimeError("Tried to retrieve buffer from Array not tracked by nvshmem")
    return buf, array.nbytes, str(array.dtype)


def _as_buffer(x):
    return x if isinstance(x, Buffer) else array_get_buffer(x)[0]


def _lock_path():
    return os.path.join(SHM or "/tmp", f"cudasim-{_job['tag']}.lock")


def _signal(sig, value, op, pe):
    """An atomic set or add (modulo 2^64, as the word wraps), as NVSHMEM's: an add reads
    and writes, so it holds the job's lock (two PEs may add to one word at once)."""
    word = ctypes.c_uint64.from_address(_remote(sig, pe))
    if op == SignalOp.SIGNAL_SET:
        word.value = value
        return
    with open(_lock_path(), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        word.value = (word.value + value) % (1 << 64)


class NvshmemInvalid(Exception):
    """nvshmem4py's (nvshmem_types.py)."""


def _on_stream(signal_var, stream):
    """nvshmem4py's checks (rma.py's _call_putget and signal_op): an 8-byte signal Buffer,
    and a stream (host-side calls without one are not implemented)."""
    if not isinstance(signal_var, Buffer) or signal_var.size < 8:
        raise NvshmemInvalid("Signal must be a Buffer >= 8 bytes allocated by NVSHMEM4Py")
    if stream is None:
        raise NotImplementedError


def put_signal(dst, src, signal_var, signal_val, signal_op, remote_pe=-1, stream=None):
    dst, src = _as_buffer(dst), _as_buffer(src)
    _on_stream(signal_var, stream)
    n = min(dst.size, src.size)
    to, _ = _remote(dst, remote_pe), _remote(signal_var, remote_pe)  # both symmetric

    def op():
        ctypes.memmove(to, src.handle, n)
        _signal(signal_var, signal_val, signal_op, remote_pe)
    cupy._enqueue(op, keep=src, stream=cupy._stream_of(stream.handle))


def signal_op(signal_var, signal_val, signal_op, remote_pe=-1, stream=None):
    _on_stream(signal_var, stream)
    cupy._enqueue(lambda: _signal(signal_var, signal_val, signal_op, remote_pe),
                  stream=cupy._stream_of(stream.handle))


def free(buffer):
    _job["comm"].Barrier()
    cupy._forget(buffer.handle)
    _job["starts"].remove(buffer.handle)
    del _job["symmetric"][buffer.handle]


def free_array(array):
    free(_job["buffers"].pop(array.data.ptr))


def finalize():
    _job["comm"].Barrier()
    _unlink_own()


def _unlink_own():
    for path in _job["own"]:
        if os.path.exists(path):
            os.unlink(path)
    _job["own"] = []


# --- cuda.core and cuda.bindings.driver, as far as the transport uses them ------------------

class Device:
    def __init__(self, device_id=0):
        self.device_id = device_id

    def set_current(self):
        cupy.cuda.Device(self.device_id).use()


class Stream:
    def __init__(self, handle):
        self.handle = handle

    @staticmethod
    def from_handle(handle):
        return Stream(handle)

    def __cuda_stream__(self):
        return (0, self.handle)


class _Reached:
    """cuStreamWaitValue64's condition: the word at addr is >= value, and has been for
    LAG_S (measured from when a wait first saw it; each run of the wait starts afresh, so
    a replayed graph lags as its first run)."""

    def __init__(self, addr, value):
        self.word, self.value, self.since = ctypes.c_uint64.from_address(int(addr)), value, None

    def __call__(self):
        if self.word.value < self.value:
            return False
        self.since = self.since or time.monotonic()
        return time.monotonic() - self.since >= LAG_S

    def passed(self):
        self.since = None

    def __str__(self):
        return f"cuStreamWaitValue64 for {self.value} (has {self.word.value})"


def _wait_value64(stream, addr, value, flags):
    if flags != _driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ:
        raise NotImplementedError("cudasim's cuStreamWaitValue64 waits for >= only")
    reached = _Reached(addr, value)
    cupy._enqueue(reached.passed, ready=reached, stream=cupy._stream_of(stream))
    return (0,)


_driver = types.SimpleNamespace(
    cuStreamWaitValue64=_wait_value64, CUstream=lambda h: h, CUdeviceptr=lambda p: p,
    CUstreamWaitValue_flags=types.SimpleNamespace(CU_STREAM_WAIT_VALUE_GEQ=0),
    CUresult=types.SimpleNamespace(CUDA_SUCCESS=0))
_core = types.SimpleNamespace(Buffer=Buffer, Device=Device, Stream=Stream)
for _name, _attrs in (("cuda", {}), ("cuda.core", vars(_core)),
                      ("cuda.bindings", {"driver": None}), ("cuda.bindings.driver", vars(_driver))):
    sys.modules[_name] = types.ModuleType(_name)
    vars(sys.modules[_name]).update(_attrs)
sys.modules["cuda.bindings"].driver = sys.modules["cuda.bindings.driver"]
sys.modules["cuda"].core = sys.modules["cuda.core"]
sys.modules["cuda"].bindings = sys.modules["cuda.bindings"]
