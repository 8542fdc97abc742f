"""Where the CUDA C sources are, how they are compiled and the launch geometry they share
with the backend (used by the backend and the compile test, so CI compiles exactly what
the GPU runs; and by cudasim's CuPy, so it imports no CuPy).

Options, chosen deliberately:
- no --use_fast_math: the non-matmul kernels are memory-bound, so fast intrinsics buy
  little, and exact expf/tanhf/sqrtf keep `verify --backend cuda` close to PyTorch;
- -std=c++17, -I cupygpt/backends/kernels_cu (common.cuh), -D for each GEOMETRY value, and
  -DfloatX=: each file is compiled once per storage type (float, __nv_bfloat16);
- the architecture is the running GPU's (CuPy picks it); the compile test builds for
  compute_80 (A100) and compute_90 (H100/H200).
CuPy caches each compiled module on disk (~/.cupy/kernel_cache), so a process compiles
a module once and later processes load it from the cache.
"""
from __future__ import annotations

import glob
import os
import re
from types import MappingProxyType

# package data: the wheel carries them, and the repository's kernels_cu/ links here
KERNEL_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "kernels_cu")
# Launch geometry, defined here only: the backend launches with these values and the
# kernels are compiled with them (-D), so the two cannot disagree. common.cuh refuses to
# compile a kernel without them.
GEOMETRY = MappingProxyType({
    "WARP": 32,           # threads per warp
    "EW_THREADS": 256,    # elementwise kernels: threads per block, one element each
    "ROW_WARPS": 8,       # row kernels (layernorm, softmax): warps per block, a row each
    "CLS_THREADS": 1024,  # classifier kernels and loss_accumulate: threads per block
    "COL_TILE": 32,       # column sums: threads across a block's columns (16 bytes each)
    "ROW_LANES": 8,       # column sums: threads down the rows of each column
    "FLASH_WARPS": 4,     # flash attention: warps per block, 16 rows (queries or keys) each
    "FLASH_COLS": 64,     # flash attention: columns (keys or queries) per tile walked, at most
    "SORT_KEYS": 1024,    # the embedding's gradient: positions a block sorts in shared memory
})
# The head sizes flash attention is built for (a kernel per size): a head of HS (a
# multiple of 8, at most the last) runs in the smallest one >= HS.
FLASH_HEAD_SIZES = (16, 32, 64, 96, 128)


def flash_cols(head_size: int, itemsize: int) -> int:
    """Columns per walked tile of flash_*_{head_size} (flash_attention.cu's cols()):
    FLASH_COLS for bf16 heads up to 64, half that above (the accumulators of 128 dimensions
    leave no registers for 64-wide tiles) and in fp32 (shared memory)."""
    cols = GEOMETRY["FLASH_COLS"]
    return cols if itemsize == 2 and head_size <= 64 else cols // 2


# fp32 heads double-buffer up to this size (-DFLASH_FP32_DOUBLED): above 96, two buffers
# would leave room for one block per SM. A device whose per-block shared memory opt-in is
# smaller (99 KiB on sm_86/89/120) gets a smaller value (flash_fp32_doubled).
FLASH_FP32_DOUBLED = 96


def flash_stages(head_size: int, itemsize: int, doubled: int = FLASH_FP32_DOUBLED) -> int:
    """Buffers per walked tile (flash_attention.cu's stages()): 2, the next tile copied while
    this one computes; 1 for fp32 heads above doubled."""
    return 1 if itemsize == 4 and head_size > doubled else 2


