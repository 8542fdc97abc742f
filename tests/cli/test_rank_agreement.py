"""Ranks that must agree: given other flags they refuse together in one line naming the
flag; a rank failing alone at the start is heard, and removes nothing the others still
use; ranks failing together print the first failure."""
import os
import subprocess
import sys

import pytest

from harness import SIM, error_line, requires_sim, CLI, ROOT, mpiexec

TRAIN = ["train", "-b", "2", "-t", "32", "-v", "0", "-s", "0", "-g", "0"]  # a short run
SHARD = os.path.join(ROOT, "cupygpt", "data", "tiny_shakespeare_val.bin")


# --- M009-M016: ranks given other flags; a rank failing alone --------------------------

def mpmd(*per_rank, cwds=(None, None), envs=({}, {}), timeout=120):
    """`mpiexec -n 1 ARGS0 : -n 1 ARGS1`, each rank in its own directory and with its own
    environment variables when given."""
    cmd = [mpiexec()]
    for i, (args, cwd, env) in enumerate(zip(per_rank, cwds, envs)):
        cmd += ([":"] if i else []) + ["-n", "1"] + (["-wdir", str(cwd)] if cwd else []) + \
            [a for k, v in env.items() for a in ("-env", k, v)] + \
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
    line = error_line(res)
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
