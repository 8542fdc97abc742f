"""`pip install` of the wheel gives a working `cupygpt` (the issue's CI check): the wheel
built from this tree, installed with its dependencies into a fresh virtual environment,
runs `train`, `sample` and `verify` on its shipped data from a directory outside the
repository, the kernel compile test passes on the .cu files it installed, and it carries
none of the developer tools (dev/).

It needs a package index for the dependencies (and the build's setuptools): without one
it skips, except in CI (CI set), where it fails. Measured on an idle 2-core machine: about
50 s with the dependencies at hand (a local index), about 65 s from PyPI with an empty pip
cache (~100 MB to download, most of it NVRTC); ~20 s of either is the compile test itself.
About 65 s of CPU time in all, so a busy machine takes longer (90 s at a load of 5)."""
import configparser
import math
import os
import re
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from types import SimpleNamespace

import pytest
from harness import ROOT, cli, losses

# The venv's processes see none of this one's path settings, so only its own copy imports.
ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
# What the compile test imports, at the versions the test-cuda extra asks for.
# (nvidia-cuda-runtime: the CUDA headers, cuda_bf16.h among them, which NVRTC compiles with)
COMPILE_TEST_NEEDS = ("pytest", "cuda-bindings", "nvidia-cuda-nvrtc", "nvidia-cuda-runtime")


