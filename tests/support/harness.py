"""The suite's shared helpers (tests/conftest.py puts this folder on sys.path, so a test
says `from harness import cli`): the checkout's paths, the CLI run in a subprocess, the
reference files, the devices (cudasim, the GPU) and cudasim loaded in-process."""
import importlib
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys

import pytest

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)
FIX = os.path.join(ROOT, "cupygpt", "reference")
CLI = os.path.join(ROOT, "cli.py")
SUPPORT = os.path.join(TESTS, "support")  # this folder: cudasim, the jobs, the fixture makers
# the CLI with a fault injected into its training loop (a rank raising, a loss spike)
FAULTY_CLI = os.path.join(SUPPORT, "faulty_cli.py")
sys.path.insert(0, ROOT)
# Every test runs in a directory of its own (conftest's own_directory), so a script a test
# starts imports this checkout's cupygpt by this path, not by its working directory.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)

# a short training run of the default model (tiny on the CPU): no validation, no samples
TRAIN = ["train", "-b", "4", "-t", "32", "-v", "0", "-g", "0"]

# a short numpy run of the smallest batch (B=1, T=16): no validation, no samples
TINY = ["train", "--backend", "numpy", "-b", "1", "-t", "16", "-v", "0", "-g", "0"]

# verify's reference files, (model, state, expected losses): llm.c's own reference, odd T with
# 16 heads, GPT-2's vocab
FILES = [("tiny_model.bin", "tiny_debug_state.bin", "tiny_expected.json"),
         ("odd_model.bin", "odd_debug_state.bin", "odd_expected.json"),
         ("gpt2v_model.bin", "gpt2v_debug_state.bin", "gpt2v_expected.json"),
         ("gpt2v_model_bf16.bin", "gpt2v_debug_state.bin", "gpt2v_expected.json")]


def small_shard(path, n=5000):
    """A token shard of n tokens inside the tiny reference model's vocab (300)."""
    import numpy as np

    from cupygpt.formats.llmc import write_shard
    write_shard(path, np.arange(n) % 300)
    return str(path)


def fixture(name):
    return os.path.join(FIX, name)


def mpiexec():
    """The launcher installed with the mpich wheel (beside this Python), else PATH's."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.path.exists(here) else shutil.which("mpiexec")


def cli(*args, ranks=None, timeout=300, env=None, cwd=None, fault=None, program=None):
    """Runs `python cli.py ARGS` (under `mpiexec -n ranks` when given), in the test's own
    directory unless told; returns the result. fault: train's loop fails as it says
    (faulty_cli.py: raise:STEP:RANK, targets:STEP, start:RANK)."""
    program = program or ((FAULTY_CLI, fault) if fault else (CLI,))
    cmd = [sys.executable, *program, *map(str, args)]
    if ranks:
        cmd = [mpiexec(), "-n", str(ranks), *cmd]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=full_env, cwd=cwd)


def gpucheck(*args, timeout=300, env=None):
    """Runs the repository's GPU check, `python -m dev.gpucheck ARGS`, in the test's own
    directory (PYTHONPATH holds the checkout, so dev/ is found from there)."""
    return cli(*args, timeout=timeout, env=env, program=["-m", "dev.gpucheck"])


def error_line(res):
    """The command's one error line (no traceback), with exit 1."""
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1 and len(lines) == 1, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    return lines[0]


def one_line(res, expect):
    """A refusal as every command makes one: exit 1, one line on stderr (an error naming
    expect), nothing else."""
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), \
        (res.stdout, res.stderr)
    assert expect in lines[0], lines[0]


def run_verify(files, *extra, ranks=None, env=None):
    """`verify --json` on fixture files (model, state, expected losses): the result and its
    JSON report (None when it printed nothing)."""
    model, state, expected = files
    res = cli("verify", "--model", fixture(model), "--state", fixture(state), "--expected",
              fixture(expected), "--json", *extra, ranks=ranks, timeout=600, env=env)
    out = res.stdout.strip().splitlines()
    return res, (json.loads(out[-1]) if out else None)


def losses(text, what="train loss"):
    """The losses a run printed, from its `train loss X` (or `val loss X`) lines."""
    return [float(x) for x in re.findall(what + r" (\d+\.\d+)", text)]


def gpu_available():
    from cupygpt.backends import gpu_available
    return gpu_available()


requires_gpu = pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU and CuPy")


# --- cudasim: the CUDA backend on the CPU (tests/support/cudasim) -------------------------
SIM = os.path.join(SUPPORT, "cudasim")


def cudasim_missing():
    """Why cudasim cannot run here, or None."""
    if platform.machine() != "x86_64":
        return "cudasim's fiber switch is written for x86-64"
    if shutil.which("g++") is None:
        return "cudasim compiles kernels_cu with g++, which is not installed"
    return None


