"""`bench --comm`: what the step's communication costs on the transport the run uses
(--transport; auto: the backend's first) and, with --against, on a second one in the same
run, size by size: the collectives (all-reduce, reduce-scatter, all-gather over all ranks as
one group) and a stage-to-stage handoff, from 8 B to 64 MiB and at the step's own sizes, in
fp32 and in bf16 (an activation of B*T*C, what a pipeline handoff and a tensor-parallel sum
move; the data-parallel gradient sum of the model's parameters): bf16 moves half the bytes
(sums in fp32, rounded once). Latency shows at the small sizes, bandwidth at the large ones.

Each operation is timed three ways (MEASURES): alone and waited for on the host, as a
host-driven step pays it; and as a loop of messages issued back to back, between two marks
in the work's order (CUDA events on a GPU), which gives the device's time per message apart
from the host's time to issue one. On the CPU the work is the host's, so the loop's two
agree."""
import datetime
import statistics
import time

import numpy as np

from .. import CupyGPTError
from ..comm import make_transport
from ..config.sections import RUN_DTYPES
from ..parallel.memory import check_memory
from ..parallel.mesh import Mesh
from ..precision import DTYPES

SIZES = [8] + [2 ** k for k in range(6, 27, 2)]  # bytes: 8 B, 64 B, 256 B .. 64 MiB
OPS = ("all_reduce", "reduce_scatter", "all_gather", "handoff")
MEASURES = {
    "host_us": "one message alone, issued and waited for on the host (the median): what a "
               "step that waits for each message pays, the host's overhead included",
    "loop_us": "per message of a loop issued back to back, between two marks in the work's "
               "order (CUDA events on a GPU): the device's time per message; where issue_us "
               "is as large, the host's issuing paced the loop",
    "issue_us": "the host's time to issue one message of that loop (its software overhead "
                "per message)"}
# The seeds' questions: a pipeline handoff under 5 us, a small gradient sum (4 KiB to
# 4 MiB) under 100 us (NCCL's: about 500 us).
TARGETS = {"handoff_us": 5.0, "grad_sync_us": 100.0, "grad_sync_bytes": [4 << 10, 4 << 20]}
LOOP_BYTES = 256 << 20  # a timing moves at most about this much (fewer large messages)


def label(nbytes):
    return (f"{nbytes} B" if nbytes < 1 << 10 else f"{nbytes >> 10} KiB" if nbytes < 1 << 20
            else f"{nbytes >> 20} MiB")


