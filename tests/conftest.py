import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(ROOT, "tests", "fixtures")
sys.path.insert(0, ROOT)


def fixture(name):
    return os.path.join(FIX, name)


def mpiexec():
    """The launcher installed with the mpich wheel (beside this Python), else PATH's."""
    import shutil
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.path.exists(here) else shutil.which("mpiexec")


def cli(*args, ranks=None, timeout=300, env=None):
    """Runs `python cli.py ARGS` (under `mpiexec -n ranks` when given); returns the result."""
    cmd = [sys.executable, os.path.join(ROOT, "cli.py"), *map(str, args)]
    if ranks:
        cmd = [mpiexec(), "-n", str(ranks), *cmd]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=full_env)


def gpu_available():
    from cupygpt.backends import gpu_available
    return gpu_available()


requires_gpu = pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU and CuPy")
