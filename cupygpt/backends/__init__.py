"""Backends: one module each, the same functions with the same signatures
(tests/unit/backends/test_backend_contract.py).

Conventions every backend keeps (the model relies on them):
- arrays are the backend's own (numpy.ndarray / cupy.ndarray), C-contiguous views into
  the flat buffers; shapes are written next to each function;
- forward functions overwrite their outputs; a bias is added by the matmul that makes the
  product (matmul_forward's bias, rounded once with it), never by the op that reads it;
- backward functions overwrite the input gradient of a matmul, GELU, attention, and
  accumulate (+=) into every parameter gradient and into layernorm's and the encoder's
  input gradients, so the residual stream's gradient and micro-batch gradients add up.

Nothing outside this package asks which backend runs; it asks a capability instead:
- name, for messages only; DTYPES, the float types it computes in (precision.py), and
  DEFAULT_DTYPE, the name of the one a run takes when --dtype is not given; TRANSPORTS, the
  transports its arrays can travel by, preferred first; DEFAULT_RUN, (-e, -t) when the
  user gives none;
- supports_graphs: a step can be captured and replayed (capture, replay, adamw_schedule);
  asynchronous: calls return before the device is done (so host launch time means something);
- configure(tf32, device_of, ranks_here), device_memory() (free bytes where it allocates:
  the GPU's, or the host's), memory_domain() (ranks with equal answers share that memory;
  its name in memory_name), workspace_bytes(shape, batch, seq, part, dtype) (the most its
  kept workspaces reach for such a stage),
  memory_in_use(), numerics() (verify's tolerance row in fp32), peak_flops(dtype) (a run
  dtype's dense peak; None: no MFU),
  device_info(), device_name() (the run table's name of this rank's device), kernel_profile(step, steps) (per-op and per-kernel time, None: none),
  attention_refuses(head_size, dtype=None) (why it cannot run such attention heads, in
  dtype when given, or None),
  fused_attention_refuses(dtype, head_size) (why a library's fused attention, cuDNN's,
  cannot run such a run here, or None) and use_attention(kind, backward, replay) (which
  attention the attention ops take from now on: "cudnn" or "own", --attention resolves
  it; and what the run asks of it: a backward, a captured step replayed; the memory plan
  prepares that much, and raises FusedAttentionUnsupported where the library will not
  run it),
  fallbacks() (what it ran a slower way than planned, and why: one line each).
"""
from __future__ import annotations

import importlib
from types import ModuleType

from .. import CupyGPTError


class FusedAttentionUnsupported(CupyGPTError):
    """A library's fused attention will not run this run's shape (its own verdict, met
    while the memory plan prepares it): --attention auto falls back to the own kernels,
    --attention cudnn refuses (session.Session.runner)."""


def gpu_available() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def get_backend(name: str) -> tuple[ModuleType, str]:
    """name: numpy | cuda | auto. Returns (module, sentence saying what was chosen and why)."""
    if name == "auto":
        name = "cuda" if gpu_available() else "numpy"
        why = "a GPU is visible" if name == "cuda" else "no GPU is visible (CPU run)"
        return importlib.import_module(f".{name}_backend", __name__), f"backend {name}: {why}"
    if name == "cuda" and not gpu_available():
        raise CupyGPTError("no GPU is visible (or CuPy is not installed: pip install "
                           "'.[cuda12]' or '.[cuda13]'); use the numpy backend", "backend", name)
    if name not in ("numpy", "cuda"):
        raise CupyGPTError("unknown; use auto, cuda or numpy", "backend", name)
    return importlib.import_module(f".{name}_backend", __name__), f"backend {name}: as asked"