# The CUDA backend's tests run on both: "sim" everywhere (in CI a missing g++ fails rather
# than skips), "gpu" where there is one (and under `pytest -m gpu`, the GPU check).
requires_sim = pytest.mark.skipif(bool(cudasim_missing()) and not os.environ.get("CI"),
                                  reason=cudasim_missing() or "")
DEVICES = [pytest.param("sim", marks=requires_sim),
           pytest.param("gpu", marks=[pytest.mark.gpu, requires_gpu])]


def tiktokens(texts, eot=True):
    """Each text's GPT-2 tokens (tiktoken's encoding of the shipped tokenizer), an EOT
    first when eot, in a process of its own: in-process, tiktoken can break once another
    test has loaded NVRTC or cudasim."""
    script = ("import json, sys; from cupygpt.formats.tokenizer import Tokenizer; "
              f"t = Tokenizer({os.path.join(ROOT, 'cupygpt', 'data', 'gpt2_tokenizer.bin')!r}); "
              "print(json.dumps([([t.eot] if %r else []) + t.encode(x) "
              "for x in json.load(sys.stdin)]))" % eot)
    res = subprocess.run([sys.executable, "-c", script], input=json.dumps(texts), text=True,
                         capture_output=True, check=True)
    return json.loads(res.stdout)


def device_env(device):
    """The environment for a CLI run on device: cudasim's cupy first on PYTHONPATH (and
    its stand-in compute-sanitizer on PATH)."""
    if device != "sim":
        return {}
    return {"PYTHONPATH": os.pathsep.join(p for p in (SIM, os.environ.get("PYTHONPATH")) if p),
            "PATH": os.pathsep.join((os.path.join(SIM, "bin"), os.environ.get("PATH", "")))}


def simulated(device):
    """Whether device runs on cudasim: "sim", or "gpu" in the GPU check's dry run, where
    cudasim's cupy is the one on PYTHONPATH."""
    if device == "sim":
        return True
    import cupy
    return os.path.dirname(os.path.abspath(cupy.__file__)) == SIM


# the name the cuda backend's package is loaded under against cudasim (load_cudasim)
SIM_BACKEND = "cupygpt.backends.cuda_on_cudasim"


def load_cudasim():
    """(cudasim's cupy, a CudaBackend bound to it), in this process: the backend's package
    loaded afresh under SIM_BACKEND against cudasim's stand-ins; an imported real CuPy or
    nvmath is left as it was."""
    names = ("cupy", "cupy.cuda", "cupy.cuda.nccl", "cupy_backends", "cupy_backends.cuda",
             "cupy_backends.cuda.libs", "nvmath", "nvmath.bindings", "nvmath.bindings.cublasLt",
             "cudnn")
    saved = {n: sys.modules.get(n) for n in names}
    for n in [n for n in sys.modules if n == SIM_BACKEND or n.startswith(SIM_BACKEND + ".")]:
        del sys.modules[n]  # (each call's modules bound to its own cupy)
    try:
        cp = _load("cupy", os.path.join(SIM, "cupy.py"))
        _load("nvmath", os.path.join(SIM, "nvmath", "__init__.py"))
        _load("nvmath.bindings", os.path.join(SIM, "nvmath", "bindings", "__init__.py"))
        _load("nvmath.bindings.cublasLt", os.path.join(SIM, "nvmath", "bindings", "cublasLt.py"))
        _load("cudnn", os.path.join(SIM, "cudnn", "__init__.py"))
        _load(SIM_BACKEND, os.path.join(ROOT, "cupygpt", "backends", "cuda", "__init__.py"))
        backend = importlib.import_module(SIM_BACKEND + ".backend")
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m
    return cp, backend.CudaBackend()


def cudasim_module(cu, name):
    """The module `name` (cublaslt, cudnn, ...) of the package cu's class was loaded from:
    under load_cudasim, the one bound to cudasim's stand-ins."""
    return sys.modules[f"{type(cu).__module__.rpartition('.')[0]}.{name}"]


def _load(name, path):
    """The module at path, loaded afresh as name (a package where path is an __init__.py)."""
    package = os.path.basename(path) == "__init__.py"
    spec = importlib.util.spec_from_file_location(
        name, path, submodule_search_locations=[os.path.dirname(path)] if package else None)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def helpers_of(path):
    """The test module at path (under tests/) whose helpers a test in another folder uses:
    the one pytest imported (by its file name, as the folders are no packages), else that
    file loaded once under the same name."""
    name = os.path.splitext(os.path.basename(path))[0]
    return sys.modules.get(name) or _load(name, os.path.join(TESTS, path))
