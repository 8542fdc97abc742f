"""What a run's --dtype means: the names, bf16 (ml_dtypes' bfloat16, the type CuPy and
the NumPy reference share), the wider type each dtype keeps its statistics and optimizer
state in, and the stochastic rounding of bf16 weights (the NumPy reference of the CUDA
kernel's, bit for bit).

bf16 runs as llm.c's mainline trainer: parameters, activations and gradients in bf16;
every op reads bf16, computes in fp32 and rounds its outputs to the nearest bf16 once; the
layernorm statistics, the losses and the softmax in fp32; AdamW's m, v and the master
weights in fp32, the updated weights rounded to bf16 stochastically.
"""
import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"fp32": np.dtype(np.float32), "bf16": BF16, "fp64": np.dtype(np.float64)}


def dtype_name(dtype):
    return next(k for k, v in DTYPES.items() if v == np.dtype(dtype))


def wide(dtype):
    """The type a run of dtype keeps statistics, losses and AdamW's state in: fp32 for
    bf16, the dtype itself otherwise."""
    return np.dtype(np.float32) if np.dtype(dtype) == BF16 else np.dtype(dtype)


def numerics(be, dtype):
    """Which arithmetic a run is (verify's tolerance row, bench's label): the backend's
    own in fp32/fp64, "<backend>-bf16" in bf16."""
    return f"{be.name}-bf16" if np.dtype(dtype) == BF16 else be.numerics()


def is_narrow(dtype):
    """Whether a run of dtype keeps fp32 master weights (its parameters are rounded)."""
    return np.dtype(dtype) != wide(dtype)


MASK = 0xFFFFFFFF


def noise(index, seed):
    """A 32-bit hash of (element index, step seed), uint32 arithmetic as the kernel's (its
    constants are a well-mixing integer hash's)."""
    with np.errstate(over="ignore"):
        h = (np.asarray(index, np.uint32) * np.uint32(0x9E3779B1)) ^ np.uint32(seed & MASK)
        h ^= h >> np.uint32(16)
        h *= np.uint32(0x21F0AAAD)
        h ^= h >> np.uint32(15)
        h *= np.uint32(0x735A2D97)
        h ^= h >> np.uint32(15)
    return h


def step_seed(t, salt):
    """The rounding seed of AdamW step t on a stage (salt: which stage), the same on every
    run, so a resumed run rounds as the run it continues."""
    return int(noise(np.uint32(t & MASK), salt))


def stochastic_round(x, seed, offset):
    """x (fp32) to bf16, rounded up with probability the distance to the lower bf16 over the
    gap: 16 random bits (noise of each element's index offset + i) are added below the
    ones bf16 keeps, then those are cut off. NaN stays NaN."""
    x = np.ascontiguousarray(x, np.float32)
    bits = x.view(np.uint32).astype(np.uint64)
    r = noise(np.arange(offset, offset + x.size, dtype=np.uint64) & MASK, seed) & 0xFFFF
    out = ((bits + r) >> 16).astype(np.uint16)
    out = np.where(np.isnan(x), (bits >> 16).astype(np.uint16) | 0x40, out)
    return out.view(BF16)
