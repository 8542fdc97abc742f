"""The public ops' wrapper: llm.c's mixed precision on bf16 arrays (float32 copies in,
each written array rounded back once) and kernel_profile's wall time per op."""
from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable

import numpy as np

from ...precision import BF16


def op(*writes: str, mixed: bool = True) -> Callable:
    """A public op (a method) writing the arrays named `writes` (accumulating into some).
    On bf16 arrays it runs on float32 copies and rounds each written one back once (the
    inputs are exact in float32), unless not `mixed` (it rounds for itself); under
    kernel_profile its wall time is added to its name's."""
    def wrap(fn):
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def profiled(self, *args, **kw):
            t0 = time.perf_counter()
            if mixed and any(getattr(a, "dtype", None) == BF16 for a in (*args, *kw.values())):
                _mixed(self, fn, sig.bind(self, *args, **kw), writes)  # (fp32 skips binding)
            else:
                fn(self, *args, **kw)
            if self.trace is not None:
                self.trace[fn.__name__] = (self.trace.get(fn.__name__, 0.0)
                                           + time.perf_counter() - t0)
        return profiled
    return wrap


def _mixed(be, fn, bound, writes):
    narrow = {k: a for k, a in bound.arguments.items()
              if isinstance(a, np.ndarray) and a.dtype == BF16}
    for k, a in narrow.items():
        bound.arguments[k] = a.astype(np.float32)
    be.narrow = True
    try:
        fn(*bound.args, **bound.kwargs)
    finally:
        be.narrow = False
    for k in writes:
        if k in narrow:
            narrow[k][...] = bound.arguments[k]
