"""The adversarial run's failures (/work/adv-report.md's F1-F6), each through the general
mechanism it lacked: a file a run appends to is claimed as -o is; a removed working
directory, a file-size limit and a damaged outlier window are one line; ranks given other
flags refuse together, and a rank failing alone is heard and removes nothing the others
still use."""
import errno
import json
import os
import resource
import signal
import subprocess
import sys

import numpy as np
import pytest

from conftest import CLI, ROOT, cli, mpiexec

TRAIN = ["train", "-b", "2", "-t", "32", "-v", "0", "-s", "0", "-g", "0"]
SHARD = os.path.join(ROOT, "cupygpt", "data", "tiny_shakespeare_val.bin")


def one_line(res):
    """The command's one error line (no traceback), with exit 1."""
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1 and len(lines) == 1, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    return lines[0]


# --- C001: a --log-file two runs share ------------------------------------------------

def test_a_log_file_another_run_writes_is_refused_naming_its_pid(tmp_path):
    log = tmp_path / "shared.jsonl"
    first = subprocess.Popen([sys.executable, CLI, *TRAIN, "-n", "100000", "-o", tmp_path / "a",
                              "--log-file", log], stdout=subprocess.PIPE, text=True,
                             stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        seen = []
        while not any(line.startswith("step    1/") for line in seen):
            seen.append(first.stdout.readline())
            assert seen[-1], "".join(seen)
        second = cli(*TRAIN, "-n", "1", "-o", tmp_path / "b", "--log-file", log, "--overwrite")
        line = one_line(second)
        assert f"--log-file {log}: another command (pid {first.pid}) is writing this file" \
            in line, line
        assert not (tmp_path / "b").exists(), "the refused run left its -o"
        assert "num_parameters" not in second.stdout, "refused after allocating"
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=120)
    assert [json.loads(x)["step"] for x in open(log)][0] == 1  # whole lines, the first's


def test_a_run_failing_before_its_first_step_leaves_no_log_it_claimed(tmp_path):
    log = tmp_path / "logs" / "l.jsonl"
    res = cli(*TRAIN, "-n", "2", "-o", tmp_path / "o", "--log-file", log,
              env={"CUPYGPT_FAULT": "raise:1:0"})
    assert res.returncode == 1 and "injected fault on rank 0 at step 1" in res.stderr
    assert not log.exists() and not (tmp_path / "o").exists() and not log.parent.exists()


def test_a_resumed_run_holds_its_rewritten_log(tmp_path):
    """A resume rewrites the log (atomic_write: a new file under the path); the new file is
    the one held."""
    from cupygpt.log import open_log
    from cupygpt.paths import hold
    log = tmp_path / "log.jsonl"
    log.write_text('{"step": 1, "train_loss": 1.0}\n{"step": 2, "train_loss": 2.0}\n')
    with open_log(str(log), 1) as f:
        pid = os.fork()
        if pid == 0:  # (another process: a process's own flocks do not refuse it)
            os._exit(0 if hold(str(log))[2] else 1)
        assert os.waitpid(pid, 0)[1] == 0, "the rewritten log is not held"
        f.write('{"step": 2, "train_loss": 3.0}\n')
    assert log.read_text() == '{"step": 1, "train_loss": 1.0}\n{"step": 2, "train_loss": 3.0}\n'



# --- V102, X015: a working directory removed under the shell ---------------------------

@pytest.mark.parametrize("command", [["train", "-n", "2"], ["bench", "--steps", "1"],
                                     ["sample"], ["schedule"]])
def test_a_removed_working_directory_is_one_line(tmp_path, command):
    gone = tmp_path / "gone"
    gone.mkdir()
    script = ("import os, sys; os.chdir(sys.argv[1]); os.rmdir(sys.argv[1]); "
              "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])")
    res = subprocess.run([sys.executable, "-c", script, gone, CLI, *command],
                         capture_output=True, text=True, timeout=120)
    assert one_line(res) == "error: the current directory no longer exists: cd to one " \
                            "that does"


