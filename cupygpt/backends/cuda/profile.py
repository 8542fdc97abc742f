"""kernel_profile's record: CUDA events around each public op and each kernel, cuBLAS call
and cuDNN graph inside it, while a profile runs (eager steps only: events would be
captured into a graph)."""
from __future__ import annotations

import functools
from collections.abc import Callable

import cupy as cp


def timed(f: Callable, *args, **kw) -> tuple:
    """(start, end) CUDA events around f(*args, **kw)."""
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    f(*args, **kw)
    end.record()
    return start, end


class Profiler:
    """The trace of a kernel_profile in progress, None outside one."""

    def __init__(self) -> None:
        self.trace = None  # {"op": current op, "ops": [...], "kernels": [...]}

    def traced(self, name: str, f: Callable, *args, **kw) -> None:
        """Runs f(*args, **kw), timed as kernel `name` of the current op."""
        self.trace["kernels"].append((self.trace["op"], name, *timed(f, *args, **kw)))

    def call(self, fn: Callable, *args, **kw):
        """Runs op fn; under a profile it is timed whole and the kernels inside it are
        counted as its own."""
        if self.trace is None:
            return fn(*args, **kw)
        self.trace["op"] = fn.__name__
        self.trace["ops"].append((fn.__name__, *timed(fn, *args, **kw)))

    def profile(self, step: Callable, steps: int, synchronize: Callable) -> tuple[list, list]:
        """Where the GPU time of `steps` calls of step() goes: per op and per kernel within
        each op, each cuBLAS call named "gemm_{op flags} MxNxK[xbatch]". Returns (per_op,
        per_kernel) rows."""
        self.trace = {"op": None, "ops": [], "kernels": []}
        try:
            for _ in range(steps):
                step()
            synchronize()
            ops, kernels = self.trace["ops"], self.trace["kernels"]
        finally:
            self.trace = None
        ms = lambda s, e: cp.cuda.get_elapsed_time(s, e) / steps  # noqa: E731
        per_op, per_kernel, calls = {}, {}, {}
        for op, s, e in ops:
            per_op[op] = per_op.get(op, 0.0) + ms(s, e)
        for op, kernel, s, e in kernels:
            per_kernel[op, kernel] = per_kernel.get((op, kernel), 0.0) + ms(s, e)
            calls[op, kernel] = calls.get((op, kernel), 0) + 1
        whole, inside = sum(per_op.values()), sum(per_kernel.values())
        return ([{"op": op, "ms_per_step": t, "share": t / whole}
                 for op, t in sorted(per_op.items(), key=lambda kv: -kv[1])],
                [{"op": op, "kernel": k, "calls_per_step": calls[op, k] // steps,
                  "ms_per_step": t, "share": t / inside}
                 for (op, k), t in sorted(per_kernel.items(), key=lambda kv: -kv[1])])


def op(fn: Callable) -> Callable:
    """A public op of the backend (a method): under kernel_profile it is timed whole, and
    the kernels and cuBLAS calls inside it are counted as its own."""
    @functools.wraps(fn)
    def profiled(self, *args, **kw):
        if self.profiler.trace is None:  # (outside a profile: the op alone, one call)
            return fn(self, *args, **kw)
        return self.profiler.call(fn, self, *args, **kw)
    return profiled
