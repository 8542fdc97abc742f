"""The suite's fixture every test takes, and its helpers on the path: tests/support (cudasim,
the job scripts, harness.py) is importable from every folder of the tree."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))

from harness import ROOT  # noqa: E402 (found through the path just set)

# The fast tier (pytest -m "not slow", README's few minutes) leaves out the tests that run
# whole commands as processes (tests/cli, tests/dev) but for a few quick ones, and the
# in-process tests that compile or run kernels on cudasim by the dozen. What it keeps still
# imports and calls every module of the package.
SLOW_FOLDERS = ("cli", "dev")
FAST_FILES = {"cli/test_train.py", "cli/test_schedule_command.py", "cli/test_timeline.py"}
SLOW_FILES = {"unit/backends/test_flash_attention.py", "unit/backends/test_cudnn_attention.py",
              "unit/backends/test_kernels_compile.py", "support/test_cudasim.py"}


def pytest_collection_modifyitems(config, items):
    tests = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        rel = os.path.relpath(str(item.path), tests).replace(os.sep, "/")
        if rel in SLOW_FILES or (rel.split("/")[0] in SLOW_FOLDERS and rel not in FAST_FILES):
            item.add_marker(pytest.mark.slow)


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
