"""The flash kernels' tile loop read from their sm_90 SASS (NVRTC and cuobjdump, compiled
as tests/unit/backends/test_kernels_compile.py compiles them, whose SASS readers this
uses), per kernel: ptxas's registers, the launch's shared memory, the blocks per SM they
leave, and per walked tile and warp the instructions on the common path (the 16-byte
cp.async copies and the unmasked softmax; the misaligned views' element-wise copies and
the masked variant left out), of which the copies' (the runs holding a cp.async or a 16-byte load),
and the HMMA, LDSM and MUFU.EX2 among them.
model_h200.py's FLASH["now"] is this tool's output for d12's kernels (head size 64,
bf16); tests/dev/test_gpumodel.py checks it still is.

    python -m dev.gpumodel.flash_sass [HEAD_SIZE] [bf16|fp32]
"""
import importlib.util
import os
import re
import subprocess
import sys
import tempfile

from cupygpt.backends.cuda.kernels import (
    GEOMETRY,
    KERNEL_DIR,
    flash_cols,
    flash_smem_bytes,
    nvrtc_compile,
    options,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _compile_test():
    """tests/unit/backends/test_kernels_compile.py, whose SASS readers this uses: loaded by
    its path (tests is no package), so sys.path stays as it was; pytest's own copy where it
    has one."""
    if "test_kernels_compile" in sys.modules:
        return sys.modules["test_kernels_compile"]
    path = os.path.join(ROOT, "tests", "unit", "backends", "test_kernels_compile.py")
    spec = importlib.util.spec_from_file_location("test_kernels_compile", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_tkc = _compile_test()
ptxas_report, sass, sass_ops = _tkc.ptxas_report, _tkc.sass, _tkc.sass_ops
tile_loop = _tkc.tile_loop

SMEM_PER_SM, REGS_PER_SM, BLOCKS_PER_SM = 228 * 1024, 65536, 32  # sm_90
SMEM_RESERVED = 1024                                             # per block


def tool_versions():
    """{"nvrtc": ..., "cuobjdump": ...}: the versions that compile and read the SASS (exact
    counts change with them): the nvidia-cuda-nvrtc wheel's (else NVRTC's major.minor), and
    the V of cuobjdump --version; None for one not installed."""
    import importlib.metadata
    out = {"nvrtc": None, "cuobjdump": None}
    try:
        out["nvrtc"] = importlib.metadata.version("nvidia-cuda-nvrtc")
    except importlib.metadata.PackageNotFoundError:
        try:
            from cuda.bindings import nvrtc
            out["nvrtc"] = "%d.%d" % nvrtc.nvrtcVersion()[1:]
        except ImportError:
            pass
    tool = _tkc.cuobjdump()
    if tool:
        text = subprocess.run([tool, "--version"], capture_output=True, text=True).stdout
        found = re.search(r"\bV(\d+\.\d+\.\d+)", text)
        out["cuobjdump"] = found.group(1) if found else None
    return out


def blocks_per_sm(regs, smem):
    """Resident blocks of FLASH_WARPS warps: registers (allocated 8 a thread at a time),
    shared memory, and the SM's block slots."""
    threads = 32 * GEOMETRY["FLASH_WARPS"]
    return min(REGS_PER_SM // (-(-regs // 8) * 8 * threads),
               SMEM_PER_SM // (smem + SMEM_RESERVED), BLOCKS_PER_SM)


def runs(loop):
    """The loop's straight runs of instructions: each ends at a branch or convergence
    barrier, or before a branch target."""
    targets = {int(t, 16) for _, op in loop for t in re.findall(r"\bBRA\b.*0x([0-9a-f]+)", op)}
    out, cur = [], []
    for a, op in loop:
        if a in targets and cur:
            out.append(cur)
            cur = []
        cur.append(op)
        if re.search(r"\b(BRA|BSSY|BSYNC)\b", op):
            out.append(cur)
            cur = []
    return out + [cur]


def tile_stats(body, cols):
    """{instr, copy, hmma, ldsm, exp2} per tile and warp on the common path of a kernel's tile
    loop: runs with an element-wise global load (the misaligned path) dropped, and of the
    softmax's masked and unmasked variants (runs of 16 exponentials or more: a chunk of
    32 columns or the whole tile, cols / 2 exponentials a tile) the shorter of each pair."""
    kept = [r for r in runs(tile_loop(sass_ops(body)))
            if not any(re.search(r"LDG\.E(?!\.128)", op) for op in r)]
    exps = [sum("MUFU.EX2" in op for op in r) for r in kept]
    soft = sorted((r for r, e in zip(kept, exps) if e >= 16), key=len)
    pairs = max(1, cols // 2 // min((e for e in exps if e >= 16), default=cols))
    kept = [r for r in kept if not any(r is s for s in soft[pairs:])]
    ops = [op for r in kept for op in r]
    loads = [r for r in kept if any(re.search(r"LDGSTS|LDG\.E\.128", o) for o in r)]
    return {"instr": len(ops), "copy": sum(map(len, loads)),
            "hmma": sum("HMMA" in o for o in ops), "ldsm": sum("LDSM" in o for o in ops),
            "exp2": sum("MUFU.EX2" in o for o in ops)}


def flash_table(head_size=64, dtype="bf16"):
    """{kind: {regs, smem, occ, cols, instr, copy, hmma, ldsm, exp2}} of
    flash_{kind}_{head_size}."""
    x = 2 if dtype == "bf16" else 4
    log, cubin = nvrtc_compile(os.path.join(KERNEL_DIR, "flash_attention.cu"), "sm_90",
                               options(dtype) + ("--ptxas-options=-v",), cubin=True)
    regs = ptxas_report(log)
    with tempfile.TemporaryDirectory() as tmp:
        import pathlib
        kernels = sass(cubin, pathlib.Path(tmp))
    out = {}
    for kind in ("forward", "dq", "dkdv"):
        name, cols = f"flash_{kind}_{head_size}", flash_cols(head_size, x)
        smem = flash_smem_bytes(kind, head_size, x, False)
        out[kind] = {"regs": regs[name][0], "smem": smem, "occ": blocks_per_sm(regs[name][0], smem),
                     "cols": cols, **tile_stats(kernels[name], cols)}
    return out


if __name__ == "__main__":
    hs = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    for kind, row in flash_table(hs, sys.argv[2] if len(sys.argv) > 2 else "bf16").items():
        print(f"{kind:8s} " + " ".join(f"{k} {v}" for k, v in row.items()))
