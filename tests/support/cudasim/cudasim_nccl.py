"""cudasim's cupy.cuda.nccl (cupy.py installs it there): the calls the nccl transport
makes, between processes on the CPU, with the real signatures.

A communicator is named by its unique id; each message is a file in /dev/shm, written
whole and then renamed into place, so a reader never sees half of one. A send is eager
(its file is the message: real NCCL may instead wait for the receiver, which a schedule
that works on a GPU never depends on); a receive waits for the file and removes it. A
collective's call number k names each member's contribution, written once for each other
member; every member reads (and removes) those for it and sums in member order (member 0 +
member 1 + ...), so tests are deterministic (real NCCL's order is its own). So the reader
removes every message: a member that finishes first leaves nothing a slower one still
needs (removing its own at exit raced with them), and a finished job leaves no files.
"""
import ctypes
import os
import time
import uuid

import cupy
import ml_dtypes
import numpy as np

NCCL_FLOAT32, NCCL_FLOAT64, NCCL_BFLOAT16, NCCL_SUM = 7, 8, 9, 0
NCCL_ERROR_INVALID_USAGE = 5
available = True
# the NCCL it stands for (CUDASIM_NCCL_VERSION: another, e.g. 22703 for one that refuses
# ranks sharing a GPU whatever the environment says)
VERSION = int(os.environ.get("CUDASIM_NCCL_VERSION", "23203"))
WAIT_S = float(os.environ.get("CUDASIM_WAIT_S", "120"))
_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
_DTYPES = {NCCL_FLOAT32: np.float32, NCCL_FLOAT64: np.float64,
           NCCL_BFLOAT16: ml_dtypes.bfloat16}


class NcclError(RuntimeError):
    """The real one also keeps status on each instance, which the offer check (reading
    classes) cannot see: nothing here reads it, so the stand-in only words its message."""
    def __init__(self, status):
        super().__init__({NCCL_ERROR_INVALID_USAGE: "NCCL_ERROR_INVALID_USAGE: invalid usage "
                          "(run with NCCL_DEBUG=WARN for details)"}[status])


def get_version():
    return VERSION


def get_unique_id():
    return uuid.uuid4().bytes


def _device(ptr, count, datatype):
    """The count elements at a device pointer, as a NumPy view."""
    dtype = np.dtype(_DTYPES[datatype])
    if count and cupy._owner(ptr, count * dtype.itemsize) is None:
        raise RuntimeError(f"NCCL: {count} x {dtype} at {ptr:#x} is not device memory")
    buf = (ctypes.c_char * (count * dtype.itemsize)).from_address(ptr) if count else b""
    return np.frombuffer(buf, dtype, count)


def _write(path, arr):
    tmp = f"{path}.tmp"
    arr.tofile(tmp)
    os.replace(tmp, path)


def _read(path, dtype):
    """Waits for the message, takes it and removes it."""
    deadline = time.monotonic() + WAIT_S
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise RuntimeError(f"cudasim NCCL: waited {WAIT_S:g}s for {path}: a deadlock")
        time.sleep(1e-4)
    out = np.fromfile(path, dtype)
    os.unlink(path)
    return out


def _on(stream, op):
    """op as work of the stream the call names (its handle), as NCCL enqueues it: in that
    stream's order, recorded while it captures (NCCL is capturable since 2.9). Messages
    are counted when they run, so each replay of a graph sends the next ones."""
    cupy._enqueue(op, stream=cupy._stream_of(stream))


class NcclCommunicator:
    def __init__(self, ndev, commId, rank, config=None):
        self._n, self._rank = ndev, rank
        self._name = os.path.join(_DIR, f"cudasim-nccl-{commId.hex()}")
        self._sent, self._got, self._calls = {}, {}, 0
        # collective, as NCCL's init: the members' GPUs (by bus id) are compared, and two
        # on one GPU refused as NCCL refuses them (before 2.30, or without the variable)
        mine = np.frombuffer(cupy.cuda.Device().pci_bus_id.encode(), np.uint8)
        for r in range(ndev):
            if r != rank:
                _write(f"{self._name}-init-{rank}-{r}", mine)
        buses = {mine.tobytes()} | {_read(f"{self._name}-init-{r}-{rank}", np.uint8).tobytes()
                                    for r in range(ndev) if r != rank}
        shared = VERSION >= 23000 and os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") == "1"
        if len(buses) < ndev and not shared:
            raise NcclError(NCCL_ERROR_INVALID_USAGE)

    def send(self, sendbuf, count, datatype, peer, stream):
        src = _device(sendbuf, count, datatype)

        def op():
            k = self._sent[peer] = self._sent.get(peer, 0) + 1
            _write(f"{self._name}-p{self._rank}-{peer}-{k}", src)
        _on(stream, op)

    def recv(self, recvbuf, count, datatype, peer, stream):
        out = _device(recvbuf, count, datatype)

        def op():
            k = self._got[peer] = self._got.get(peer, 0) + 1
            np.copyto(out, _read(f"{self._name}-p{peer}-{self._rank}-{k}", out.dtype)
                      .reshape(out.shape))
        _on(stream, op)

    def _all(self, data):
        """Every member's data of this call, in member order."""
        self._calls += 1
        k, me = self._calls, self._rank
        for r in range(self._n):
            if r != me:
                _write(f"{self._name}-c{k}-{me}-{r}", data)
        return [np.array(data) if r == me else _read(f"{self._name}-c{k}-{r}-{me}", data.dtype)
                for r in range(self._n)]

    def _sum(self, data):
        parts = self._all(data)
        acc = parts[0].copy()
        for p in parts[1:]:
            acc += p
        return acc

    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
        assert op == NCCL_SUM, "cudasim's NCCL sums only"
        src, out = _device(sendbuf, count, datatype), _device(recvbuf, count, datatype)
        _on(stream, lambda: np.copyto(out, self._sum(src)))

    def reduceScatter(self, sendbuf, recvbuf, recvcount, datatype, op, stream):
        assert op == NCCL_SUM, "cudasim's NCCL sums only"
        src = _device(sendbuf, recvcount * self._n, datatype)
        out, at = _device(recvbuf, recvcount, datatype), self._rank * recvcount
        _on(stream, lambda: np.copyto(out, self._sum(src)[at:at + recvcount]))

    def allGather(self, sendbuf, recvbuf, count, datatype, stream):
        src = _device(sendbuf, count, datatype)
        out = _device(recvbuf, count * self._n, datatype)
        _on(stream, lambda: np.copyto(out, np.concatenate(self._all(src))))
