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

from cupygpt.backends.cuda.kernels import (
    FLOATX,
    GEOMETRY,
    KERNEL_DIR,
    OPTIONS,
    flash_cols,
    flash_fp32_doubled,
    flash_smem_bytes,
    kernels_in,
    nvrtc_compile,
    options,
    sources,
)

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
                    reason="NVRTC not installed (pip install -e '.[test-cuda]')")
@pytest.mark.parametrize("dtype", FLOATX)
@pytest.mark.parametrize("arch", SM)
@pytest.mark.parametrize("path", sources(), ids=os.path.basename)
def test_nvrtc_compiles(tmp_path, path, arch, dtype):
    """To the GPU's code, with no register spills; flash attention's kernels leave room for
    two blocks per SM (registers, and the dynamic shared memory the backend launches them
    with; an fp32 head above 64 only on the H100); on sm_90 the WIDE_ACCESSES kernels'
    SASS holds LDG.E.128 (or LDGSTS.E.BYPASS.128, and STG.E.128), bf16 flash attention reads
    its tensor-core operands from shared memory with ldmatrix (LDSM), no 2-byte loads, and
    every flash kernel's tile loop is as check_flash_sass wants it."""
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
        assert 2 * -(-regs // 8) * 8 * threads <= REGISTERS_PER_SM, (name, regs)  # (8 a unit)
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
        for fn in (f for f in report if f.startswith("flash_")):
            check_flash_sass(fn, kernels[fn], 2 if dtype == "bf16" else 4)


def check_flash_sass(fn, body, itemsize):
    """The flash kernels' tile loop (the widest loop with tensor-core products and a
    barrier) copies the next tiles with cp.async (LDGSTS) and waits on them (DEPBAR); the
    exponentials of a tile, or of a chunk of 32 columns (dkdv's), 4 per 8 columns a lane
    holds, issue in one straight run, no branch around each (the masked and unmasked
    tiles are separate code)."""
    ops = sass_ops(body)
    loop = tile_loop(ops)
    assert loop, (fn, "no loop with HMMA and BAR.SYNC")
    text = " ".join(op for _, op in loop)
    assert "LDGSTS" in text and "DEPBAR" in text, (fn, "tile loop without cp.async")
    cols = flash_cols(int(fn.rsplit("_", 1)[1]), itemsize)
    assert most_exp2_in_a_run(loop) >= min(cols, 32) // 2, (fn, most_exp2_in_a_run(loop))


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


def test_only_bf16_dkdv_bounds_its_registers_for_three_blocks():
    """The three blocks per SM (168 registers) are bf16's flash_dkdv up to 64 dimensions'
    (its critical path's occupancy); fp32's asks for one block, so its FMA and TF32 paths
    keep every register they want rather than risk spills."""
    if not have_nvrtc():
        pytest.skip("NVRTC not installed")
    path = os.path.join(KERNEL_DIR, "flash_attention.cu")
    for dtype in FLOATX:
        ptx = nvrtc_compile(path, ARCHS[1], options(dtype), cubin=True)[1].decode()
        bounded = dict(re.findall(r"\.entry (\w+)\([^{]*?\.minnctapersm (\d+)", ptx, re.S))
        want = [3, 3, 3] if dtype == "bf16" else [1, 1, 1]
        assert [int(bounded.get(f"flash_dkdv_{n}", 0)) for n in (16, 32, 64)] == want, bounded


def test_the_99_kib_devices_fp32_flash_build_spills_nothing():
    """sm_86's build (99 KiB a block: fp32 heads above 64 on one buffer) keeps every flash
    kernel's registers, as the sm_80 and sm_90 builds do."""
    if not have_nvrtc():
        pytest.skip("NVRTC not installed")
    doubled = flash_fp32_doubled(99 * 1024)
    assert doubled == 64
    log = nvrtc_compile(os.path.join(KERNEL_DIR, "flash_attention.cu"), "sm_86",
                        options("fp32", doubled) + ("--ptxas-options=-v",))
    report = ptxas_report(log)
    assert len(report) == 15 and not {k: r for k, r in report.items() if r[1]}, report


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
    src = "".join(open(p).read() for p in
                  glob.glob(os.path.join(os.path.dirname(KERNEL_DIR), "cuda", "*.py")))
    used = set(re.findall(r'\.(?:ew|rows|packed|launch)\("(\w+)"', src))
    whole = set(re.findall(r'\bwhole_packs\("(\w+)"', src))  # and their aligned _v entries
    used |= whole | {n + "_v" for n in whole}
    defined = set()
    for path in sources():
        defined |= set(kernels_in(open(path).read()))
    assert used and used <= defined, used - defined


# The kernels that move the bulk of a step's non-GEMM bytes, and which of their global
# accesses must be 16 bytes wide (L: loads, A: cp.async copies to shared memory, S: stores)
# on the aligned path.
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
                 "flash_forward_64": "AS", "flash_dq_64": "AS", "flash_dkdv_64": "AS",
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
    found = [p for d in nvidia.__path__
             for p in glob.glob(os.path.join(d, "*", "bin", "cuobjdump"))]
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
    """{kernel: "L" if its SASS has a 16-byte global load, + "A" for a 16-byte cp.async
    (LDGSTS, L2 only), + "S" for a store, + "M" for a shared-memory matrix load (LDSM), + "H"
    for a 2-byte shared load}."""
    return {fn: "L" * ("LDG.E.128" in body) + "A" * ("LDGSTS.E.BYPASS.128" in body) +
            "S" * ("STG.E.128" in body) +
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


def sass_ops(body):
    """[(address, instruction)] of a kernel's SASS, in program order."""
    found = re.findall(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", body)
    return [(int(a, 16), op.strip()) for a, op in found]


def back_branches(ops):
    """[(target, address)] of every branch to an earlier address: the loops."""
    out = []
    for a, op in ops:
        m = re.search(r"\bBRA\b(?:\s+!?U?P\w+,)?\s+(?:`\(\.L_x_\d+\)\s+)?0x([0-9a-f]+)", op)
        if m and int(m.group(1), 16) <= a:
            out.append((int(m.group(1), 16), a))
    return out


def tile_loop(ops):
    """The instructions of the narrowest loop holding both HMMA and BAR.SYNC (a flash
    kernel's walk over its tiles: the loops inside it have no barrier, and out-of-line code
    jumping back into it makes wider ones); [] if there is none."""
    best = None
    for lo, hi in back_branches(ops):
        body = [(a, op) for a, op in ops if lo <= a <= hi]
        text = " ".join(op for _, op in body)
        if "HMMA" in text and "BAR.SYNC" in text and (best is None or len(body) < len(best)):
            best = body
    return best or []


def most_exp2_in_a_run(ops):
    """The most MUFU.EX2 in one straight run of instructions: a run ends at any branch,
    convergence barrier (BSSY/BSYNC) or branch target."""
    targets = {t for t, _ in back_branches(ops)} | {
        int(m, 16) for _, op in ops for m in re.findall(r"\bBRA\b.*0x([0-9a-f]+)", op)}
    most = n = 0
    for a, op in ops:
        if a in targets:
            n = 0
        n += "MUFU.EX2" in op
        most = max(most, n)
        if re.search(r"\b(BRA|BSSY|BSYNC|EXIT|RET|CALL)\b", op):
            n = 0
    return most


def test_the_flash_sass_checks_fail_on_a_branch_per_exponential_or_no_cp_async():
    branchy = """
        /*0010*/  LDSM.16.M88.4 R4, [R2] ;
        /*0020*/  HMMA.16816.F32.BF16 R8, R4, R6, R8 ;
        /*0030*/  BSSY B0, 0x60 ;
        /*0040*/  @P0 BRA 0x60 ;
        /*0050*/  MUFU.EX2 R9, R9 ;
        /*0060*/  BSYNC B0 ;
        /*0070*/  MUFU.EX2 R10, R10 ;
        /*0080*/  BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0090*/  @P1 BRA 0x10 ;"""
    straight = branchy.replace("@P0 BRA 0x60", "FSEL R9, R9, RZ, P0")
    straight = straight.replace("BSSY B0, 0x60", "NOP").replace("BSYNC B0", "NOP")
    assert most_exp2_in_a_run(tile_loop(sass_ops(branchy))) == 1
    assert most_exp2_in_a_run(tile_loop(sass_ops(straight))) == 2
    assert "LDGSTS" not in str(tile_loop(sass_ops(branchy)))
    assert tile_loop(sass_ops(branchy.replace("BAR.SYNC", "NOP"))) == []


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
