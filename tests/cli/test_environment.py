"""What a run meets from outside it: another run writing the same --log-file (the log is
claimed as -o is), a working directory removed under the shell, a file-size limit
(ulimit -f): each one line and a non-zero exit, nothing left behind."""
import errno
import json
import os
import resource
import signal
import subprocess
import sys

import pytest
from harness import CLI, ROOT, cli, error_line

TRAIN = ["train", "-b", "2", "-t", "32", "-v", "0", "-s", "0", "-g", "0"]  # a short run
SHARD = os.path.join(ROOT, "cupygpt", "data", "tiny_shakespeare_val.bin")


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
        line = error_line(second)
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
              fault="raise:1:0")
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
    assert error_line(res) == "error: the current directory no longer exists: cd to one " \
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
    line = error_line(res)
    assert "this run writes model.bin of" in line and "ulimit -f 1024" in line, line
    assert "step" not in res.stdout and not (tmp_path / "m").exists()
    res = run_limited(40 << 20, *TRAIN, "-n", "2", "--checkpoint-every", "1",
                      "-o", tmp_path / "c")
    assert "this run writes a checkpoint's adamw.npz of" in error_line(res)
    assert not (tmp_path / "c").exists()


def test_a_write_past_the_file_size_limit_is_one_line_naming_the_file(tmp_path):
    text = os.path.join(ROOT, "cupygpt", "data", "tinyshakespeare.txt")
    res = run_limited(10 << 10, "prepare", text, "--out", tmp_path / "p")
    line = error_line(res)
    assert "over the file-size limit (ulimit -f) while writing it; nothing was written " \
           "there: raise it (ulimit -f unlimited)" in line, line
    assert "tinyshakespeare_" in line and not (tmp_path / "p").exists()
    model = os.path.join(ROOT, "cupygpt", "reference", "tiny_model.bin")
    res = run_limited(100 << 10, "convert", model, tmp_path / "hf")  # (safetensors' error)
    assert f"{tmp_path / 'hf'}: over the file-size limit (ulimit -f)" in error_line(res)
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


def test_a_launchers_variable_left_set_is_one_line(tmp_path):
    """OMPI_COMM_WORLD_SIZE=2 without mpiexec: the one-process world was indexed as two (an
    IndexError's traceback)."""
    res = cli("train", "-n", "1", "-o", tmp_path / "o",
              env={"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"})
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.strip().splitlines()[-1] == (  # (after mpi4py's own warning, if any)
        "error: the environment says this is one of 2 ranks, and MPI's world has 1: a "
        "launcher's variable (PMI_SIZE, OMPI_COMM_WORLD_SIZE, ...) left set; unset it, or "
        "start the command with mpiexec"), res.stderr
    assert not (tmp_path / "o").exists()


def test_text_the_output_encoding_cannot_hold_is_escaped(tmp_path):
    """PYTHONIOENCODING=latin-1 and a prompt in Japanese: a UnicodeEncodeError."""
    from harness import fixture
    res = cli("sample", "--model", fixture("gpt2v_model.bin"), "--prompt", "日本",
              "--max-new-tokens", "2", env={"PYTHONIOENCODING": "latin-1"})
    assert res.returncode == 0, res.stderr
    assert "\\u65e5\\u672c" in res.stdout


def test_a_launchers_variable_that_is_no_number_is_one_line(tmp_path):
    """(int() of it was a ValueError's traceback)"""
    res = cli("train", "-n", "1", "-o", tmp_path / "o", env={"OMPI_COMM_WORLD_SIZE": "abc"})
    assert error_line(res) == ("error: OMPI_COMM_WORLD_SIZE='abc' is no number of ranks: a "
                               "launcher's variable set by hand? unset it, or start the "
                               "command with mpiexec"), res.stderr
    assert not (tmp_path / "o").exists()
