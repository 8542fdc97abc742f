"""`bench --comm`: what the step's communication costs on each transport this backend can
use: the collectives (all-reduce, reduce-scatter, all-gather over all ranks as one group)
and a stage-to-stage handoff, from 1 KiB to 64 MiB and at the step's own sizes (the
tensor-parallel activation sum of B*T*C floats, the data-parallel gradient sum of the
model's parameters). Latency shows at the small sizes, bandwidth at the large ones."""
import statistics
import time

from . import CupyGPTError
from .comm import make_transport
from .parallel.mesh import Mesh

SIZES = [2 ** k for k in range(10, 27, 2)]  # bytes: 1 KiB .. 64 MiB


def _median_s(fn, be, tr, nbytes):
    """Median seconds of fn over enough repetitions (fewer for large messages)."""
    reps = max(3, min(30, (64 << 20) // max(nbytes, 1) // 8))
    fn()  # warm-up: first-touch, lazily made communicators
    times = []
    for _ in range(reps):
        tr.barrier()
        be.synchronize()
        t0 = time.perf_counter()
        fn()
        be.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _sizes(cfg, B, T):
    return [(f"{s >> 10} KiB" if s < 1 << 20 else f"{s >> 20} MiB", s) for s in SIZES] + [
        (f"tp activation B*T*C ({B}x{T}x{cfg.C})", B * T * cfg.C * 4),
        (f"dp gradient ({cfg.num_parameters():,} params)", cfg.num_parameters() * 4)]


def comm_bench(sess, on_size=None):
    """One row per (transport, message size): microseconds of each collective and of a
    handoff (half a round trip between rank 0 and rank 1); rank 0 gets the rows."""
    be, rank, size, c, cfg = sess.be, sess.mesh.rank, sess.mesh.size, sess.config, sess.shape
    rows = []
    for name in be.TRANSPORTS:
        try:  # one group of every rank for the collectives, a pipeline for the handoff
            coll = make_transport(name, be, sess.mesh, c.device.peer_timeout)
            line = make_transport(name, be, Mesh(rank, pp=size), c.device.peer_timeout)
        except CupyGPTError as e:  # e.g. nccl with fewer GPUs than ranks
            rows.append({"transport": name, "skipped": str(e)})
            continue
        for label, nbytes in _sizes(cfg, c.batch, c.seq):
            n = nbytes // 4
            x, part = be.zeros(n), be.zeros(-(-n // size))
            mine = part[:min(len(part), max(0, n - rank * len(part)))]
            line.prepare({"act": ((n,), 2), "grad": ((n,), 2)})

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
                ("reduce_scatter", lambda: coll.reduce_scatter(x, part[:len(mine)], "dp")),
                ("all_gather", lambda: coll.all_gather(mine, x, "dp")),
                ("handoff", handoff))}
            us["handoff"] /= 2
            rows.append({"transport": name, "size": label, "bytes": nbytes, "ranks": size,
                         **{f"{op}_us": v for op, v in us.items()},
                         "all_reduce_GBps": nbytes / us["all_reduce"] / 1e3,
                         "handoff_GBps": nbytes / us["handoff"] / 1e3})
            if on_size:
                on_size()
    return rows if rank == 0 else None


def format_rows(rows):
    out = [f"{'transport':<9} {'size':<34}{'all_reduce':>12}{'reduce_sc':>12}"
           f"{'all_gather':>12}{'handoff':>12}{'AR GB/s':>9}{'P2P GB/s':>9}   (us, median)"]
    for r in rows:
        if "skipped" in r:
            out.append(f"{r['transport']:<9} skipped: {r['skipped']}")
            continue
        out.append(f"{r['transport']:<9} {r['size']:<34}{r['all_reduce_us']:>12.1f}"
                   f"{r['reduce_scatter_us']:>12.1f}{r['all_gather_us']:>12.1f}"
                   f"{r['handoff_us']:>12.1f}{r['all_reduce_GBps']:>9.2f}{r['handoff_GBps']:>9.2f}")
    return "\n".join(out)
