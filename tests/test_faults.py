"""Faults: NaN, a rank raising, a rank killed, a hung peer, Ctrl-C; resume exactness."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, cli, mpiexec

TRAIN = ["train", "-b", "4", "-t", "32", "-v", "0", "-g", "0"]


def log_losses(path):
    return {r["step"]: r["train_loss"] for r in map(json.loads, open(path)) if "train_loss" in r}


@pytest.mark.parametrize("ranks,dtype", [(None, "fp32"), (2, "fp32"), (2, "bf16")])
def test_resume_is_bit_identical(tmp_path, ranks, dtype):
    """bf16 too: its master weights are kept and its stochastic rounding repeats."""
    full, part = tmp_path / "full", tmp_path / "part"
    samples = ["-s", "2", "-g", "6", "--dtype", dtype]  # before the checkpoint too: the RNG moves
    a = cli(*TRAIN, *samples, "-n", "8", "--checkpoint-every", "4", "--keep", "3", "-o", full,
            ranks=ranks)
    assert a.returncode == 0, a.stderr
    assert sorted(os.listdir(full / "ckpt_00000004")) == ["adamw.npz", "model.bin"]
    b = cli(*TRAIN, *samples, "-n", "8", "--resume", full / "ckpt_00000004", "-o", part,
            ranks=ranks)
    assert b.returncode == 0, b.stderr
    la, lb = log_losses(full / "log.jsonl"), log_losses(part / "log.jsonl")
    assert sorted(lb) == [5, 6, 7, 8]
    assert all(la[s] == lb[s] for s in lb), (la, lb)  # bit-identical, not approx
    assert (full / "model.bin").read_bytes() == (part / "model.bin").read_bytes()
    # the samples too: drawn on rank 0, whose RNG the checkpoint keeps
    def last_sample(out):  # (under mpiexec each line is tagged with its rank)
        return re.findall(r"generating:\n(?:\[pe0\] )?---\n(.*?)\n(?:\[pe0\] )?---", out,
                          re.S)[-1]
    assert last_sample(a.stdout) == last_sample(b.stdout)


def test_resume_mismatch_is_refused(tmp_path):
    a = cli(*TRAIN, "-n", "2", "--checkpoint-every", "2", "-o", tmp_path)
    assert a.returncode == 0, a.stderr
    for extra, what in ((["-t", "16"], "T: checkpoint 32 vs now 16"),
                        (["-b", "2"], "B: checkpoint 4 vs now 2"),
                        (["-d", "256"], "total_batch: checkpoint 128 vs now 256"),
                        (["--dtype", "bf16"], "dtype: checkpoint fp32 vs now bf16")):
        res = cli(*TRAIN, "-n", "4", "--resume", tmp_path, *extra, "-o", tmp_path / "x")
        assert res.returncode == 1 and what in res.stderr and len(res.stderr.splitlines()) == 1
    (tmp_path / "ckpt_00000002" / "adamw.npz").unlink()
    res = cli(*TRAIN, "-n", "4", "--resume", tmp_path, "-o", tmp_path / "x")
    assert res.returncode == 1 and "no adamw.npz beside model.bin: not a checkpoint" in res.stderr


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
    res = cli(*TRAIN, "-n", "50", "-o", tmp_path, ranks=2, env={"CUPYGPT_FAULT": "raise:3:1"},
              timeout=120)  # (a rank left waiting would run into the timeout)
    assert res.returncode != 0
    assert "injected fault on rank 1 at step 3" in res.stderr


def start(tmp_path, *extra):
    cmd = [mpiexec(), "-n", "2", sys.executable, os.path.join(ROOT, "cli.py"), *TRAIN, "-n", "10000",
           "-o", str(tmp_path), *extra]
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


def test_resume_takes_the_newest_complete_checkpoint_and_refuses_damage(tmp_path):
    run = tmp_path / "run"
    a = cli(*TRAIN, "-n", "4", "--checkpoint-every", "2", "-o", run)
    assert a.returncode == 0, a.stderr
    # what a run killed mid-checkpoint leaves: latest one behind, a .tmp, a .partial
    (run / "latest").write_text("ckpt_00000002")
    (run / "latest.abc123.tmp").write_text("ckpt_000")
    (run / "ckpt_00000006.partial").mkdir()
    b = cli(*TRAIN, "-n", "5", "--resume", run, "--checkpoint-every", "1", "-o", run)
    assert b.returncode == 0, b.stderr
    assert "| start step              | 4 " in b.stdout
    assert not (run / "latest.abc123.tmp").exists()
    assert not (run / "ckpt_00000006.partial").exists()
    other = cli(*TRAIN, "-n", "6", "--resume", run, "-e", "d12", "-o", run)  # (tiny: its own)
    assert other.returncode == 1 and "-e d12: a resumed run continues its checkpoint's own" \
        " model" in other.stderr and "of another shape" in other.stderr, other.stderr
    newest = run / "ckpt_00000005" / "adamw.npz"
    good = newest.read_bytes()
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0xFF
    for damage in (bytes(flipped), good[:len(good) // 3], os.urandom(len(good))):
        newest.write_bytes(damage)
        res = cli(*TRAIN, "-n", "6", "--resume", run, "-o", run)
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 1 and len(lines) == 1, res.stderr
        assert f"{newest}: damaged checkpoint file" in lines[0]
        assert f"the previous checkpoint {run / 'ckpt_00000004'} can be resumed" in lines[0]
        assert "allow_pickle" not in lines[0]


def test_sample_every_zero_means_never(tmp_path):
    never = cli(*TRAIN, "-n", "2", "-g", "4", "-s", "0", "-o", tmp_path)
    at_end = cli(*TRAIN, "-n", "2", "-g", "4", "-o", tmp_path, "--overwrite")
    assert never.returncode == 0 and at_end.returncode == 0, (never.stderr, at_end.stderr)
    assert "generating" not in never.stdout and at_end.stdout.count("generating:") == 1
