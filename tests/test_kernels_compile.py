"""Every kernels_cu/*.cu compiles, with the backend's own options, for sm_80 and sm_90 —
through NVRTC (what CuPy uses on the GPU) down to the GPU's code, and through nvcc where it
is installed: ptxas (-v) spills nothing, flash attention leaves room for two blocks per SM,
and the bulk kernels' SASS has 16-byte global accesses. Runs without a GPU, so a broken or
slowed kernel cannot land."""
import glob
import os
import re
import shutil
import subprocess

import pytest

from cupygpt.kernels import (FLOATX, GEOMETRY, KERNEL_DIR, OPTIONS, flash_smem_bytes, kernels_in,
                             nvrtc_compile, options, sources)

ARCHS = ("compute_80", "compute_90")
SM = {"sm_80": 164 * 1024, "sm_90": 228 * 1024}  # shared memory per SM (A100, H100)
REGISTERS_PER_SM = 65536


def have_nvrtc():
    try:
        nvrtc_compile(sources()[0], ARCHS[0])
        return True
    except Exception:
        return False


def ptxas_report(log):
    """{kernel: (registers, spill bytes stored + loaded)} from ptxas's -v lines."""
    out = {}
    for name, body in re.findall(r"Compiling entry function '(\w+)'(.*?)(?=Compiling entry|\Z)",
                                 log, re.S):
        spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", body)
        regs = re.search(r"Used (\d+) registers", body)
        out[name] = (int(regs.group(1)), int(spills.group(1)) + int(spills.group(2)))
    return out


@pytest.mark.skipif(not have_nvrtc() and not os.environ.get("CI"),
                    reason="NVRTC not installed (pip install -e '.[test]')")
