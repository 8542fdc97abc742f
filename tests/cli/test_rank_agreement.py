"""Ranks that must agree: given other flags they refuse together in one line naming the
flag; a rank failing alone at the start is heard, and removes nothing the others still
use; ranks failing together print the first failure."""
import os
import subprocess
import sys

import pytest
from harness import CLI, FAULTY_CLI, ROOT, SIM, error_line, mpiexec, requires_sim

from cupygpt.config.fields import held

TRAIN = ["train", "-b", "2", "-t", "32", "-v", "0", "-s", "0", "-g", "0"]  # a short run
SHARD = os.path.join(ROOT, "cupygpt", "data", "tiny_shakespeare_val.bin")
TRAIN_SHARD = os.path.join(ROOT, "cupygpt", "data", "tiny_shakespeare_train.bin")


# --- M009-M016: ranks given other flags; a rank failing alone --------------------------

def mpmd(*per_rank, cwds=(None, None), envs=({}, {}), timeout=120, clis=(CLI, CLI)):
    """`mpiexec -n 1 ARGS0 : -n 1 ARGS1`, each rank in its own directory and with its own
    environment variables when given (clis: each rank's script and the words before ARGS)."""
    cmd = [mpiexec()]
    for i, (args, cwd, env, cli) in enumerate(zip(per_rank, cwds, envs, clis)):
        cmd += ([":"] if i else []) + ["-n", "1"] + (["-wdir", str(cwd)] if cwd else []) + \
            [a for k, v in env.items() for a in ("-env", k, v)] + \
            [sys.executable, *([cli] if isinstance(cli, str) else cli), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


def no_rank_left(tag):
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        assert not (tag.encode() in cmd and b"cli.py" in cmd), f"rank {pid} left running"


def shown(flag, value):
    """A value as the refusal shows it: an output's real path, an input's content."""
    if flag == "-o":
        return repr(os.path.realpath(value))
    return held(value) if flag == "-i" else repr(value)


@pytest.mark.parametrize("flag, a, b", [("-b", 4, 8), ("-l", 0.001, 0.1), ("-o", "x", "y"),
                                        ("-i", SHARD, TRAIN_SHARD)])
def test_ranks_given_other_flags_refuse_in_one_line(tmp_path, flag, a, b):
    base = [*TRAIN, "-n", "2", "--micro-batches", "2"]
    if flag != "-o":
        base += ["-o", tmp_path / "o"]
    res = mpmd([*base, flag, a], [*base, flag, b])
    line = error_line(res)
    assert line == f"error: ranks disagree on {flag}: rank 0 has {shown(flag, a)}, rank 1 " \
                   f"has {shown(flag, b)}; give every rank the same flags and the same " \
                   f"files", line
    assert os.listdir(tmp_path) == [] and os.listdir(".") == []  # (-o x, -o y: here)
    no_rank_left(str(tmp_path))


@pytest.mark.parametrize("where", [-1, 1024, 33000])  # (a byte of the end, the start, between)
def test_ranks_reading_other_files_under_one_path_refuse_together(tmp_path, where):
    """Node-local data (here each rank's own working directory): the same -i names a shard
    of other tokens on rank 1, or the same shard with the two ranks naming it differently
    (relative, absolute) and -o likewise: the first is refused by what the files hold,
    before anything is made; the second runs."""
    for rank in "01":
        (tmp_path / rank).mkdir()
    data = bytearray(open(SHARD, "rb").read())
    (tmp_path / "0" / "s.bin").write_bytes(data)
    data[where] ^= 1  # (one token's low bit)
    (tmp_path / "1" / "s.bin").write_bytes(data)
    args = [*TRAIN, "-n", "2", "--micro-batches", "2", "-i", "s.bin", "-o", tmp_path / "o"]
    res = mpmd(args, args, cwds=(tmp_path / "0", tmp_path / "1"))
    line = error_line(res)
    assert line.startswith("error: ranks disagree on -i: rank 0 has <1 file: 66,560 bytes, "
                           "hash "), line
    assert line.count("<1 file: 66,560 bytes") == 2 and "the same files" in line, line
    assert not (tmp_path / "o").exists()
    res = mpmd([*args[:-1], "o"], [*args[:-3], tmp_path / "0" / "s.bin", "-o",
                                     tmp_path / "0" / "o"], cwds=(tmp_path / "0", tmp_path))
    assert res.returncode == 0, res.stderr[-3000:]
    assert (tmp_path / "0" / "o" / "model.bin").exists() and not (tmp_path / "o").exists()
    no_rank_left(str(tmp_path))


def test_a_rank_failing_alone_at_start_is_heard_and_removes_its_o(tmp_path):
    """Both ranks are given the same flags, but rank 1 cannot start (its own memory, disk
    or files: here an injected fault) as its loop is made, after -o is claimed. Its line is
    printed; rank 0, still starting, keeps its -o until the job's end is settled, then
    nothing is left."""
    args = [*TRAIN, "-n", "2", "--micro-batches", "2", "-o", tmp_path / "o"]
    res = mpmd(args, args, clis=(CLI, (FAULTY_CLI, "start:1")))
    assert res.returncode != 0
    assert "[pe1] error: rank 1 cannot start (an injected fault)" in res.stderr, \
        res.stderr[-3000:]
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


@requires_sim
def test_ranks_whose_machines_resolve_the_same_flags_differently_refuse_together(tmp_path):
    """Rank 1 sees a GPU (cudasim's), rank 0 none: the same flags choose another backend,
    model and T. They refused nothing and waited on each other until --peer-timeout; the
    settings as resolved are compared too."""
    base = [*TRAIN, "-n", "2", "--micro-batches", "2", "-o", tmp_path / "o"]
    gpu = {"PYTHONPATH": os.pathsep.join([SIM, ROOT]),
           "PATH": os.pathsep.join([os.path.join(SIM, "bin"), os.environ["PATH"]])}
    res = mpmd(base, base, envs=({}, gpu))
    line = error_line(res)
    assert line == ("error: the ranks' settings differ once each resolved its defaults on its "
                    "own machine (backend in use: rank 0 has 'numpy', rank 1 has 'cuda'); give "
                    "every rank the same kind of machine, or the setting itself"), line
    assert os.listdir(tmp_path) == []
    no_rank_left(str(tmp_path))


def test_ranks_under_other_locales_agree_on_one_name(tmp_path):
    """-o 'ü' decodes to other strings under a C locale with UTF-8 mode off: the same bytes
    are one name (they were refused as flags that differ)."""
    args = [*TRAIN, "-n", "1", "--micro-batches", "2", "-o", tmp_path / "ü"]
    c_locale = {"LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    res = mpmd(args, args, envs=({}, c_locale))
    assert res.returncode == 0, res.stderr[-3000:]
    assert os.listdir(tmp_path / "ü") and os.listdir(tmp_path) == ["ü"]


def test_a_rank_that_never_comes_to_the_starts_comparison_ends_the_job_in_the_peer_timeout():
    """Rank 1 stopped (here asleep) before the ranks compare their flags: mpi4py's
    allgather waited for good, --peer-timeout bounded only MPI's own start."""
    import time
    script = ("import time; from cupygpt import CupyGPTError; from cupygpt.comm.launch import "
              "every_rank, fail, start_mpi, world_rank; start_mpi(2); r = world_rank()\n"
              "if r == 1: time.sleep(60)\n"
              "try: every_rank(r)\n"
              "except CupyGPTError as e: fail(f'error: {e}')")
    t0 = time.monotonic()
    res = subprocess.run([mpiexec(), "-n", "2", sys.executable, "-c", script],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and res.stderr.strip().splitlines()[0] == (
        "[pe0] error: rank 0: timed out after 2s waiting for the other ranks at the command's "
        "start (the peer timeout); is every rank alive?"), res.stderr
    assert time.monotonic() - t0 < 20


def test_a_fifo_as_an_input_under_mpiexec_is_refused_not_opened(tmp_path):
    """The ranks comparing their inputs opened the FIFO to hash it, and every rank blocked
    there, before any check or timeout."""
    os.mkfifo(tmp_path / "f.bin")
    args = [*TRAIN, "-n", "1", "-i", tmp_path / "f.bin", "-o", tmp_path / "o"]
    res = mpmd(args, args, timeout=60)
    assert error_line(res) == f"error: {tmp_path / 'f.bin'}: is a FIFO, not a regular file; " \
                              f"give a token shard file", res.stderr
    no_rank_left(str(tmp_path))