def run(cmd, cwd, timeout=300, env=None):
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env={**ENV, **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


# pip 22.3 and later install into another Python's environment (--python): this Python's
# pip does, and the venv is made without one of its own (a few seconds less)
OUTER_PIP = tuple(int(x) for x in re.findall(r"\d+", metadata.version("pip"))[:2]) >= (22, 3)


def pip(py, args, cwd):
    """`pip ARGS` for py's environment; a failure skips the test when no package index
    answers (in CI it fails), and fails it otherwise."""
    cmd = [py, "-m", "pip"] if py == sys.executable or not OUTER_PIP else \
        [sys.executable, "-m", "pip", "--python", py]
    res = run([*cmd, "--no-input", *args], cwd, timeout=600)
    if res.returncode != 0:
        probe = run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "-d",
                     cwd / "probe", "click"], cwd)
        if probe.returncode != 0:
            why = "no package index reachable to build and install the wheel: " + \
                  (probe.stderr.strip().splitlines() or ["pip download failed"])[-1]
            if os.environ.get("CI"):
                pytest.fail(why)
            pytest.skip(why)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """The wheel built from this tree, installed with its dependencies (and nothing else)
    into a fresh venv: its python, its bin/ and its site-packages copy of cupygpt."""
    tmp = tmp_path_factory.mktemp("wheel")
    # built from a copy, so the build writes nothing into the repository and no stale
    # build/lib of an earlier build can slip into the wheel
    src = tmp / "src"
    shutil.copytree(ROOT, src, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", "build", "*.egg-info", "__pycache__", ".pytest_cache", "out", "gpu_report", ".whl"))
    pip(sys.executable, ["wheel", "--no-deps", "-q", "-w", tmp / "dist", src], tmp)
    (wheel,) = (tmp / "dist").glob("cupygpt-*.whl")
    res = run([sys.executable, "-m", "venv", *(["--without-pip"] if OUTER_PIP else []),
               tmp / "venv"], tmp)
    assert res.returncode == 0, res.stderr
    py = tmp / "venv" / "bin" / "python"
    pip(py, ["install", "-q", wheel], tmp)
    where = run([py, "-c", "import cupygpt; print(cupygpt.__file__)"], tmp)
    pkg = os.path.dirname(where.stdout.strip())
    assert pkg.startswith(str(tmp / "venv")), f"cupygpt imported from {pkg}, not the venv"
    return SimpleNamespace(tmp=tmp, python=py, bin=tmp / "venv" / "bin", pkg=pkg, wheel=wheel)


def test_installed_cupygpt_trains_samples_and_verifies(venv, tmp_path):
    """From outside the repository, every file from the install: the shipped shards and
    tokenizer for train and sample, the shipped llm.c reference for verify."""
    cupygpt = venv.bin / "cupygpt"
    args = ("train", "-e", "tiny", "--backend", "numpy", "-n", "3", "-t", "32", "-b", "2",
            "-v", "3", "-m", "1", "-g", "8")
    res = run([cupygpt, *args, "-o", "out"], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    train = losses(res.stdout)
    assert len(train) == 3 and all(map(math.isfinite, train)), res.stdout
    # untrained GPT-2 predicts ~uniformly over its 50,257 tokens: ln(50257) = 10.82
    assert abs(train[0] - math.log(50257)) < 0.1 and train[2] < train[0], train
    clone = cli(*args, "-o", tmp_path / "clone")
    assert clone.returncode == 0, clone.stderr
    assert losses(res.stdout, "val loss") == losses(clone.stdout, "val loss") and \
        train == losses(clone.stdout), "the installed copy reproduces the clone's run"
    # llm.c's file: 256-int header, then tiny's parameters (Vp=50304, maxT=256, C=128, L=4)
    Vp, T, C, L = 50304, 256, 128, 4
    n_params = Vp * C + T * C + L * (12 * C * C + 13 * C) + 2 * C
    assert (tmp_path / "out" / "model.bin").stat().st_size == 1024 + 4 * n_params

    res = run([cupygpt, "sample", "--model", "out/model.bin", "--prompt", "ROMEO:",
               "--max-new-tokens", "8"], tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("ROMEO:") and len(res.stdout.strip()) > len("ROMEO:")

    # python -m cupygpt, the same commands; verify's defaults are the shipped tiny files
    expected = os.path.join(venv.pkg, "reference", "tiny_expected.json")
    res = run([venv.python, "-m", "cupygpt", "verify", "--expected", expected], tmp_path)
    assert res.returncode == 0 and "verify: PASS" in res.stdout, res.stdout + res.stderr
    assert len(re.findall(r"^step \d+: loss [\d.]+ .*OK$", res.stdout, re.M)) == 10, res.stdout


def test_kernel_compile_test_passes_on_the_installed_sources(venv, tmp_path):
    """tests/unit/backends/test_kernels_compile.py alone in a directory of its own (so the
    repository's conftest.py, which puts the clone first on sys.path, is not loaded), run by
    the venv's python: it compiles the .cu files the wheel installed, each of the repository's,
    byte for byte the repository's (so one arch and dtype here: the in-repository run compiles
    every one of the same bytes)."""
    extra = configparser.ConfigParser()
    extra.read(os.path.join(ROOT, "setup.cfg"))
    needs = [r for x in ("test", "test-cuda") for r in extra["options.extras_require"][x].split()
             if re.match(r"[\w-]+", r).group() in COMPILE_TEST_NEEDS]
    assert len(needs) == len(COMPILE_TEST_NEEDS), needs
    pip(venv.python, ["install", "-q", "--no-compile", *needs], venv.tmp)  # one run imports them
    shutil.copy(os.path.join(ROOT, "tests", "unit", "backends", "test_kernels_compile.py"),
                tmp_path)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # nothing of the repository's config
    # the module the test imported is the one left in sys.modules: name its sources after
    code = ("import sys, pytest; rc = pytest.main(['-rA', '-p', 'no:cacheprovider', '-k', "
            "'(test_nvrtc_compiles and sm_90 and bf16) or broken_kernel or every_backend_kernel', "
            "'test_kernels_compile.py']); "
            "from cupygpt.backends.cuda.kernels import sources; print('SOURCES', *sources()); "
            "sys.exit(rc)")
    res = run([venv.python, "-c", code], tmp_path, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    compiled = res.stdout.split("SOURCES ")[-1].split()
    repo = sorted(f for f in os.listdir(os.path.join(ROOT, "cupygpt", "backends", "kernels_cu"))
                  if f.endswith(".cu"))
    assert compiled == [os.path.join(venv.pkg, "backends", "kernels_cu", f) for f in repo], compiled
    passed = set(re.findall(r"^PASSED \S+::test_nvrtc_compiles\[(\S+)\]", res.stdout, re.M))
    assert passed == {f"{f}-sm_90-bf16" for f in repo}, res.stdout
    kernels = os.path.join(ROOT, "cupygpt", "backends", "kernels_cu")
    for f in os.listdir(kernels):
        with open(os.path.join(kernels, f), "rb") as a, \
                open(os.path.join(venv.pkg, "backends", "kernels_cu", f), "rb") as b:
            assert a.read() == b.read(), f
    assert re.search(r"PASSED \S+::test_a_broken_kernel_is_caught", res.stdout)
    assert re.search(r"PASSED \S+::test_every_backend_kernel_exists", res.stdout)


def test_the_wheel_carries_the_product_not_the_lab(venv, tmp_path):
    """The developer tools (dev/: the GPU check, the static GPU model, the peers' runs) stay
    in the repository: the wheel holds none of their files, and cupygpt has no gpucheck."""
    names = zipfile.ZipFile(venv.wheel).namelist()
    assert names and all(n.startswith(("cupygpt/", "cupygpt-")) for n in names), names
    lab = [n for n in names if re.search(r"gpucheck|gpumodel|peers|flash_sass|vs_llmc", n)]
    assert not lab, lab
    res = run([venv.python, "-c", "import cupygpt.commands.gpucheck"], tmp_path)
    assert res.returncode == 1 and "ModuleNotFoundError" in res.stderr, res.stderr
    res = run([venv.bin / "cupygpt", "gpucheck"], tmp_path)
    assert res.returncode == 2 and "No such command 'gpucheck'" in res.stderr, res.stderr
