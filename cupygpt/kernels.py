"""Where the CUDA C sources are and how they are compiled (shared by the backend and the
compile test, so CI compiles exactly what the GPU runs).

Options, chosen deliberately:
- no --use_fast_math: the non-matmul kernels are memory-bound, so fast intrinsics buy
  little, and exact expf/tanhf/sqrtf keep `verify --backend cuda` close to PyTorch;
- -std=c++17, -I cupygpt/kernels_cu (common.cuh);
- the architecture is the running GPU's (CuPy picks it); the compile test builds for
  compute_80 (A100) and compute_90 (H100/H200).
CuPy caches each compiled module on disk (~/.cupy/kernel_cache), so a process compiles
a module once and later processes load it from the cache.
"""
import glob
import os
import re

# package data: the wheel carries them, and the repository's kernels_cu/ links here
KERNEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels_cu")
OPTIONS = ("-std=c++17", f"-I{KERNEL_DIR}")


def sources():
    return sorted(glob.glob(os.path.join(KERNEL_DIR, "*.cu")))


def kernels_in(src):
    """{name: parameter list as written} for each extern "C" kernel in CUDA C source."""
    return dict(re.findall(r'extern "C" __global__ void (\w+)\(([^)]*)\)', src))


def nvrtc_compile(path, arch):
    """Compiles one .cu file with NVRTC for arch (e.g. "compute_90"); returns the log and
    raises RuntimeError with it on failure."""
    from cuda.bindings import nvrtc
    src = open(path, "rb").read()
    _, prog = nvrtc.nvrtcCreateProgram(src, os.path.basename(path).encode(), 0, [], [])
    opts = [f"-arch={arch}".encode()] + [o.encode() for o in OPTIONS]
    (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    _, n = nvrtc.nvrtcGetProgramLogSize(prog)
    log = b" " * n
    nvrtc.nvrtcGetProgramLog(prog, log)
    nvrtc.nvrtcDestroyProgram(prog)
    log = log.decode(errors="replace").strip("\x00 \n")
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"{os.path.basename(path)} ({arch}): {log}")
    return log