# --- V106-V110: a file-size limit (ulimit -f, EFBIG) ------------------------------------

def limited(size):
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))


def run_limited(size, *args, cwd=None):
    return subprocess.run([sys.executable, CLI, *map(str, args)], capture_output=True,
                          text=True, timeout=300, preexec_fn=limited(size), cwd=cwd)


def test_train_refuses_a_file_size_limit_below_its_files_before_step_1(tmp_path):
    # the CPU's default model: model.bin 27.7 MiB (fp32), a checkpoint's adamw.npz 56.4 MiB
    res = run_limited(1 << 20, *TRAIN, "-n", "2", "-o", tmp_path / "m")
    line = one_line(res)
    assert "this run writes model.bin of" in line and "ulimit -f 1024" in line, line
    assert "step" not in res.stdout and not (tmp_path / "m").exists()
    res = run_limited(40 << 20, *TRAIN, "-n", "2", "--checkpoint-every", "1",
                      "-o", tmp_path / "c")
    assert "this run writes a checkpoint's adamw.npz of" in one_line(res)
    assert not (tmp_path / "c").exists()


def test_a_write_past_the_file_size_limit_is_one_line_naming_the_file(tmp_path):
    text = os.path.join(ROOT, "cupygpt", "data", "tinyshakespeare.txt")
    res = run_limited(10 << 10, "prepare", text, "--out", tmp_path / "p")
    line = one_line(res)
    assert "over the file-size limit (ulimit -f) while writing it; nothing was written " \
           "there: raise it (ulimit -f unlimited)" in line, line
    assert "tinyshakespeare_" in line and not (tmp_path / "p").exists()
    model = os.path.join(ROOT, "cupygpt", "reference", "tiny_model.bin")
    res = run_limited(100 << 10, "convert", model, tmp_path / "hf")  # (safetensors' error)
    assert f"{tmp_path / 'hf'}: over the file-size limit (ulimit -f)" in one_line(res)
    assert not (tmp_path / "hf").exists()


def test_atomic_write_words_efbig_as_the_limit():
    from cupygpt import CupyGPTError
    from cupygpt.paths import atomic_write, full
    assert full(OSError(errno.EFBIG, "File too large"))
    assert full(RuntimeError("I/O error: File too large (os error 27)"))
    with pytest.raises(CupyGPTError, match=r"^x.bin: over the file-size limit \(ulimit -f\)"):
        with atomic_write("x.bin"):
            raise OSError(errno.EFBIG, "File too large")
    assert os.listdir(".") == []


# --- R04f, M018: a checkpoint's damaged outlier window ----------------------------------

def test_a_damaged_outlier_window_is_a_damaged_checkpoint_before_loading(tmp_path):
    out = tmp_path / "run"
    res = cli(*TRAIN, "-n", "2", "--checkpoint-every", "2", "-sl", "3", "-o", out)
    assert res.returncode == 0, res.stderr
    state = out / "ckpt_00000002" / "adamw.npz"
    with np.load(state) as z:
        arrays = dict(z)
    meta = json.loads(str(arrays["meta"]))
    meta["outliers"]["loss"]["buffer"] = ["x"]
    np.savez(state, **{**arrays, "meta": np.array(json.dumps(meta))})
    res = cli(*TRAIN, "-n", "3", "--resume", out, "-o", out)
    line = one_line(res)
    assert f"{state}: damaged checkpoint file (its outlier detectors' window" in line, line
    assert "num_parameters" not in res.stdout, "refused after loading the model"


@pytest.mark.parametrize("damage", [
    {"loss": {"buffer": ["x"], "index": 0, "sum": 0.0, "sum_sq": 0.0}},
    {"loss": {"buffer": [1.0], "index": "0", "sum": 1.0, "sum_sq": 1.0}},
    {"loss": {"buffer": [1.0], "index": 0, "sum": None, "sum_sq": 1.0}},
    {"loss": {"buffer": [1.0] * 129, "index": 0, "sum": 1.0, "sum_sq": 1.0}},
    {"loss": {"buffer": [1.0], "index": 200, "sum": 1.0, "sum_sq": 1.0}},
    {"loss": {"buffer": [True], "index": 0, "sum": 1.0, "sum_sq": 1.0}},
    {"loss": []}, {"bogus": {}}, [1, 2]])
