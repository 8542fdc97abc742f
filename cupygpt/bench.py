"""`bench`: throughput, MFU, memory and where the time goes, for one GPU (or the CPU)."""
import statistics
import time

from .config import preset
from .data import DataLoader
from .model import init_params
from .optim import AdamWConfig

# Dense (no sparsity) TF32 tensor-core peak, TFLOP/s, from NVIDIA's data sheets.
TF32_PEAK = {"H100 SXM": 494.7, "H100 NVL": 417.5, "H100 PCIe": 378.0, "H100": 494.7,
             "H200": 494.7, "A100": 156.0, "L40S": 183.0}


def peak_tflops(device_name):
    for key, v in TF32_PEAK.items():  # most specific first
        if key in device_name:
            return v
    return None


def flops_per_token(cfg, T):
    """llm.c's estimate: 6N for the weights plus 6*L*C*T for attention."""
    return 6 * cfg.num_parameters() + 6 * cfg.L * cfg.C * T


def device_info(be):
    if be.name != "cuda":
        import platform
        return {"device": platform.processor() or platform.machine(), "backend": "numpy"}
    import cupy as cp
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    return {"device": props["name"].decode(), "backend": "cuda", "cupy": cp.__version__,
            "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(),
            "driver": cp.cuda.runtime.driverGetVersion()}


def profile_ops(be, run, x, y, steps):
    """Where a step's GPU time goes, over eager steps: per op (CUDA events around each
    backend call) and per kernel within each op (the backend's kernel trace)."""
    import cupy as cp
    ops = ["encoder_forward", "layernorm_forward", "matmul_forward", "attention_forward",
           "gelu_forward", "residual_forward", "classifier", "encoder_backward",
           "layernorm_backward", "matmul_backward", "attention_backward", "gelu_backward",
           "adamw", "loss_accumulate"]
    saved, events, kernels = {op: getattr(be, op) for op in ops}, [], []

    def timed(op, fn):
        def call(*a, **kw):
            s, e, first = cp.cuda.Event(), cp.cuda.Event(), len(trace)
            s.record()
            fn(*a, **kw)
            e.record()
            events.append((op, s, e))
            kernels.extend((op, *k) for k in trace[first:])
        return call

    for op, fn in saved.items():
        setattr(be, op, timed(op, fn))
    try:
        with be.kernel_trace() as trace:
            for _ in range(steps):
                run.gradients(x, y)
                run.opt.step()
            be.synchronize()
    finally:
        for op, fn in saved.items():
            setattr(be, op, fn)
    per_op, per_kernel, calls = {}, {}, {}
    for op, s, e in events:
        per_op[op] = per_op.get(op, 0.0) + cp.cuda.get_elapsed_time(s, e) / steps
    for op, name, s, e in kernels:
        per_kernel[op, name] = per_kernel.get((op, name), 0.0) + cp.cuda.get_elapsed_time(s, e) / steps
        calls[op, name] = calls.get((op, name), 0) + 1
    whole, inside = sum(per_op.values()), sum(per_kernel.values())
    return ([{"op": op, "ms_per_step": ms, "share": ms / whole}
             for op, ms in sorted(per_op.items(), key=lambda kv: -kv[1])],
            [{"op": op, "kernel": name, "calls_per_step": calls[op, name] // steps,
              "ms_per_step": ms, "share": ms / inside}
             for (op, name), ms in sorted(per_kernel.items(), key=lambda kv: -kv[1])])


def bench(sess, init, B, T, steps, warmup, graphs, profile, data):
    cfg = preset(init)
    run = sess.runner(cfg, init_params(cfg, 0), B, T, adamw=AdamWConfig(lr=1e-4),
                      graphs=graphs)
    x, y = DataLoader(data, B, T, cfg.V).next_batch()
    be = sess.be
    times, launch = [], []
    for i in range(warmup + steps):
        be.synchronize()
        t0 = time.perf_counter()
        if run.graphs and run.steps_done > 0:
            run.launch_graph_step(x, y)
        else:
            run.train_step(x, y)
        t1 = time.perf_counter()
        be.synchronize()
        t2 = time.perf_counter()
        if i >= warmup:
            times.append(t2 - t0)
            launch.append(t1 - t0)
    ms = statistics.median(times) * 1e3
    info = device_info(be)
    peak = peak_tflops(info["device"]) if be.name == "cuda" else None
    achieved = flops_per_token(cfg, T) * B * T / (ms / 1e3) / 1e12
    out = {**info, "model": init, "B": B, "T": T, "graphs": run.graphs, "tf32": bool(
        getattr(be, "tf32", False)), "steps": steps, "warmup": warmup,
        "ms_per_step_median": ms, "ms_per_step_min": min(times) * 1e3,
        "tok_per_s": B * T / (ms / 1e3), "tflops": achieved,
        "tf32_peak_tflops": peak, "mfu": achieved / peak if peak else None,
        "host_launch_ms_median": statistics.median(launch) * 1e3,
        "host_launch_fraction": statistics.median(launch) / statistics.median(times),
        "peak_memory_bytes": be.memory_in_use(), "num_parameters": cfg.num_parameters()}
    if profile and be.name == "cuda":
        out["per_op"], out["per_kernel"] = profile_ops(be, run, x, y, 3)
    return out