@pytest.mark.parametrize("dtype", FLOATX)
@pytest.mark.parametrize("arch", SM)
@pytest.mark.parametrize("path", sources(), ids=os.path.basename)
def test_nvrtc_compiles(tmp_path, path, arch, dtype):
    """To the GPU's code, with no register spills; flash attention's kernels leave room for
    two blocks per SM (registers, and the dynamic shared memory the backend launches them
    with; an fp32 head above 64 only on the H100); on sm_90 the WIDE_ACCESSES kernels'
    SASS holds LDG.E.128 (and STG.E.128), and bf16 flash attention reads its tensor-core
    operands from shared memory with ldmatrix (LDSM), no 2-byte loads."""
    log, cubin = nvrtc_compile(path, arch, options(dtype) + ("--ptxas-options=-v",), cubin=True)
    report = ptxas_report(log)
    assert report, "ptxas reported no kernel"
    assert not {k: r for k, r in report.items() if r[1]}, "register spills"
    threads = 32 * GEOMETRY["FLASH_WARPS"]
    for name, (regs, _) in report.items():
        if not name.startswith("flash_"):
            continue
        kind, hs = name[len("flash_"):].rsplit("_", 1)
        x = 2 if dtype == "bf16" else 4
        smem = flash_smem_bytes(kind, int(hs), x, x == 4)
        assert 2 * regs * threads <= REGISTERS_PER_SM, (name, regs)
        if arch == "sm_90" or dtype == "bf16" or int(hs) <= 64:
            assert 2 * (smem + 1024) <= SM[arch], (name, smem)  # (1 KiB reserved per block)
    if arch == "sm_90" and cuobjdump():
        kernels = sass(cubin, tmp_path)
        marks = sass_marks(kernels)
        for fn, wanted in WIDE_ACCESSES.items():
            if fn in report:
                assert all(c in marks[fn] for c in wanted), (fn, marks[fn])
        for fn, least in LOADS_IN_FLIGHT.items():
            if fn in report:
                assert loads_in_flight(kernels[fn]) >= least, (fn, loads_in_flight(kernels[fn]))
        for fn in report:  # bf16 tensor-core operands come through ldmatrix, never 2 bytes
            if fn.startswith("flash_") and dtype == "bf16":
                assert "M" in marks[fn] and "H" not in marks[fn], (fn, marks[fn])


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("arch", ("sm_80", "sm_90"))
def test_nvcc_compiles(tmp_path, arch):
    # every file at once, an nvcc each: one nvcc keeps one core busy, so the cores share them
    runs = {path: subprocess.Popen(["nvcc", f"-arch={arch}", *options("bf16"), "-c", path, "-o",
                                    str(tmp_path / (os.path.basename(path) + ".o"))],
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for path in sources()}
    outs = {path: run.communicate()[0] for path, run in runs.items()}
    for path, run in runs.items():
        assert run.returncode == 0, f"{os.path.basename(path)}: {outs[path]}"


def test_a_broken_kernel_is_caught(tmp_path):
    if not have_nvrtc():
        pytest.skip("NVRTC not installed")
    bad = tmp_path / "bad.cu"
    bad.write_text('#include "common.cuh"\nextern "C" __global__ void k(float* x) { x[0] = y; }\n')
    with pytest.raises(RuntimeError, match="bad.cu"):
        nvrtc_compile(str(bad), ARCHS[1])


def test_a_kernel_without_the_launch_geometry_is_refused():
    """common.cuh holds no launch geometry of its own: compiled without kernels.py's -D
    options, a kernel stops at its #error rather than building with other values."""
    if not have_nvrtc():
        pytest.skip("NVRTC not installed")
    bare = tuple(o for o in OPTIONS if not o.startswith("-D"))
    with pytest.raises(RuntimeError, match="launch geometry not defined"):
        nvrtc_compile(sources()[0], ARCHS[1], bare)


def test_every_backend_kernel_exists():
    """Each kernel name the CUDA backend launches is defined in kernels_cu."""
    src = open(os.path.join(os.path.dirname(KERNEL_DIR), "backends", "cuda_backend.py")).read()
    used = set(re.findall(r'_(?:ew|rows|launch)\("(\w+)"', src))
    whole = set(re.findall(r'_whole_packs\("(\w+)"', src))  # and their aligned _v entries
    used |= whole | {n + "_v" for n in whole}
    defined = set()
    for path in sources():
        defined |= set(kernels_in(open(path).read()))
    assert used and used <= defined, used - defined


# The kernels that move the bulk of a step's non-GEMM bytes, and which of their global
# accesses must be 16 bytes wide (L: loads, S: stores) on the aligned path.
WIDE_ACCESSES = {"sum_squares_partial": "L", "column_sum_x": "L", "column_sum_f32": "L",
                 "layernorm_forward": "LS", "residual_layernorm_forward": "LS",
                 "layernorm_backward": "LS", "layernorm_forward_v": "LS",
                 "residual_layernorm_forward_v": "LS", "layernorm_backward_v": "LS",
                 "bias_forward": "LS",
                 "cross_entropy": "LS", "classifier_stats": "L", "classifier": "LS",
                 "cross_entropy_v": "LS", "classifier_stats_v": "L", "classifier_v": "LS",
                 "sum_squares_partial_v": "L",
                 "gelu_forward": "LS",
                 "gelu_backward": "LS", "residual_forward": "LS",
                 "flash_forward_64": "LS", "flash_dq_64": "LS", "flash_dkdv_64": "LS",
                 "adamw": "LS", "encoder_forward": "LS", "encoder_backward_wpe": "LS",
                 "encoder_backward_wte": "LS"}


# The row and reduction kernels' aligned entries (and the column sums), and how many of their
# 16-byte loads the SASS must have in flight at once (loads_in_flight, sm_90, both dtypes):
# the alignment is decided once per launch, so a pack's loads are not each behind a branch
# (the H200 profile's row kernels ran 1.4 to 2.4x their byte floors with one at a time).
LOADS_IN_FLIGHT = {"layernorm_forward_v": 4, "residual_layernorm_forward_v": 3,
                   "layernorm_backward_v": 3, "sum_squares_partial_v": 4, "column_sum_x": 4,
                   "column_sum_f32": 4, "cross_entropy_v": 2, "classifier_stats_v": 2,
                   "classifier_v": 2}


def cuobjdump():
    """cuobjdump (with nvdisasm beside it: pip install nvidia-cuda-cuobjdump
    nvidia-cuda-nvdisasm), on PATH or in the nvidia wheels' bin directory; None: neither."""
    if shutil.which("cuobjdump"):
        return shutil.which("cuobjdump")
    try:
        import nvidia
    except ImportError:
        return None
    found = [p for d in nvidia.__path__ for p in glob.glob(os.path.join(d, "*", "bin", "cuobjdump"))]
    return found[0] if found else None


def sass(cubin, tmp_path):
    """{kernel: its SASS} (cuobjdump -sass)."""
    tool = cuobjdump()
    env = dict(os.environ, PATH=os.path.dirname(tool) + os.pathsep + os.environ["PATH"])
    (tmp_path / "k.cubin").write_bytes(cubin)
    text = subprocess.run([tool, "-sass", str(tmp_path / "k.cubin")], capture_output=True,
                          text=True, env=env, check=True).stdout
    return dict(re.findall(r"Function : (\w+)\n(.*?)(?=\n\s*Function : |\Z)", text, re.S))


def sass_marks(kernels):
    """{kernel: "L" if its SASS has a 16-byte global load, + "S" for a store, + "M" for a
    shared-memory matrix load (LDSM), + "H" for a 2-byte shared load}."""
    return {fn: "L" * ("LDG.E.128" in body) + "S" * ("STG.E.128" in body) +
            "M" * ("LDSM" in body) + "H" * ("LDS.U16" in body) for fn, body in kernels.items()}


def loads_in_flight(body):
    """The most 16-byte global loads (LDG.E.128) a kernel's SASS issues, in program order,
    from one of them up to the first instruction reading a register it loads: how many
    round trips to memory overlap (1: each load waits for the one before to be used)."""
    ops = [t.strip() for t in re.findall(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", body)]
    most = 0
    for i, op in enumerate(ops):
        m = re.match(r"(?:@!?U?P\w+\s+)?LDG\.E\.128\S*\s+R(\d+),", op)
        if not m:
            continue
        dest, n = set(range(int(m.group(1)), int(m.group(1)) + 4)), 0
        for later in ops[i:]:
            reads = later.split(",", 1)[1] if "," in later else ""
            if later is not op and dest & {int(r) for r in re.findall(r"\bR(\d+)\b", reads)}:
                break
            n += "LDG.E.128" in later
        most = max(most, n)
    return most


def test_loads_in_flight_counts_the_loads_issued_before_a_use():
    one_at_a_time = """
        /*0010*/  LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0020*/  FADD R9, R4, R5 ;
        /*0030*/  LDG.E.128 R12, desc[UR4][R2.64+0x10] ;
        /*0040*/  FADD R9, R9, R12 ;"""
    back_to_back = """
        /*0010*/  LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0020*/  @P0 LDG.E.128 R12, desc[UR4][R2.64+0x10] ;
        /*0030*/  IADD3 R2, R2, 0x20, RZ ;
        /*0040*/  LDG.E.128 R16, desc[UR4][R2.64] ;
        /*0050*/  FADD R9, R7, R13 ;"""
    assert loads_in_flight(one_at_a_time) == 1
    assert loads_in_flight(back_to_back) == 3
    assert loads_in_flight("/*0010*/  FADD R1, R2, R3 ;") == 0
