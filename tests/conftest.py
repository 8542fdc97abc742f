import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(ROOT, "cupygpt", "reference")
CLI = os.path.join(ROOT, "cli.py")
sys.path.insert(0, ROOT)
# Every test runs in a directory of its own (own_directory, below), so a script a test
# starts imports this checkout's cupygpt by this path, not by its working directory.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)


def checkout_out():
    """What the checkout's out/ holds (a user's `python cli.py train` writes it): each
    file's path, size and modification time."""
    found = {}
    for d, _, files in os.walk(os.path.join(ROOT, "out")):
        for f in files:
            st = os.lstat(os.path.join(d, f))
            found[os.path.join(d, f)] = (st.st_size, st.st_mtime_ns)
    return found


@pytest.fixture(autouse=True)
def own_directory(tmp_path_factory, monkeypatch):
    """Each test's commands run in an empty directory of its own: a default output
    (train's -o out, bench.json, loss.png) never meets what a user's run left in the
    checkout, nor lands there; the checkout's out/ is as it was after the test."""
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))
    before = checkout_out()
    yield
    assert checkout_out() == before, "the test wrote into the checkout's out/"


def fixture(name):
    return os.path.join(FIX, name)


def mpiexec():
    """The launcher installed with the mpich wheel (beside this Python), else PATH's."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.path.exists(here) else shutil.which("mpiexec")


def cli(*args, ranks=None, timeout=300, env=None, cwd=None):
    """Runs `python cli.py ARGS` (under `mpiexec -n ranks` when given), in the test's own
    directory unless told; returns the result."""
    cmd = [sys.executable, CLI, *map(str, args)]
    if ranks:
        cmd = [mpiexec(), "-n", str(ranks), *cmd]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=full_env, cwd=cwd)


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


# --- cudasim: the CUDA backend on the CPU (tests/cudasim) ---------------------------------
SIM = os.path.join(ROOT, "tests", "cudasim")


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


def load_cudasim():
    """(cudasim's cupy, a cuda backend module bound to it), in this process; an imported
    real CuPy or nvmath is left as it was."""
    names = ("cupy", "cupy.cuda", "cupy.cuda.nccl", "cupy_backends", "cupy_backends.cuda",
             "cupy_backends.cuda.libs", "nvmath", "nvmath.bindings", "nvmath.bindings.cublasLt",
             "cudnn", "cupygpt.backends.cudnn_attention")
    saved = {n: sys.modules.get(n) for n in names}
    try:
        cp = _load("cupy", os.path.join(SIM, "cupy.py"))
        _load("nvmath", os.path.join(SIM, "nvmath", "__init__.py"))
        _load("nvmath.bindings", os.path.join(SIM, "nvmath", "bindings", "__init__.py"))
        _load("nvmath.bindings.cublasLt", os.path.join(SIM, "nvmath", "bindings", "cublasLt.py"))
        _load("cudnn", os.path.join(SIM, "cudnn", "__init__.py"))
        _load("cupygpt.backends.cudnn_attention",
              os.path.join(ROOT, "cupygpt", "backends", "cudnn_attention.py"))
        cu = _load("cupygpt.backends.cuda_backend_on_cudasim",
                   os.path.join(ROOT, "cupygpt", "backends", "cuda_backend.py"))
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m
    return cp, cu


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
