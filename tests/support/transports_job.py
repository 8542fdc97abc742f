"""One rank of test_transports.py's jobs: `mpiexec -n N python transports_job.py TRANSPORT
PP DP TP`, on cudasim. Checks the transport's collectives on every group of size > 1, and,
with pp > 1, "act" and "grad" exchanged with both ring neighbours, interleaved. Prints
what it checked; any mismatch fails the rank (and the job)."""
import sys

import cupy as cp
import numpy as np

from cupygpt.backends.cuda.backend import CudaBackend
from cupygpt.comm import make_transport
from cupygpt.comm.base import chunks
from cupygpt.parallel.mesh import Mesh

be = CudaBackend()
name, pp, dp, tp = sys.argv[1], *map(int, sys.argv[2:5])
if name == "nvshmem":  # a small window, so the larger collectives run in several rounds
    import cupygpt.comm.nvshmem as nvs
    nvs.WINDOW = 1024
from mpi4py import MPI  # noqa: E402

rank = MPI.COMM_WORLD.Get_rank()
mesh = Mesh(rank, pp, dp, tp)
tr = make_transport(name, be, mesh, 60)
# member-order float32 sums are mpi's and nvshmem's bits; NCCL adds in an order of its own
exact = name != "nccl"


def data(member, n, salt, dtype=np.float32):
    return np.random.default_rng([member, n, salt]).standard_normal(n).astype(dtype)


def same_bits_in_group(host, group):
    """host's bytes are the same on every member of group (collective over the world)."""
    every = MPI.COMM_WORLD.allgather(host.tobytes())
    assert len({every[r] for r in group}) == 1, f"rank {rank}: members' bits differ"


def check_sum(got, group, n, salt, dtype):
    parts = [data(m, n, salt, dtype) for m in range(len(group))]
    ref = np.sum(np.array(parts, np.float64), axis=0)
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)
    if exact:
        acc = parts[0].copy()
        for p in parts[1:]:
            acc += p
        assert got.tobytes() == acc.tobytes(), f"rank {rank}: not the member-order sum"


def collectives(axis):
    group = next(g for g in mesh.groups(axis) if rank in g)
    me, g = group.index(rank), len(group)
    for n, dtype in ((1, np.float64), (7, np.float32), (1001, np.float32)):
        runs = []
        for _ in range(2):  # a repeat gives the same bits
            x = cp.asarray(data(me, n, 0, dtype))
            tr.all_reduce(x, axis)
            runs.append(cp.asnumpy(x))
        assert runs[0].tobytes() == runs[1].tobytes(), f"rank {rank}: a repeat differs"
        check_sum(runs[0], group, n, 0, dtype)
        same_bits_in_group(runs[0], group)

        a, b = chunks(n, g)[me]
        out = cp.zeros(b - a, dtype)
        tr.reduce_scatter(cp.asarray(data(me, n, 0, dtype)), out, axis)
        got = cp.asnumpy(out)
        np.testing.assert_allclose(got, runs[0][a:b], rtol=1e-6, atol=1e-6)
        if exact:
            assert got.tobytes() == runs[0][a:b].tobytes(), f"rank {rank}: reduce_scatter"

        whole = np.concatenate([data(m, n, 1, dtype)[slice(*chunks(n, g)[m])] for m in range(g)])
        out = cp.zeros(n, dtype)
        out[a:b] = cp.asarray(whole[a:b])
        tr.all_gather(out[a:b], out, axis)  # part: a view of out, as the model passes it
        assert cp.asnumpy(out).tobytes() == whole.tobytes(), f"rank {rank}: all_gather"

    xs = [cp.asarray(data(me, n, 2)) for n in (5, 300)]
    handle = tr.start_all_reduce(xs, axis)
    handle.progress()
    handle.wait()
    for x, n in zip(xs, (5, 300)):
        got = cp.asnumpy(x)
        check_sum(got, group, n, 2, np.float32)
        same_bits_in_group(got, group)
    print(f"rank {rank}: {name} {axis} collectives over {g} members ok")


def ring():
    """Each message carries (sender, receiver, kind, index), so a mix-up shows."""
    up, down = mesh.ring(1), mesh.ring(-1)
    shape = (3, 4)
    tr.prepare({"act": (shape, 2, np.float32), "grad": (shape, 2, np.float32),
                "tied": ((2,), 1, np.float32)})

    def msg(src, dst, kind, i):
        return np.full(shape, src * 1000 + dst * 100 + (kind == "grad") * 10 + i, np.float32)
    for i in range(7):  # up every time, down two times in three: the channels' counts differ
        ways = [(up, down), (up,), (down, up)][i % 3]
        for kind, peer in [(k, p) for k in ("act", "grad") for p in ways]:
            tr.send(kind, cp.asarray(msg(rank, peer, kind, i)), peer, i)
        froms = [{up: down, down: up}[p] for p in ways[::-1]]  # what the neighbours send me
        for kind, peer in [(k, p) for p in froms for k in ("grad", "act")]:
            out = cp.zeros(shape, cp.float32)
            tr.recv(kind, out, peer, i)
            assert (cp.asnumpy(out) == msg(peer, rank, kind, i)).all(), \
                f"rank {rank}: {kind} {i} from {peer}: {cp.asnumpy(out)[0, 0]}"
    tr.finish_sends()
    print(f"rank {rank}: {name} ring of {pp} ok")


for axis in ("dp", "tp"):
    if getattr(mesh, axis) > 1:
        collectives(axis)
if pp > 1:
    ring()
tr.barrier()