def flash_smem_bytes(kind: str, head_size: int, itemsize: int, fma: bool,
                     doubled: int = FLASH_FP32_DOUBLED) -> int:
    """Dynamic shared memory of flash_{kind}_{head_size} (flash_attention.cu's check_launch,
    which checks it was given this much): its own tiles of 16 * FLASH_WARPS rows (forward
    1, dq and dkdv 2) and flash_stages buffers of each of its two walked tiles, each row
    padded by 16 bytes; dkdv's walked lse and D (as many buffers); with fma (fp32 without
    TF32), each warp's 16 operand rows."""
    warps = GEOMETRY["FLASH_WARPS"]
    cols, stages = flash_cols(head_size, itemsize), flash_stages(head_size, itemsize, doubled)
    own = 1 if kind == "forward" else 2
    n = (own * 16 * warps + 2 * stages * cols) * (head_size + 16 // itemsize) * itemsize
    n += 4 * 2 * stages * cols if kind == "dkdv" else 0
    return n + (4 * warps * 16 * (cols + 4) if fma else 0)


def flash_fp32_doubled(optin: int) -> int:
    """The FLASH_FP32_DOUBLED a device with optin bytes of shared memory per block builds
    with: the largest head size, at most the default, whose fp32 kernels (the FMA path, the
    larger) all fit two buffers; the sizes above it take one."""
    fits = [hs for hs in FLASH_HEAD_SIZES if hs <= FLASH_FP32_DOUBLED and
            all(flash_smem_bytes(k, hs, 4, True, hs) <= optin for k in ("forward", "dq", "dkdv"))]
    return max(fits, default=0)


OPTIONS = ("-std=c++17", f"-I{KERNEL_DIR}", *(f"-D{k}={v}" for k, v in GEOMETRY.items()))
FLOATX = MappingProxyType({"fp32": "float", "bf16": "__nv_bfloat16"})  # each run dtype's C type


def cuda_headers() -> tuple[str, ...]:
    """-I of the CUDA headers (common.cuh includes cuda_bf16.h, and NVRTC has no include
    path of its own): the toolkit's, or the nvidia-cuda-runtime wheel's, as cuda.pathfinder
    finds them; none when it finds none (cudasim brings its own)."""
    try:
        from cuda.pathfinder import find_nvidia_header_directory
        found = find_nvidia_header_directory("cudart")
    except Exception:  # (not installed: no CUDA here)
        return ()
    return (f"-I{found}",) if found else ()


def options(dtype: str, doubled: int = FLASH_FP32_DOUBLED) -> tuple[str, ...]:
    """The compile options of the kernels storing dtype ("fp32" or "bf16"), fp32's flash
    heads double-buffered up to doubled (flash_fp32_doubled)."""
    return OPTIONS + cuda_headers() + (f"-DfloatX={FLOATX[dtype]}",
                                       f"-DFLASH_FP32_DOUBLED={doubled}")


def sources() -> list[str]:
    return sorted(glob.glob(os.path.join(KERNEL_DIR, "*.cu")))


def kernels_in(src: str) -> dict[str, str]:
    """{name: parameter list as written} for each extern "C" kernel in CUDA C source (its
    __launch_bounds__ or a macro standing for them, if any, skipped), the invocations of a
    macro that declares kernels (flash attention's, per head size) written out first."""
    return dict(re.findall(r'extern "C" __global__ void\s+(?:__launch_bounds__\([^)]*\)\s+|'
                           r'[A-Z_]+\s+)?(\w+)\(([^)]*)\)', expand_kernel_macros(src)))


def expand_kernel_macros(src):
    """src with each invocation of a function-like #define whose body declares extern "C"
    kernels replaced by that body, its parameters substituted (## pasted), as the
    preprocessor would: the kernels' names and parameter lists as compiled."""
    define = r"#define (\w+)\(([\w, ]+)\)((?:[^\n]*\\\n)*[^\n]*)"
    macros = {name: ([p.strip() for p in params.split(",")], body.replace("\\\n", " "))
              for name, params, body in re.findall(define, src) if 'extern "C"' in body}

    def written_out(m):
        params, body = macros[m.group(1)]
        for p, arg in zip(params, m.group(2).split(",")):
            body = re.sub(rf"\s*##\s*{p}\b|\b{p}\b", arg.strip(), body)
        return body
    if not macros:
        return src
    src = re.sub(define, lambda m: "" if m.group(1) in macros else m.group(0), src)
    return re.sub(rf"^({'|'.join(macros)})\(([^)]*)\)", written_out, src, flags=re.M)


def nvrtc_compile(path: str, arch: str, opts: tuple | None = None, cubin: bool = False):
    """Compiles one .cu file with NVRTC for arch (e.g. "compute_90", or "sm_90": through
    ptxas) and opts (default: fp32's options); returns the log (with cubin: the log and the
    cubin's bytes for an sm_ arch, the PTX's for a compute_ one) and raises RuntimeError
    with it on failure."""
    opts = options("fp32") if opts is None else opts
    from cuda.bindings import nvrtc
    src = open(path, "rb").read()
    _, prog = nvrtc.nvrtcCreateProgram(src, os.path.basename(path).encode(), 0, [], [])
    opts = [f"-arch={arch}".encode()] + [o.encode() for o in opts]
    (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    _, n = nvrtc.nvrtcGetProgramLogSize(prog)
    log = b" " * n
    nvrtc.nvrtcGetProgramLog(prog, log)
    code = None
    if cubin and err == nvrtc.nvrtcResult.NVRTC_SUCCESS:
        size, get = ((nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN) if arch.startswith("sm_")
                     else (nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX))
        code = b" " * size(prog)[1]
        get(prog, code)
    nvrtc.nvrtcDestroyProgram(prog)
    log = log.decode(errors="replace").strip("\x00 \n")
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"{os.path.basename(path)} ({arch}): {log}")
    return (log, code) if cubin else log
