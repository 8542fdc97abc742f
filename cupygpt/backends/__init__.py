"""Backends: one module each, the same functions with the same signatures.

Conventions every backend keeps (the model relies on them):
- arrays are the backend's own (numpy.ndarray / cupy.ndarray), C-contiguous views into
  the flat buffers; shapes are written next to each function;
- forward functions overwrite their outputs;
- backward functions overwrite the input gradient of a matmul, GELU, attention, and
  accumulate (+=) into every parameter gradient and into layernorm's and the encoder's
  input gradients, so the residual stream's gradient and micro-batch gradients add up.
"""
import importlib

from .. import CupyGPTError


def gpu_available():
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def get_backend(name):
    """name: numpy | cuda | auto. Returns (module, sentence saying what was chosen and why)."""
    if name == "auto":
        name = "cuda" if gpu_available() else "numpy"
        why = "a GPU is visible" if name == "cuda" else "no GPU is visible (CPU run)"
        return importlib.import_module(f".{name}_backend", __name__), f"backend {name}: {why}"
    if name == "cuda" and not gpu_available():
        raise CupyGPTError("--backend cuda: no GPU is visible (or CuPy is not installed: "
                           "pip install '.[cuda12]' or '.[cuda13]'); use --backend numpy")
    if name not in ("numpy", "cuda"):
        raise CupyGPTError(f"--backend {name}: unknown; use auto, cuda or numpy")
    return importlib.import_module(f".{name}_backend", __name__), f"backend {name}: as asked"
