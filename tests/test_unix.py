"""What a careful Unix tool does (issue 36): a reader closing the pipe costs nothing, a
signal is acted on within seconds in every phase, outputs are claimed before they are
written and never replaced unasked, user JSON is read strictly, failures leave nothing."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

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


def signalled(sig, ready, *args):
    """The command, sent sig once a stdout line starts with ready (and half a second more):
    (exit code, seconds from the signal to its end, stdout, stderr)."""
    p = subprocess.Popen([sys.executable, CLI, *map(str, args)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
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


def test_sighup_during_training_finishes_the_step_and_writes_the_model_as_sigterm(tmp_path):
    """A closed terminal (SIGHUP) stopped train at once, its model lost; now as SIGTERM:
    the step finishes, the model is written, exit 128 + SIGHUP."""
    rc, took, out, err = signalled(signal.SIGHUP, "step ", *TINY, "-n", 100000, "-o",
                                   tmp_path / "o")
    assert (rc, err) == (128 + signal.SIGHUP, ""), (rc, err)
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


def one_line(res, expect):
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), \
        (res.stdout, res.stderr)
    assert expect in lines[0], lines[0]


def test_prepare_claims_its_out_as_train_claims_its_o(tmp_path):
    """A prepare writing into --out holds it: a second one there is refused, naming the
    first's PID, and writes nothing (two corpora's shards are never mixed)."""
    import fcntl
    from conftest import ROOT, cli
    text = os.path.join(ROOT, "data", "tinyshakespeare.txt")
    out = tmp_path / "d"
    out.mkdir()
    fd = os.open(out, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # (as the first prepare holds it)
    try:
        for args in ([], ["--shard-size", "100000"], ["--hellaswag"]):
            one_line(cli("prepare", text, "--out", out, "--name", "corp", *args),
                     f"--out {out}: another command (pid {os.getpid()}) is writing into "
                     f"this directory; wait for it to end, or give another directory")
        assert os.listdir(out) == []
    finally:
        os.close(fd)


def test_convert_never_replaces_a_file_unasked_and_writes_with_the_umask(tmp_path):
    from conftest import cli, fixture
    model = fixture("tiny_model.bin")
    res = cli("convert", model, tmp_path / "hf")
    assert res.returncode == 0, res.stderr
    assert os.stat(tmp_path / "hf" / "model.safetensors").st_mode & 0o777 == 0o644
    (tmp_path / "x.bin").write_bytes(b"mine")
    one_line(cli("convert", tmp_path / "hf", tmp_path / "x.bin"),
             f"{tmp_path / 'x.bin'}: already exists; add --overwrite to replace it")
    assert (tmp_path / "x.bin").read_bytes() == b"mine"
    assert cli("convert", tmp_path / "hf", tmp_path / "x.bin", "--force").returncode == 0
    assert open(tmp_path / "x.bin", "rb").read() == open(model, "rb").read()


def test_two_outputs_of_one_command_on_one_path_are_refused(tmp_path):
    from conftest import cli
    one_line(cli(*TINY, "-n", 1, "-o", tmp_path / "o", "--trace", tmp_path / "x",
                 "--log-file", tmp_path / "x"),
             f"--trace {tmp_path / 'x'}: is also another of this command's outputs")
    assert os.listdir(tmp_path) == []
    one_line(cli("bench", "--backend", "numpy", "-e", "tiny", "-b", 1, "-t", 16, "--steps", 1,
                 "--out", tmp_path / "b.json", "--trace", tmp_path / "." / "b.json"),
             "is also another of this command's outputs")  # (bench's --out beside --trace)
    assert os.listdir(tmp_path) == []


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


def test_verify_fails_a_step_whose_loss_is_not_finite():
    from conftest import cli
    res = cli("verify", "--backend", "numpy", "--steps", 2, "--lr", 1e30, "--json")
    r = json.loads(res.stdout.splitlines()[-1])
    assert res.returncode == 1 and not r["ok"], res.stdout + res.stderr
    assert [s["ok"] for s in r["steps"] if not np.isfinite(s["loss"])] == [False] * sum(
        not np.isfinite(s["loss"]) for s in r["steps"]) and r["steps"], r["steps"]
    assert not np.isfinite(r["steps"][-1]["loss"]), "the test needs a diverged step"


def test_a_malformed_fault_hook_is_one_line(tmp_path):
    from conftest import cli
    one_line(cli(*TINY, "-n", 1, "-o", tmp_path / "o", env={"CUPYGPT_FAULT": "raise:abc"}),
             "CUPYGPT_FAULT='raise:abc': give raise:STEP:RANK")
    assert os.listdir(tmp_path) == []


def test_gpucheck_refuses_an_out_it_cannot_use_in_one_line(tmp_path):
    from conftest import cli
    (tmp_path / "file").write_text("x")
    one_line(cli("gpucheck", "--out", tmp_path / "file"),
             f"--out {tmp_path / 'file'}: is a file, not a directory")
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "report.json").write_text("not JSON")
    one_line(cli("gpucheck", "--out", tmp_path / "r"), "report.json: not a report gpucheck "
                                                        "wrote (not a JSON object")
    assert (tmp_path / "r" / "report.json").read_text() == "not JSON"
    (tmp_path / "r" / "report.json").write_text("[1]")
    one_line(cli("gpucheck", "--out", tmp_path / "r"), "not a report gpucheck wrote")
    one_line(cli("gpucheck", "--out", "/proc/1/x"), "--out /proc/1/x: cannot")


def test_plot_leaves_out_what_it_cannot_draw_and_refuses_nothing_to_draw(tmp_path):
    pytest.importorskip("matplotlib")
    from conftest import cli
    log = tmp_path / "log.jsonl"
    log.write_text('{"step": 1, "train_loss": 1e308}\n{"step": 2, "train_loss": -1e308}\n'
                   '{"step": 3, "train_loss": 2.5}\n{"step": 4, "val_loss": NaN}\n')
    res = cli("plot", log, "--out", tmp_path / "a.png")
    assert res.returncode == 0 and res.stderr == "", res.stderr
    assert "(1 train, 0 val points; left out 3 NaN, infinite or out-of-range" in res.stdout
    log.write_text('{"step": 1, "train_loss": NaN}\n{"step": 2, "val_loss": Infinity}\n')
    one_line(cli("plot", log, "--out", tmp_path / "b.png"), "no loss to plot")
    log.write_text('{"step": 1, "train_loss": ' + "9" * 5000 + "}\n")
    one_line(cli("plot", log, "--out", tmp_path / "c.png"), "line 1 is not JSON")
    assert sorted(os.listdir(tmp_path)) == ["a.png", "log.jsonl"]


@pytest.mark.parametrize("field", ['"label": 1.9', '"label": true', '"label": "x"'])
def test_hellaswag_jsonl_is_read_strictly(tmp_path, field):
    from conftest import cli
    line = '{"ctx": "A man", "endings": ["a", "b", "c", "d"], ' + field + '}\n'
    (tmp_path / "h.jsonl").write_text(line)
    one_line(cli("prepare", "--hellaswag", tmp_path / "h.jsonl", "--out", tmp_path / "o"),
             "h.jsonl:1: not a HellaSwag example")
    assert os.listdir(tmp_path) == ["h.jsonl"]


def test_transformers_config_is_read_strictly(tmp_path):
    from conftest import cli, fixture
    assert cli("convert", fixture("tiny_model.bin"), tmp_path / "hf").returncode == 0
    cfg = tmp_path / "hf" / "config.json"
    good = json.loads(cfg.read_text())
    for bad, expect in (([1], "not a JSON object"), ({**good, "n_layer": 2.0},
                                                      "n_layer 2.0 is not a whole number")):
        cfg.write_text(json.dumps(bad))
        one_line(cli("convert", tmp_path / "hf", tmp_path / "m.bin"), expect)
    assert not (tmp_path / "m.bin").exists()


def test_a_rank_failing_before_its_first_log_leaves_no_empty_o(tmp_path):
    """Under mpiexec every rank validates at once, so the rank that made -o need not be
    rank 0 (which holds the lock and removes it): the ranks agree whether the run made it.
    Rank 0 fails alone at step 1 (as a --peer-timeout does), before any log line."""
    from conftest import cli
    for i in range(3):  # (which rank makes -o is a race: a few runs meet both orders)
        out = tmp_path / f"o{i}"
        res = cli(*TINY, "-n", "3", "-o", out, ranks=2, timeout=120,
                  env={"CUPYGPT_FAULT": "raise:1:0"})
        assert res.returncode != 0 and "injected fault on rank 0 at step 1" in res.stderr
        assert not out.exists(), os.listdir(out)


def test_the_rank_holding_the_lock_removes_an_o_another_rank_made(tmp_path):
    """The deterministic half of the race above: rank 0 found -o made (by rank 1, an
    instant earlier), so claim made none itself; the run made it all the same."""
    from types import SimpleNamespace
    from cupygpt.paths import unmake_dirs
    from cupygpt.train import rundir

    class Rank0:  # rank 0 of two, rank 1 having made -o
        rank = 0

        def any(self, flag):
            return True

        def bcast(self, obj, root=0):
            return obj
    out = tmp_path / "o"
    out.mkdir()
    opts = SimpleNamespace(out=str(out), resume=None, overwrite=False,
                           log_file=str(out / "log.jsonl"))
    rundir.unmake(opts, Rank0(), rundir.claim(opts, Rank0(), (0, 0, (0, "model.bin"))))
    unmake_dirs()  # (the CLI's, once the job's end is settled)
    assert not out.exists()


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
