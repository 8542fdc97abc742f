"""Every command in README.md's code blocks runs as written, in order, in a copy of the
repository (nothing lands in this one); `train` gets -n 4, as README says."""
import os
import shlex
import shutil
import subprocess
import sys

import pytest

from harness import ROOT, cudasim_missing, mpiexec

COMMANDS = ("python", "pip", "mpirun", "mpiexec")


def commands():
    """README's commands: the lines of its indented code blocks (continuations joined)
    whose program, after any VAR=value, is one of COMMANDS; `a && b` gives both."""
    found, lines = [], open(os.path.join(ROOT, "README.md"), encoding="utf-8").read().split("\n")
    for prev, line in zip([""] + lines, lines):
        if line.startswith("    ") and (not prev.strip() or prev.startswith("    ")):
            if found and found[-1].endswith("\\"):
                found[-1] = found[-1][:-1] + line.strip()
            else:
                found.append(line.strip())
    cmds = []
    for line in found:
        for part in line.split(" && "):
            words = shlex.split(part)
            program = next((w for w in words if "=" not in w), "")
            if program in COMMANDS:
                cmds.append(part)
    return cmds


def skipped(cmd):
    """Why a command is not run here, or None."""
    if cmd.startswith("pip "):
        return "installs: the tests run in the environment it makes"
    if "pytest" in cmd:
        return "the test suite itself"
    if "gpucheck" in cmd:
        return "the GPU check needs a GPU (and runs for minutes)"
    if "tests/support/cudasim" in cmd:
        return cudasim_missing()
    return None


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    dest = tmp_path_factory.mktemp("readme") / "cupygpt"
    shutil.copytree(ROOT, dest, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", "__pycache__", ".pytest_cache", "*.egg-info", "out", "gpu_report"))
    return dest


def test_readme_has_its_commands():
    cmds = commands()
    assert len(cmds) >= 10 and any(c.startswith("mpirun -np 3") for c in cmds), cmds


@pytest.mark.parametrize("cmd", [pytest.param(c, marks=pytest.mark.skipif(
    bool(skipped(c)), reason=skipped(c) or "")) for c in commands()])
def test_readme_command_runs(clone, cmd):
    words = shlex.split(cmd)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    while "=" in words[0]:
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    launcher = {"python": [sys.executable], "mpirun": [mpiexec()], "mpiexec": [mpiexec()]}
    words = launcher[words[0]] + words[1:] + (["-n", "4"] if "train" in words else [])
    res = subprocess.run(words, cwd=clone, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "Traceback" not in res.stderr, (res.stdout, res.stderr)