def test_outlier_state_is_read_strictly(damage):
    from cupygpt.formats.checkpoint import outliers_ok
    from cupygpt.train.outlier import OutlierDetector
    assert not outliers_ok(damage)
    good = OutlierDetector()
    for x in (1.0, 2.0):
        good.update(x)
    assert outliers_ok({"loss": good.state(), "norm": OutlierDetector().state()})
    assert outliers_ok(None)


# --- M009-M016: ranks given other flags; a rank failing alone --------------------------

def mpmd(*per_rank, cwds=(None, None), timeout=120):
    """`mpiexec -n 1 ARGS0 : -n 1 ARGS1`, each rank in its own directory when given."""
    cmd = [mpiexec()]
    for i, (args, cwd) in enumerate(zip(per_rank, cwds)):
        cmd += ([":"] if i else []) + ["-n", "1"] + (["-wdir", str(cwd)] if cwd else []) + \
            [sys.executable, CLI, *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


def no_rank_left(tag):
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        assert not (tag.encode() in cmd and b"cli.py" in cmd), f"rank {pid} left running"


@pytest.mark.parametrize("flag, a, b", [("-b", 4, 8), ("-l", 0.001, 0.1), ("-o", "x", "y"),
                                        ("-i", SHARD, SHARD + "*")])
def test_ranks_given_other_flags_refuse_in_one_line(tmp_path, flag, a, b):
    base = [*TRAIN, "-n", "2", "--micro-batches", "2"]
    if flag != "-o":
        base += ["-o", tmp_path / "o"]
    res = mpmd([*base, flag, a], [*base, flag, b])
    line = one_line(res)
    assert line == f"error: ranks disagree on {flag}: rank 0 has {a!r}, rank 1 has {b!r}; " \
                   f"give every rank the same flags", line
    assert os.listdir(tmp_path) == [] and os.listdir(".") == []  # (-o x, -o y: here)
    no_rank_left(str(tmp_path))


def test_a_rank_failing_alone_at_start_is_heard_and_removes_its_o(tmp_path):
    """Both ranks are given the same flags, but rank 1's -i (a node-local path: here its
    own working directory) has a byte too many: rank 1 fails alone, after -o is claimed.
    Its line is printed; rank 0, still starting, keeps its -o until the job's end is
    settled, then nothing is left."""
    for rank, extra in (("0", b""), ("1", b"x")):
        (tmp_path / rank).mkdir()
        (tmp_path / rank / "s.bin").write_bytes(open(SHARD, "rb").read() + extra)
    args = [*TRAIN, "-n", "2", "--micro-batches", "2", "-i", "s.bin", "-o", tmp_path / "o"]
    res = mpmd(args, args, cwds=(tmp_path / "0", tmp_path / "1"))
    assert res.returncode != 0
    assert "[pe1] error: s.bin: token shard file is 66561 bytes but its header implies " \
           "66560 (trailing data)" in res.stderr, res.stderr[-3000:]
    assert "Traceback" not in res.stderr + res.stdout, res.stderr[-3000:]
    assert not (tmp_path / "o").exists(), os.listdir(tmp_path / "o")
    no_rank_left(str(tmp_path))


def test_ranks_failing_together_print_the_first_failure(tmp_path):
    """Rank 1 fails; rank 0 fails a moment later on what rank 1's failure did to it (within
    fail's window): the line printed is rank 1's, the cause."""
    script = ("import sys, time; from cupygpt.comm.launch import fail, start_mpi, world_rank;"
              "start_mpi(60); r = world_rank(); time.sleep(0.3 * (r == 0));"
              "fail(f'error: rank {r} failed')")
    res = subprocess.run([mpiexec(), "-n", "2", sys.executable, "-c", script],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 1 and res.stderr.strip() == "[pe1] error: rank 1 failed", \
        res.stderr
