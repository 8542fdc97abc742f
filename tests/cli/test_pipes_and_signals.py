"""A command's pipes and signals, as a careful Unix tool's (issue 36): a reader closing the
pipe costs nothing, a signal is acted on within seconds in every phase (validation, a
step, HellaSwag, the imports, the last writes) and the exit status says so (signals with
checkpoints, limits: test_signals_and_limits.py)."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from harness import CLI, TINY


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


def signalled(sig, ready, *args):
    """The command, sent sig once a stdout line starts with ready (and half a second more):
    (exit code, seconds from the signal to its end, stdout, stderr)."""
    # (SIGHUP's default action for the command: under nohup the suite inherits it ignored,
    # which train leaves so, as a user's nohup asks)
    p = subprocess.Popen([sys.executable, CLI, *map(str, args)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"},
                         preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    out = []
    while not out or not out[-1].startswith(ready):
        out.append(p.stdout.readline())
        assert out[-1], "".join(out) + p.stderr.read()
    time.sleep(0.5)
    p.send_signal(sig)
    t0 = time.monotonic()
    rest, err = p.communicate(timeout=120)
    return p.returncode, time.monotonic() - t0, "".join(out) + rest, err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_a_long_validation_stops_within_seconds(tmp_path, sig):
    rc, took, out, err = signalled(sig, "+--", *TINY, "-v", 1, "-m", 100000, "-n", 2,
                                   "-o", tmp_path / "o")
    assert (rc, err) == (128 + sig, ""), err
    assert took < 5 and "interrupted after step 0; nothing trained" in out, (took, out)
    assert not (tmp_path / "o").exists()  # (made by this run, nothing in it)


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGUSR1, signal.SIGXCPU])
def test_sighup_during_training_finishes_the_step_and_writes_the_model_as_sigterm(tmp_path,
                                                                                  sig):
    """A closed terminal (SIGHUP), SLURM's warning ahead of a time limit (SIGUSR1, its
    --signal), a CPU-time limit reached (SIGXCPU) stopped train at once, its model lost; now
    as SIGTERM: the step finishes, the model is written, exit 128 + the signal."""
    rc, took, out, err = signalled(sig, "step ", *TINY, "-n", 100000, "-o", tmp_path / "o")
    assert (rc, err) == (128 + sig, ""), (rc, err)
    assert took < 5 and f"wrote {tmp_path / 'o' / 'model.bin'} of step" in out, (took, out)
    assert (tmp_path / "o" / "model.bin").stat().st_size > 0


def test_a_signal_during_hellaswag_writes_the_model_of_the_step(tmp_path):
    from test_hellaswag import write_llmc_eval
    rng = np.random.default_rng(0)
    write_llmc_eval(tmp_path / "hs.bin", [
        (0, rng.integers(0, 50257, 20).tolist(), rng.integers(0, 50257, (4, 8)).tolist())
        for _ in range(3000)])
    rc, took, out, err = signalled(signal.SIGTERM, "step    1/1", "train", "--backend",
                                   "numpy", "-b", 4, "-t", 32, "-n", 1, "-v", 0, "-g", 0,
                                   "-h", 1, "--hellaswag-file", tmp_path / "hs.bin", "-o",
                                   tmp_path / "o")
    assert (rc, err) == (143, ""), err
    assert took < 5 and f"wrote {tmp_path / 'o' / 'model.bin'} of step 1" in out, (took, out)
    assert "hellaswag acc" not in out


@pytest.mark.parametrize("delay", [0.1, 0.3, 0.6])
def test_ctrl_c_while_a_command_still_imports_is_a_quiet_130(tmp_path, delay):
    """Before a command's own handlers are in (its imports: numpy, the package) Ctrl-C
    ends it as it does later: 130, no KeyboardInterrupt traceback."""
    p = subprocess.Popen([sys.executable, CLI, *TINY, "-n", "100000", "-o", str(tmp_path / "o")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(delay)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130 and "Traceback" not in err, err


def test_a_signal_during_the_last_writes_lets_them_finish_and_exits_as_signalled(tmp_path):
    """SIGTERM while the last step's model is written: the model is whole, the run says
    so, and the exit status is 128 + SIGTERM, not 0 (a scheduler must see the stop)."""
    script = ("import os, signal, sys\n"
              "import cupygpt.train.loop as t\n"
              "real = t.write_model\n"
              "def signalled(*a, **k):\n"
              "    os.kill(os.getpid(), signal.SIGTERM)\n"
              "    return real(*a, **k)\n"
              "t.write_model = signalled\n"
              "sys.argv = ['cli.py', *sys.argv[1:]]\n"
              "from cupygpt.__main__ import run\n"
              "run()\n")
    res = subprocess.run([sys.executable, "-c", script, *TINY, "-n", "2", "-o", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert (res.returncode, res.stderr) == (143, ""), res.stderr
    assert "interrupted after the last step; everything was written" in res.stdout
    assert (tmp_path / "model.bin").stat().st_size > 0


def loader_state(ckpt):
    with np.load(os.path.join(ckpt, "adamw.npz")) as z:
        return json.loads(str(z["meta"]))["train_loader"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_an_accumulated_step_stops_between_its_batches(tmp_path, sig):
    """-d: a step of 200 batches takes seconds; a signal is heard between two of them, the
    step given up (no update), and the checkpoint written is the last whole step's, its data
    position where a run of that many steps leaves it (a resume reads the step again)."""
    acc = [*TINY, "-d", 16 * 200, "--checkpoint-every", 3]
    rc, took, out, err = signalled(sig, "step    1", *acc, "-n", 3, "-o", tmp_path / "o")
    assert (rc, err) == (128 + sig, ""), err
    assert took < 5 and "interrupted after step 1; resume from" in out, (took, out)
    subprocess.run([sys.executable, CLI, *map(str, acc), "-n", "1", "--checkpoint-every", "1",
                    "-o", str(tmp_path / "one")], check=True, capture_output=True, timeout=300)
    assert loader_state(tmp_path / "o" / "ckpt_00000001") == loader_state(
        tmp_path / "one" / "ckpt_00000001")


def test_a_signal_while_a_step_reads_its_many_batches_stops_within_seconds(tmp_path):
    """-d with hundreds of thousands of batches a step: reading them takes seconds before
    the first pass; a signal then is heard between reads, nothing trained or written."""
    rc, took, out, err = signalled(signal.SIGINT, "+--", *TINY, "-d", 16 * 600_000, "-n", 2,
                                   "-o", tmp_path / "o")
    assert (rc, err) == (130, ""), err
    # (reading them all first took about 6 s on this 2-core machine; between two looks: ms)
    assert took < 3 and "interrupted after step 0; nothing trained" in out, (took, out)
    assert not (tmp_path / "o").exists()
