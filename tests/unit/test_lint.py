"""ruff (the test extra's), configured in pyproject.toml (pyflakes, pycodestyle, import
order), finds nothing in the repository."""
import subprocess
import sys

from harness import ROOT


def test_ruff_finds_nothing():
    res = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", ROOT],
                         capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
