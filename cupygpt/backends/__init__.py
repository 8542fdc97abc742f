"""Backends: numpy/ (the reference, on the CPU) and cuda/ (CuPy, our kernels, cuBLASLt,
cuDNN), each a class whose one object holds all it keeps. protocol.py is the interface
they share, and the conventions every backend keeps.

Nothing outside this package asks which backend runs; it asks a capability instead
(protocol.Backend lists them).
"""
from __future__ import annotations

import importlib

from .. import CupyGPTError
from .protocol import Backend


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


def get_backend(name: str) -> tuple[Backend, str]:
    """name: numpy | cuda | auto. Returns (a new backend of that name, a sentence saying what
    was chosen and why)."""
    if name == "auto":
        name = "cuda" if gpu_available() else "numpy"
        why = "a GPU is visible" if name == "cuda" else "no GPU is visible (CPU run)"
        return make_backend(name), f"backend {name}: {why}"
    if name == "cuda" and not gpu_available():
        raise CupyGPTError("no GPU is visible (or CuPy is not installed: pip install "
                           "'.[cuda12]' or '.[cuda13]'); use the numpy backend", "backend", name)
    if name not in ("numpy", "cuda"):
        raise CupyGPTError("unknown; use auto, cuda or numpy", "backend", name)
    return make_backend(name), f"backend {name}: as asked"


def make_backend(name: str) -> Backend:
    """A new backend: numpy's NumpyBackend or cuda's CudaBackend (imported only here: the
    numpy backend runs without CuPy)."""
    module = importlib.import_module(f".{name}.backend", __name__)
    return module.CudaBackend() if name == "cuda" else module.NumpyBackend()
