"""Every kernels_cu/*.cu compiles, with the backend's own options, for sm_80 and sm_90 —
through NVRTC (what CuPy uses on the GPU) and through nvcc where it is installed; ptxas
spills nothing, and the bulk kernels' SASS has 16-byte global accesses. Runs without a
GPU, so a broken or slowed kernel cannot land."""
import glob
import os
import re
import shutil
import subprocess

import pytest

from cupygpt.kernels import FLOATX, KERNEL_DIR, OPTIONS, kernels_in, nvrtc_compile, options, sources

ARCHS = ("compute_80", "compute_90")


def have_nvrtc():
    try:
        nvrtc_compile(sources()[0], ARCHS[0])
        return True
    except Exception:
        return False


@pytest.mark.skipif(not have_nvrtc() and not os.environ.get("CI"),
                    reason="NVRTC not installed (pip install -e '.[test]')")
@pytest.mark.parametrize("dtype", FLOATX)
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("path", sources(), ids=os.path.basename)
def test_nvrtc_compiles(path, arch, dtype):
    nvrtc_compile(path, arch, options(dtype))


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
    defined = set()
    for path in sources():
        defined |= set(kernels_in(open(path).read()))
    assert used and used <= defined, used - defined


@pytest.mark.skipif(not have_nvrtc(), reason="NVRTC not installed")
@pytest.mark.parametrize("dtype", FLOATX)
@pytest.mark.parametrize("arch", ("sm_80", "sm_90"))
@pytest.mark.parametrize("path", sources(), ids=os.path.basename)
def test_no_kernel_spills(path, arch, dtype):
    """ptxas (through NVRTC, -v) keeps every kernel in registers: no local-memory spills."""
    log = nvrtc_compile(path, arch, options(dtype) + ("--ptxas-options=-v",))
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert spills and all(s == ("0", "0") for s in spills), log


# The kernels that move the bulk of a step's non-GEMM bytes, and which of their global
# accesses must be 16 bytes wide (L: loads, S: stores) on the aligned path.
WIDE_ACCESSES = {"sum_squares_partial": "L", "column_sum_x": "L", "column_sum_f32": "L",
                 "layernorm_forward": "LS", "residual_layernorm_forward": "LS",
                 "residual_bias_forward": "LS", "layernorm_backward": "LS",
                 "cross_entropy": "LS", "gelu_forward": "LS", "gelu_bias_forward": "LS",
                 "gelu_backward": "LS", "residual_forward": "LS"}


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


@pytest.mark.skipif(not have_nvrtc() or cuobjdump() is None, reason="NVRTC or cuobjdump missing")
@pytest.mark.parametrize("dtype", FLOATX)
def test_bulk_kernels_use_16_byte_accesses(tmp_path, dtype):
    """The sm_90 SASS of each WIDE_ACCESSES kernel holds LDG.E.128 (and STG.E.128)."""
    tool = cuobjdump()
    env = dict(os.environ, PATH=os.path.dirname(tool) + os.pathsep + os.environ["PATH"])
    seen = {}
    for path in sources():
        _, code = nvrtc_compile(path, "sm_90", options(dtype), cubin=True)
        (tmp_path / "k.cubin").write_bytes(code)
        sass = subprocess.run([tool, "-sass", str(tmp_path / "k.cubin")], capture_output=True,
                              text=True, env=env, check=True).stdout
        for fn, body in re.findall(r"Function : (\w+)\n(.*?)(?=\n\s*Function : |\Z)", sass, re.S):
            seen[fn] = "L" * ("LDG.E.128" in body) + "S" * ("STG.E.128" in body)
    for fn, wanted in WIDE_ACCESSES.items():
        assert all(c in seen[fn] for c in wanted), (fn, seen[fn])
