"""A run that fails mid-way: a NaN loss, a rank raising, a rank killed, a hung peer, Ctrl-C;
each ends every rank, says what happened and keeps what can be resumed (test_resume.py:
resuming). The faults come through support/faulty_cli.py, whose malformed fault is the
run's one-line error."""
import os
import signal
import subprocess
import sys
import time

import pytest
from harness import ROOT, TINY, TRAIN, cli, mpiexec, one_line


@pytest.mark.parametrize("ranks", [None, 2])
def test_nan_loss_stops_keeping_the_last_good_checkpoint(tmp_path, ranks):
    good = cli(*TRAIN, "-n", "2", "--checkpoint-every", "2", "-o", tmp_path, ranks=ranks)
    assert good.returncode == 0, good.stderr
    bad = cli(*TRAIN, "-n", "8", "-l", "1e38", "-u", "0", "--checkpoint-every", "1",
              "--resume", tmp_path, "-o", tmp_path, ranks=ranks)
    assert bad.returncode != 0
    err = bad.stderr
    assert ("train loss is nan" in err or "train loss is inf" in err
            or "parameters are no longer finite" in err), err
    if "train loss" in err:
        assert f"(computed on rank {(ranks or 1) - 1}, the last stage)" in err
    assert "Last good checkpoint:" in err and "ckpt_00000002" in err
    assert open(tmp_path / "latest").read() == "ckpt_00000002"
    again = cli(*TRAIN, "-n", "4", "--resume", tmp_path, "-o", tmp_path / "r", ranks=ranks)
    assert again.returncode == 0, again.stderr


def test_a_rank_raising_ends_every_rank(tmp_path):
    res = cli(*TRAIN, "-n", "50", "-o", tmp_path, ranks=2, fault="raise:3:1",
              timeout=120)  # (a rank left waiting would run into the timeout)
    assert res.returncode != 0
    assert "injected fault on rank 1 at step 3" in res.stderr


def start(tmp_path, *extra):
    cmd = [mpiexec(), "-n", "2", sys.executable, os.path.join(ROOT, "cli.py"), *TRAIN,
           "-n", "10000", "-o", str(tmp_path), *extra]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines = []
    while not any("step    2/" in ln for ln in lines):
        line = p.stdout.readline()
        assert line, "".join(lines)
        lines.append(line)
    p.stdout_head = "".join(lines)
    return p


def rank_pids(tag, rank):
    """PIDs of our cli.py processes (their command line holds tag) of one MPI rank."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if tag.encode() in cmd and b"cli.py" in cmd and f"PMI_RANK={rank}".encode() in env:
            pids.append(int(pid))
    return pids


def finish(p, within):
    t0 = time.monotonic()
    out = p.communicate(timeout=within)[0]
    return out, time.monotonic() - t0


def test_killed_rank_ends_the_run(tmp_path):
    """MPICH's launcher reports the lost process by PID; each rank's start line maps its
    PID to its rank, so the lost rank is named."""
    p = start(tmp_path)
    victims = rank_pids(str(tmp_path), 1)
    assert len(victims) == 1
    os.kill(victims[0], signal.SIGKILL)
    out, took = finish(p, 30)
    assert p.returncode != 0 and took < 30
    assert f"PID {victims[0]} RUNNING" in out, out[-2000:]
    assert f"[pe1] rank 1 = stage 1 replica 0 shard 0 (pid {victims[0]})" in p.stdout_head
    assert not rank_pids(str(tmp_path), 0) and not rank_pids(str(tmp_path), 1), "no rank left"


def test_hung_peer_times_out_naming_what_it_waited_for(tmp_path):
    p = start(tmp_path, "--peer-timeout", "3")
    frozen = rank_pids(str(tmp_path), 0)
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    try:
        out, took = finish(p, 30)
    finally:
        for pid in frozen:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    assert p.returncode != 0 and took < 30
    line = next((ln for ln in out.splitlines() if "timed out after 3s" in ln), "")
    assert line.startswith("[pe1] error: rank 1: timed out after 3s waiting for"), out[-2000:]
    assert "rank 0" in line.split("waiting for")[1], line


def test_ctrl_c_checkpoints_and_exits_cleanly(tmp_path):
    p = start(tmp_path, "--checkpoint-every", "1000")
    os.killpg(p.pid, signal.SIGINT)
    out, took = finish(p, 60)
    assert p.returncode == 130, out[-2000:]
    assert "interrupted after step" in out and "resume from" in out
    step = int(out.split("interrupted after step ")[1].split(";")[0])
    assert open(tmp_path / "latest").read() == f"ckpt_{step:08d}"
    assert sorted(os.listdir(tmp_path / f"ckpt_{step:08d}")) == ["adamw.npz", "model.bin"]


def test_a_malformed_fault_hook_is_one_line(tmp_path):
    from harness import cli
    one_line(cli(*TINY, "-n", 1, "-o", tmp_path / "o", fault="raise:abc"),
             "fault 'raise:abc': give raise:STEP:RANK")
    assert os.listdir(tmp_path) == []
