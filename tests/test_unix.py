"""What a careful Unix tool does (issue 36): a reader closing the pipe costs nothing, a
signal is acted on within seconds in every phase, outputs are claimed before they are
written and never replaced unasked, user JSON is read strictly, failures leave nothing."""
import json
import os
import subprocess
import sys

from conftest import CLI

TINY = ["train", "--backend", "numpy", "-b", "1", "-t", "16", "-v", "0", "-g", "0"]


def closed_after(lines, *args):
    """The command with its stdout read for `lines` lines, then closed: (exit code,
    stderr)."""
    p = subprocess.Popen([sys.executable, CLI, *map(str, args)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    for _ in range(lines):
        assert p.stdout.readline()
    p.stdout.close()
    err = p.stderr.read()
    return p.wait(timeout=300), err


def test_a_closed_pipe_ends_a_short_command_quietly():
    rc, err = closed_after(1, "schedule", "-p", 16, "-m", 64)  # (`| head -1`)
    assert (rc, err) == (0, "")


def test_a_closed_pipe_costs_a_training_run_nothing(tmp_path):
    rc, err = closed_after(2, *TINY, "-n", 3, "-o", tmp_path)  # (`| head -2`)
    assert rc == 0 and "Traceback" not in err, err
    assert (tmp_path / "model.bin").stat().st_size > 0
    log = [json.loads(line) for line in open(tmp_path / "log.jsonl")]
    assert [r["step"] for r in log if "train_loss" in r] == [1, 2, 3]
