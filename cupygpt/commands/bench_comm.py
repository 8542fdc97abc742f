"""`bench --comm`: what the step's communication costs on the transport the run uses
(--transport; auto: the backend's first): the collectives (all-reduce, reduce-scatter,
all-gather over all ranks as one group) and a stage-to-stage handoff, from 1 KiB to 64 MiB
and at the step's own sizes, in fp32 and in bf16 (an activation of B*T*C, what a pipeline
handoff and a tensor-parallel sum move; the data-parallel gradient sum of the model's
parameters): bf16 moves half the bytes (sums in fp32, rounded once). Latency shows at the
small sizes, bandwidth at the large ones. On the CPU that is mpi; on a GPU nvshmem or
nccl, with their own collectives."""
import statistics
import time

import numpy as np

from ..comm import make_transport
from ..config.sections import RUN_DTYPES
from ..parallel.memory import check_memory
from ..parallel.mesh import Mesh
from ..precision import DTYPES

SIZES = [2 ** k for k in range(10, 27, 2)]  # bytes: 1 KiB .. 64 MiB


def _median_s(fn, be, transport, nbytes):
    """Median seconds of fn over enough repetitions (fewer for large messages)."""
    reps = max(3, min(30, (64 << 20) // max(nbytes, 1) // 8))
    fn()  # warm-up: first-touch, lazily made communicators
    times = []
    for _ in range(reps):
        transport.barrier()
        be.synchronize()
        t0 = time.perf_counter()
        fn()
        be.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def sizes(shape, B, T, be):
    """(label, elements, dtype name) of each message timed (the step's in each dtype the
    backend runs in)."""
    dtypes = [d for d in RUN_DTYPES if DTYPES[d] in be.DTYPES]
    return [(f"{s >> 10} KiB" if s < 1 << 20 else f"{s >> 20} MiB", s // 4, "fp32")
            for s in SIZES] + [
        (f"activation B*T*C ({B}x{T}x{shape.C}) {d}", B * T * shape.C, d) for d in dtypes] + [
        (f"dp gradient ({shape.num_parameters():,} params) {d}", shape.num_parameters(), d)
        for d in dtypes]


def comm_bench(sess, on_size=None):
    """One row per message size: microseconds of each collective and of a handoff (half a
    round trip between rank 0 and rank 1); rank 0 gets the rows. The session's transport
    (every rank in its dp group) times the collectives; a second one of the same kind, over
    a pipeline of every rank, the handoff."""
    be, rank, size, c, shape = sess.be, sess.mesh.rank, sess.mesh.size, sess.config, sess.shape
    coll, name = sess.transport, sess.transport.name
    line = make_transport(name, be, Mesh(rank, pp=size), c.device.peer_timeout)
    steps = sizes(shape, c.batch, c.seq, be)
    most = max(n for _, n, _ in steps)
    # the largest message in fp32: its array, this rank's part, the transports' slots and
    # host copies (mpi's exchange holds the array twice more); the model itself is never
    # allocated, so only a smaller one (or B, T for the activation) lowers this
    check_memory({"messages": 6 * 4 * most}, be, coll, sess.mesh,
                 f"the largest message is {most:,} fp32 values (the model's dp gradient, or "
                 f"the activation B*T*C): take a smaller model")
    # once (GPU buffers are collective); one message in flight each way
    line.prepare({"act": ((most,), 1, np.float32), "grad": ((most,), 1, np.float32)})
    rows = []
    for label, n, dtype in steps:
        nbytes = n * DTYPES[dtype].itemsize
        x, part = be.zeros(n, DTYPES[dtype]), be.zeros(-(-n // size), DTYPES[dtype])
        mine = part[:min(len(part), max(0, n - rank * len(part)))]

        def handoff():
            if rank == 0:
                line.send("act", x, 1, 0)
                line.finish_sends()
                line.recv("grad", x, 1, 0)
            elif rank == 1:
                line.recv("act", x, 0, 0)
                line.send("grad", x, 0, 0)
                line.finish_sends()
        us = {op: 1e6 * _median_s(fn, be, coll, nbytes) for op, fn in (
            ("all_reduce", lambda: coll.all_reduce(x, "dp")),
            ("reduce_scatter", lambda: coll.reduce_scatter(x, mine, "dp")),
            ("all_gather", lambda: coll.all_gather(mine, x, "dp")),
            ("handoff", handoff))}
        us["handoff"] /= 2
        rows.append({"transport": name, "size": label, "dtype": dtype, "bytes": nbytes,
                     "ranks": size,
                     **{f"{op}_us": v for op, v in us.items()},
                     "all_reduce_GBps": nbytes / us["all_reduce"] / 1e3,
                     "handoff_GBps": nbytes / us["handoff"] / 1e3})
        if on_size:
            on_size()
    return rows if rank == 0 else None


def format_rows(rows):
    out = [f"{'transport':<9} {'size':<44}{'all_reduce':>12}{'reduce_sc':>12}"
           f"{'all_gather':>12}{'handoff':>12}{'AR GB/s':>9}{'P2P GB/s':>9}   (us, median)"]
    for r in rows:
        out.append(f"{r['transport']:<9} {r['size']:<44}{r['all_reduce_us']:>12.1f}"
                   f"{r['reduce_scatter_us']:>12.1f}{r['all_gather_us']:>12.1f}"
                   f"{r['handoff_us']:>12.1f}{r['all_reduce_GBps']:>9.2f}{r['handoff_GBps']:>9.2f}")
    return "\n".join(out)