def sizes(shape, B, T, be):
    """(label, elements, dtype name) of each message timed (the step's in each dtype the
    backend runs in)."""
    dtypes = [d for d in RUN_DTYPES if DTYPES[d] in be.DTYPES]
    return [(label(s), s // 4, "fp32") for s in SIZES] + [
        (f"activation B*T*C ({B}x{T}x{shape.C}) {d}", B * T * shape.C, d) for d in dtypes] + [
        (f"dp gradient ({shape.num_parameters():,} params) {d}", shape.num_parameters(), d)
        for d in dtypes]


def _timed(fn, line, be, transport, nbytes, steps, warmup):
    """{measure: microseconds} of fn (MEASURES). line: the transport whose messages fn
    sends, whose end of step (on the stream) closes a run of them and whose sends the host
    then waits for, after the loop's last mark."""
    def wait():
        line.finish_sends()
        be.synchronize()
    reps = max(3, min(steps, LOOP_BYTES // max(nbytes, 1)))
    for _ in range(warmup):  # first touch, lazily made communicators
        fn()
    line.end_step()
    wait()
    alone = []
    for _ in range(reps):
        transport.barrier()
        be.synchronize()
        t0 = time.perf_counter()
        fn()
        line.end_step()
        wait()
        alone.append(time.perf_counter() - t0)
    transport.barrier()
    be.synchronize()
    fn()  # absorbs the ranks' skew before the first mark
    t0, first = time.perf_counter(), be.stamp()
    for _ in range(reps):
        fn()
    line.end_step()
    last, t1 = be.stamp(), time.perf_counter()
    wait()
    a, b = be.stamp_seconds([first, last])
    return {"host_us": 1e6 * statistics.median(alone), "loop_us": 1e6 * (b - a) / reps,
            "issue_us": 1e6 * (t1 - t0) / reps}


def _transports(sess):
    """{name: (collectives' transport, handoff's)}: the session's (every rank in its dp
    group) and a pipeline of every rank of the same kind; the same two of --against's."""
    be, rank, size, c = sess.be, sess.mesh.rank, sess.mesh.size, sess.config
    out = {sess.transport.name: (sess.transport, make_transport(
        sess.transport.name, be, Mesh(rank, pp=size), c.device.peer_timeout))}
    try:
        if c.against:
            out[c.against] = tuple(make_transport(c.against, be, Mesh(rank, **grid),
                                                  c.device.peer_timeout)
                                   for grid in ({"dp": size}, {"pp": size}))
    except CupyGPTError as e:  # (a transport's refusal names --transport: here, --against)
        raise CupyGPTError(e.args[0], "against", c.against) from None
    return out


def comm_bench(sess, on_size=None):
    """The report (rank 0; None elsewhere): one row per transport and message with each
    operation's MEASURES (a handoff is half a round trip between rank 0 and rank 1) and
    its bandwidth from the loop, the crossover sizes, the seeds' answers and where the
    ranks ran."""
    be, rank, size, c, shape = sess.be, sess.mesh.rank, sess.mesh.size, sess.config, sess.shape
    steps = sizes(shape, c.batch, c.seq, be)
    most = max(n for _, n, _ in steps)
    # the largest message in fp32: its array, this rank's part, the transports' slots and
    # host copies (mpi's exchange holds the array twice more); the model itself is never
    # allocated, so only a smaller one (or B, T for the activation) lowers this
    check_memory({"messages": 6 * 4 * most}, be, sess.transport, sess.mesh,
                 f"the largest message is {most:,} fp32 values (the model's dp gradient, or "
                 f"the activation B*T*C): take a smaller model")
    kinds = _transports(sess)
    for _, line in kinds.values():  # once (GPU buffers are collective); one message each way
        line.prepare({"act": ((most,), 1, np.float32), "grad": ((most,), 1, np.float32)})
    domains = sess.transport.gather(be.memory_domain())
    be.stamp_seconds([be.stamp()])  # the marks' origin, taken once before any timing
    rows = []
    for name, n, dtype in steps:
        nbytes = n * DTYPES[dtype].itemsize
        x, part = be.zeros(n, DTYPES[dtype]), be.zeros(-(-n // size), DTYPES[dtype])
        mine = part[:min(len(part), max(0, n - rank * len(part)))]
        for kind, (coll, line) in kinds.items():  # each size on every transport in turn

            def handoff(line=line):
                if rank == 0:
                    line.send("act", x, 1, 0)
                    line.recv("grad", x, 1, 0)
                elif rank == 1:
                    line.recv("act", x, 0, 0)
                    line.send("grad", x, 0, 0)

            us = {op: _timed(fn, by, be, coll, nbytes, c.steps, c.warmup) for op, fn, by in (
                ("all_reduce", lambda coll=coll: coll.all_reduce(x, "dp"), coll),
                ("reduce_scatter", lambda coll=coll: coll.reduce_scatter(x, mine, "dp"), coll),
                ("all_gather", lambda coll=coll: coll.all_gather(mine, x, "dp"), coll),
                ("handoff", handoff, line))}
            for m in MEASURES:
                us["handoff"][m] /= 2
            rows.append({"transport": kind, "size": name, "dtype": dtype, "bytes": nbytes,
                         "ranks": size,
                         **{f"{op}_{m}": v for op, t in us.items() for m, v in t.items()},
                         "all_reduce_GBps": nbytes / us["all_reduce"]["loop_us"] / 1e3,
                         "handoff_GBps": nbytes / us["handoff"]["loop_us"] / 1e3})
        if on_size:
            on_size()
    if rank:
        return None
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            **be.device_info(), "ranks": size, "devices": len(set(domains)),
            "ranks_per_device": max(domains.count(d) for d in domains),
            "transports": list(kinds), "libraries": {k: getattr(t, "version", None)
                                                     for k, (t, _) in kinds.items()},
            "messages_per_timing": c.steps, "warmup": c.warmup, "measures": MEASURES,
            "targets": TARGETS, "rows": rows, "crossover_bytes": crossover(rows, list(kinds)),
            "seeds": seeds(rows)}


def crossover(rows, kinds):
    """{op: {measure: bytes}} with two transports: the smallest size of the fp32 sweep from
    which the second (--against) was faster at that size and every larger one; None where it
    was not faster at the largest. {} with one transport."""
    if len(kinds) < 2:
        return {}
    sweep = {k: [r for r in rows if r["transport"] == k and r["size"] == label(r["bytes"])]
             for k in kinds}
    out = {}
    for op in OPS:
        out[op] = {}
        for m in ("host_us", "loop_us"):
            at = None
            for ours, theirs in reversed(list(zip(*(sweep[k] for k in kinds)))):
                if theirs[f"{op}_{m}"] >= ours[f"{op}_{m}"]:
                    break
                at = ours["bytes"]
            out[op][m] = at
    return out


def seeds(rows):
    """The seeds' figures per transport, picked from the sweep's rows: the handoff of 8 B and
    the all-reduce of each size from 4 KiB to 4 MiB, every measure (TARGETS to hold them
    against)."""
    lo, hi = TARGETS["grad_sync_bytes"]
    out = {}
    for r in rows:
        if r["size"] != label(r["bytes"]):  # (the sweep's, not the step's sizes)
            continue
        mine = out.setdefault(r["transport"], {"handoff_8B": {}, "grad_sync": {}})
        if r["bytes"] == SIZES[0]:
            mine["handoff_8B"] = {m: r[f"handoff_{m}"] for m in MEASURES}
        if lo <= r["bytes"] <= hi:
            mine["grad_sync"][r["size"]] = {m: r[f"all_reduce_{m}"] for m in MEASURES}
    return out


def format_report(report):
    out = [f"{report['device']}: {report['ranks']} ranks on {report['devices']} device(s); us "
           f"per message, host (alone, waited for) / loop (back to back, device marks)",
           f"{'transport':<9} {'size':<44}{'all_reduce':>18}{'reduce_sc':>18}"
           f"{'all_gather':>18}{'handoff':>18}{'AR GB/s':>9}{'P2P GB/s':>9}"]
    for r in report["rows"]:
        out.append(f"{r['transport']:<9} {r['size']:<44}" + "".join(
            f"{r[op + '_host_us']:>9.1f}/{r[op + '_loop_us']:<8.1f}" for op in OPS)
            + f"{r['all_reduce_GBps']:>9.2f}{r['handoff_GBps']:>9.2f}")
    for op, at in report["crossover_bytes"].items():
        out.append(f"crossover, {op}: {report['transports'][1]} the faster from " + ", ".join(
            f"{label(b) if b else 'no size'} ({m})" for m, b in at.items()))
    return "\n".join(out)
