"""`bench`: throughput, MFU, memory and where the time goes, for one GPU (or the CPU)."""
import statistics
import time

from .. import CupyGPTError
from ..config.configs import BenchConfig
from ..config.sections import RUN_DTYPES, out_file
from ..model.initialize import init_params
from ..model.optim import AdamWConfig
from ..model.shape import flops_per_token, mfu
from ..paths import check_outputs, make_parent
from ..precision import numerics
from ..train.loader import DataLoader


def bench(sess, on_step=None):
    """The `bench` command over a Session holding its validated BenchConfig; on_step() after
    each step, warm-up included. With --dtype both: {"fp32": ..., "bf16": ...,
    "bf16_speedup"}, with --attention both: {"cudnn": ..., "own": ..., "cudnn_speedup"},
    each timed by a runner of its own (the first freed first)."""
    c = sess.config
    # (validate made nothing)
    make_parent("trace", c.trace, sess.transport.rank == 0, c.overwrite)
    if c.device.attention == "both":  # (validated: not with --dtype both)
        out = {kind: _bench(sess, c.dtype, on_step, kind) for kind in ATTENTIONS}
        out["cudnn_speedup"] = (out["own"]["ms_per_step_median"]
                                / out["cudnn"]["ms_per_step_median"])
        return out
    if c.dtype != "both":
        return _bench(sess, c.dtype, on_step)
    out = {name: _bench(sess, name, on_step) for name in RUN_DTYPES}
    out["bf16_speedup"] = out["fp32"]["ms_per_step_median"] / out["bf16"]["ms_per_step_median"]
    return out


ATTENTIONS = ("cudnn", "own")  # --attention both: in this order, each a runner of its own
ATTENTION_OPS = ("attention_forward", "attention_backward")


def side_by_side(r):
    """--attention both's comparison: each path's ms per step and, profiled, the ms per
    step of each kernel (or cuDNN call) inside the attention ops."""
    lines = ["attention side by side: " + ", ".join(
        f"{k} {r[k]['ms_per_step_median']:.2f} ms/step" for k in ATTENTIONS)
        + f"; cuDNN's step is {r['cudnn_speedup']:.2f}x the own kernels' speed"]
    for k in ATTENTIONS:
        rows = [row for row in r[k].get("per_kernel", []) if row["op"] in ATTENTION_OPS]
        lines += [f"  {k:<6}{row['op'] + ': ' + row['kernel']:<48}{row['ms_per_step']:>9.3f} ms"
                  for row in rows]
    return "\n".join(lines)


def _bench(sess, dtype, on_step, attention=None):
    c, shape, be = sess.config, sess.shape, sess.be
    B, T, steps, warmup = c.batch, c.seq, c.steps, c.warmup
    settings = sess.step_settings(batch=B, seq=T, dtype=dtype, recompute=c.recompute,
                                  adamw=AdamWConfig(lr=1e-4, grad_clip=c.grad_clip),
                                  graphs=c.graphs, trace=bool(c.trace))
    run = sess.runner(shape, None, settings, attention)
    run.load_state_dict(init_params(shape, 0))  # after the runner's memory check
    x, y = DataLoader(c.data, B, T, shape.V).next_batch()
    times, launch = _timed_steps(run, sess.transport, be, x, y, warmup, steps, on_step)
    out_extra = {}
    if c.trace:  # (a debug output that cannot be written never costs the result: named after)
        try:
            run.write_trace(c.trace)
        except (OSError, CupyGPTError) as e:  # (rank 0's write; the gather is done)
            out_extra["trace_error"] = str(getattr(e, "strerror", None) or e)
    if run.overlap:  # the same steps with the replicas' gradient sum after the backward
        run.set_overlap(False)
        plain = _timed_steps(run, sess.transport, be, x, y, 1, steps, on_step)[0]
        run.set_overlap(True)
        out_extra = {"ms_per_step_no_overlap": statistics.median(plain) * 1e3}
    ms = statistics.median(times) * 1e3

    peak = be.peak_flops(dtype)
    achieved = flops_per_token(shape, T) * B * T / (ms / 1e3)
    out = {**be.device_info(), "model": c.init, "B": B, "T": T, "graphs": run.graphs,
           "numerics": numerics(be, settings.dtype), "steps": steps, "warmup": warmup,
           "ms_per_step_median": ms, "ms_per_step_min": min(times) * 1e3,
           "tok_per_s": B * T / (ms / 1e3), "tflops": achieved / 1e12,
           "peak_tflops": peak / 1e12 if peak else None,  # the dtype's: TF32 or bf16
           "mfu": mfu(be, shape, T, dtype, B * T, ms / 1e3),
           "peak_memory_bytes": be.memory_in_use(), "num_parameters": shape.num_parameters(),
           "recompute": c.recompute, "dtype": dtype, "grad_clip": c.grad_clip,
           "attention": sess.attention,
           "planned_memory_bytes": run.memory, "fallbacks": be.fallbacks(),
           "grid": {"dp": sess.mesh.dp, "tp": sess.mesh.tp, "pp": sess.mesh.pp,
                    "micro_batches": c.pipeline.micro_batches, "zero": c.grid.zero,
                    "overlap": run.overlap},
           **out_extra}
    if be.asynchronous:  # the host's share of a step: elsewhere the host does all of it
        out.update(host_launch_ms_median=statistics.median(launch) * 1e3,
                   host_launch_fraction=statistics.median(launch) / statistics.median(times))
    if c.profile:  # eager steps: a graph's replay has no per-op events
        rows = be.kernel_profile(lambda: (run.gradients(x, y), run.update()), 3)
        if rows:
            out["per_op"], out["per_kernel"] = rows
    return out


def _timed_steps(run, transport, be, x, y, warmup, steps, on_step):
    """Seconds of each step after warm-up, and of its host side (launch) alone."""
    times, launch = [], []
    for i in range(warmup + steps):
        be.synchronize()
        transport.barrier()  # every rank starts the step together
        t0 = time.perf_counter()
        run.step(x, y, wait=False)
        t1 = time.perf_counter()
        be.synchronize()
        t2 = time.perf_counter()
        if i >= warmup:
            times.append(t2 - t0)
            launch.append(t1 - t0)
        if on_step:
            on_step()
    return times, launch


def claim_out(out: str, trace: str | None, overwrite: bool, writer: bool) -> None:
    """bench's --out (and --trace) checked against its input and the package, not replaced
    unasked, its directory made by the rank that writes it (writer), before the session."""
    check_outputs([("out", out), ("trace", trace)], [BenchConfig.data])
    out_file("out", out, overwrite)
    make_parent("out", out, writer, overwrite)


def trace_failed(r: dict, trace: str | None, out: str) -> None:
    """Refuses a run whose trace could not be written (its result was)."""
    failed = [x["trace_error"] for x in (r, *r.values()) if isinstance(x, dict)
              and "trace_error" in x]
    if failed:
        raise CupyGPTError(f"could not write the trace {trace} ({failed[0]}); the result "
                           f"was written: {out}")
