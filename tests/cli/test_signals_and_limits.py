"""Never lose a user's data (issue 30), when a run stops or meets a limit: SIGTERM to one
rank, a second signal, a memory cgroup and `ulimit -v`, a disk without room, a log or trace
that cannot be written, weights that are not finite."""
import contextlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from harness import CLI, ROOT, cli, fixture, mpiexec, small_shard
from test_rank_failures import rank_pids
from test_resume import log_losses
from test_user_data import SHIPPED, TINY, one_line, shard  # noqa: F401 (fixture)

MODEL = fixture("tiny_model.bin")


def start(out, *extra):
    """A 2-stage run under mpiexec, once it has logged step 2 (lr constant: a resume with
    another -n follows the same schedule)."""
    cmd = [mpiexec(), "-n", "2", sys.executable, os.path.join(ROOT, "cli.py"), "train", "-b",
           "4", "-t", "32", "-v", "0", "-g", "0", "-k", "constant", "-n", "10000", "-o",
           str(out), *extra]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines = []
    while not any("step    2/" in ln for ln in lines):
        lines.append(p.stdout.readline())
        assert lines[-1], "".join(lines)
    return p


def sigterm_rank_1(out, *extra):
    """SIGTERM to rank 1 alone: (the step every rank stopped after, the output)."""
    p = start(out, *extra)
    victim, = rank_pids(str(out), 1)
    os.kill(victim, signal.SIGTERM)
    text = p.communicate(timeout=120)[0]
    assert p.returncode == 143, text[-2000:]  # 128 + SIGTERM, on every rank
    assert not rank_pids(str(out), 0) and not rank_pids(str(out), 1), "no rank left"
    return int(text.split("interrupted after step ")[1].split(";")[0]), text


def test_sigterm_to_one_rank_checkpoints_every_rank_and_resumes_bit_for_bit(tmp_path):
    run, full, part = tmp_path / "run", tmp_path / "full", tmp_path / "part"
    n, text = sigterm_rank_1(run, "--checkpoint-every", "1000")
    assert open(run / "latest").read() == f"ckpt_{n:08d}" and f"resume from {run}" in text
    flags = ["train", "-b", "4", "-t", "32", "-v", "0", "-g", "0", "-k", "constant", "-n",
             n + 2]
    a = cli(*flags, "-o", full, ranks=2)
    b = cli(*flags, "--resume", run / f"ckpt_{n:08d}", "-o", part, ranks=2)
    assert a.returncode == 0 and b.returncode == 0, (a.stderr, b.stderr)
    la, lr, lb = log_losses(full / "log.jsonl"), log_losses(run / "log.jsonl"), \
        log_losses(part / "log.jsonl")
    assert sorted(lr) == list(range(1, n + 1)) and all(lr[s] == la[s] for s in lr)
    assert sorted(lb) == [n + 1, n + 2] and all(lb[s] == la[s] for s in lb)  # bit for bit


def test_sigterm_without_checkpoints_writes_the_model_of_the_last_step(tmp_path):
    from cupygpt.formats.llmc import read_model
    n, text = sigterm_rank_1(tmp_path)
    assert f"wrote {tmp_path / 'model.bin'} of step {n}" in text
    assert max(log_losses(tmp_path / "log.jsonl")) == n
    assert np.isfinite(read_model(str(tmp_path / "model.bin"))[1]).all()


# `train` whose second checkpoint's optimizer state is held part-written: np.savez says
# "held", waits for the first signal's handler (the stop flag set), says "handled" and waits
# until the second's raises (polling: no wakeup is lost to a signal between two calls)
HELD = """
import runpy, signal, sys, time
import numpy as np
real, calls = np.savez, []
def savez(*a, **k):
    calls.append(1)
    if len(calls) == 1:
        return real(*a, **k)
    stop = signal.getsignal(signal.SIGTERM).__self__
    print("held", file=sys.stderr, flush=True)
    while not stop.hit:
        time.sleep(0.01)
    print("handled", file=sys.stderr, flush=True)
    while True:
        time.sleep(0.01)
np.savez = savez
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_a_second_signal_stops_at_once_leaving_nothing_half_written(tmp_path):
    """The first SIGTERM comes while checkpoint 2 is being written (its model.bin done, the
    optimizer's file open), the second once the first is handled: the run stops there,
    removing what it half wrote; checkpoint 1 stays whole, `latest` names it."""
    p = subprocess.Popen([sys.executable, "-c", HELD, CLI, *TINY, "-n", "100000",
                          "--checkpoint-every", "1", "-o", tmp_path], text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for said in ("held\n", "handled\n"):
        while (line := p.stderr.readline()) != said:
            assert line, p.communicate()
        p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGTERM and "SIGTERM again: stopping now" in err, err
    assert "Traceback" not in err and "ckpt_00000001" in out
    assert sorted(os.listdir(tmp_path)) == ["ckpt_00000001", "latest", "log.jsonl"]
    assert open(tmp_path / "latest").read() == "ckpt_00000001"
    assert sorted(os.listdir(tmp_path / "ckpt_00000001")) == ["adamw.npz", "model.bin"]


def test_a_signal_while_a_checkpoints_state_is_gathered_leaves_no_partial_directory(
        tmp_path):
    """The .partial directory was made before the weights were gathered: a second signal
    there left it empty (while saying nothing half-written is left)."""
    from cupygpt.comm.launch import Stopped
    from cupygpt.train.checkpoint import save

    class Run:
        def state_dict(self):
            raise Stopped(143)

    class Rank0:
        rank = 0
    with pytest.raises(Stopped):
        save(Run(), Rank0(), str(tmp_path), 4, {})
    assert os.listdir(tmp_path) == []


BIG = ["train", "--backend", "numpy", "-b", "128", "-t", "256", "-n", "1"]  # needs 3.03 GiB


def a_memory_cgroup(limit):
    """A child of this process's memory cgroup limited to `limit` bytes, or pytest.skip."""
    from cupygpt.backends.host_memory import _mounts
    mounts = _mounts(open("/proc/self/mountinfo").read())
    for line in open("/proc/self/cgroup"):
        _, controllers, path = line.strip().split(":", 2)
        version = "v2" if controllers == "" else "v1" if "memory" in controllers.split(",") \
            else None
        if version in mounts:
            d = os.path.join(mounts[version][0], path.lstrip("/"), f"cupygpt-test-{os.getpid()}")
            try:
                os.mkdir(d)
                with open(os.path.join(d, "memory.limit_in_bytes" if version == "v1"
                                       else "memory.max"), "w") as f:
                    f.write(str(limit))
                return d
            except OSError as e:
                pytest.skip(f"cannot make a memory cgroup under {path} ({e.strerror})")
    pytest.skip("no memory cgroup hierarchy is mounted here")


def test_a_run_beyond_its_memory_cgroup_is_refused_before_allocating(tmp_path):
    cg = a_memory_cgroup(2 << 30)

    def enter():
        with open(os.path.join(cg, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    try:
        t0 = time.monotonic()
        res = subprocess.run([sys.executable, CLI, *BIG, "-o", tmp_path / "o"],
                             capture_output=True, text=True, preexec_fn=enter, timeout=300)
    finally:
        os.rmdir(cg)
    line = one_line(res, "out of memory at start: rank 0 needs 3.03 GiB")
    assert "GiB of the memory this process's cgroup allows is free" in line, line
    assert time.monotonic() - t0 < 60
    assert not os.path.exists(tmp_path / "o")


def test_a_run_beyond_ulimit_v_is_refused_before_allocating(tmp_path):
    res = subprocess.run([sys.executable, CLI, *BIG, "-o", tmp_path / "o"],
                         capture_output=True, text=True, timeout=300, preexec_fn=lambda: (
                             resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))))
    one_line(res, "out of memory at start: rank 0 needs 3.03 GiB")
    # the limit that binds, not the host's free memory (21 GiB where 0.5 GiB was said)
    assert "GiB of the address space `ulimit -v` allows this process (2.00 GiB) is free" \
        in res.stderr, res.stderr
    assert not os.path.exists(tmp_path / "o")


@pytest.mark.parametrize("limit,args,said", [
    (resource.RLIMIT_NOFILE, 10, "too many open files (ulimit -n 10); raise the limit (ulimit -n "
                                 "4096), or give --workers 1"),
    (resource.RLIMIT_AS, 600 << 20, "out of memory while running; under `ulimit -v 614400` "
                                    "(0.59 GiB of address space): raise it (ulimit -v "
                                    "unlimited), or lower --workers or --shard-size")])
def test_prepare_meeting_a_limit_of_the_machine_names_what_to_change(tmp_path, limit, args,
                                                                      said):
    """Its pool past ulimit -n (a traceback), a shard past ulimit -v (advice to lower the
    batch size, which prepare has not): one line, nothing written."""
    text = os.path.join(ROOT, "README.md")
    shutil.copy(text, tmp_path / "again.md")  # (two inputs: one file twice is refused)
    res = subprocess.run([sys.executable, CLI, "prepare", text, tmp_path / "again.md",
                          "--shard-size", "100000000", "--workers", "2", "--out", tmp_path / "o"],
                         capture_output=True, text=True,
                         timeout=300, preexec_fn=lambda: resource.setrlimit(limit, (args, args)))
    one_line(res, said)
    assert not os.path.exists(tmp_path / "o")


def a_small_filesystem(path, size):
    path.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                         capture_output=True, text=True)
    if res.returncode:
        pytest.skip(f"cannot mount a small tmpfs here ({res.stderr.strip()})")
    return path


def test_a_disk_without_room_for_the_model_and_a_checkpoint_is_refused_before_step_1(tmp_path):
    small = a_small_filesystem(tmp_path / "small", "40m")
    try:
        preset = ["-e", "tiny", "-i", os.path.join(SHIPPED, "tiny_shakespeare_val.bin")]
        ok = cli(*TINY, *preset, "-n", "1", "-o", small / "a")  # the model (29 MB) fits
        assert ok.returncode == 0, ok.stderr
        res = cli(*TINY, *preset, "-n", "1", "--checkpoint-every", "1", "-o", small / "b")
        one_line(res, f"-o {small / 'b'}: its filesystem has ")
        assert "the final model and the 1 checkpoint(s) it holds at once" in res.stderr
        assert sorted(os.listdir(small)) == ["a"]
    finally:
        subprocess.run(["umount", str(small)])


def test_the_disk_check_counts_the_checkpoints_keep_holds(tmp_path):
    """tiny: a model of 29 MB, a checkpoint of 87 MB. On 250 MB, --keep 2 holds 3 at once
    while the third is written (290 MB: refused before step 1, not dying there); --keep 1
    holds 2 (203 MB) and runs."""
    small = a_small_filesystem(tmp_path / "small", "250m")
    try:
        preset = ["-e", "tiny", "-i", os.path.join(SHIPPED, "tiny_shakespeare_val.bin"),
                  "-n", "3", "--checkpoint-every", "1"]
        res = cli(*TINY, *preset, "--keep", "2", "-o", small / "a")
        one_line(res, "the 3 checkpoint(s) it holds at once: --keep's newest, the one being "
                      "written, -nm's); free some space, give another -o, or lower --keep")
        assert os.listdir(small) == []
        res = cli(*TINY, *preset, "--keep", "1", "-o", small / "b")
        assert res.returncode == 0, res.stderr
        # resumed: its kept checkpoint (87 MB) is one of the 2 counted, already on the disk
        # (134 MB free of the 203 it needs: refused, as a run a full disk stopped was)
        res = cli(*TINY, *preset[:-4], "-n", "4", "--checkpoint-every", "1", "--keep", "1",
                  "-o", small / "b", "--resume", small / "b")
        assert res.returncode == 0, res.stderr
        assert sorted(os.listdir(small / "b")) == ["ckpt_00000004", "latest", "log.jsonl",
                                                   "model.bin"]
    finally:
        subprocess.run(["umount", str(small)])


@pytest.mark.parametrize("every,keep,major,steps,held", [
    (0, 2, 0, 10, 0), (1, 2, 0, 1, 1), (1, 2, 0, 2, 2), (1, 2, 0, 100, 3), (3, 2, 0, 10, 3),
    (1, 1, 10, 100, 11), (5, 2, 10, 100, 11), (1, 2, 0, 10 ** 12, 3)])
def test_checkpoints_held_at_once(every, keep, major, steps, held):
    """While the last is written: --keep's newest before it, and -nm's older multiples."""
    from types import SimpleNamespace

    from cupygpt.train.rundir import checkpoints_held
    assert checkpoints_held(SimpleNamespace(checkpoint_every=every, keep=keep, steps=steps,
                                            checkpoint_major=major)) == held


def test_a_log_that_cannot_be_written_never_costs_the_model(tmp_path):
    small = a_small_filesystem(tmp_path / "small", "8k")
    try:
        res = cli(*TINY, "-n", "100", "--log-file", small / "log.jsonl", "-o", tmp_path / "o")
        assert "warning: cannot write the log" in res.stdout and "step  100/100" in res.stdout
        one_line(res, f"could not write the log {small / 'log.jsonl'}")
        assert "the model was written" in res.stderr and (tmp_path / "o" / "model.bin").exists()
    finally:
        subprocess.run(["umount", str(small)])


def test_a_log_that_a_full_disk_leaves_empty_is_not_left_to_refuse_the_rerun(tmp_path):
    small = a_small_filesystem(tmp_path / "small", "64k")
    try:
        with open(small / "fill", "wb") as f:  # the disk full before the first line
            with contextlib.suppress(OSError):
                f.write(b"\0" * (1 << 20))
        for out in ("a", "b"):  # the rerun meets the same disk, not an "exists" refusal
            res = cli(*TINY, "-n", "2", "--log-file", small / "log.jsonl", "-o", tmp_path / out)
            one_line(res, f"could not write the log {small / 'log.jsonl'} (No space left on "
                          f"device); the model was written: {tmp_path / out / 'model.bin'}")
            assert not (small / "log.jsonl").exists()
    finally:
        subprocess.run(["umount", str(small)])


def test_a_log_that_a_disk_fills_under_keeps_whole_lines_only(tmp_path):
    small = a_small_filesystem(tmp_path / "small", "64k")
    try:
        with open(small / "fill", "wb") as f:  # full, then one page freed: the log's room
            with contextlib.suppress(OSError):
                f.write(b"\0" * (1 << 20))
        os.truncate(small / "fill", os.path.getsize(small / "fill") - 4096)
        res = cli(*TINY, "-n", "40", "--log-file", small / "log.jsonl", "-o", tmp_path / "o")
        assert res.returncode == 1 and "could not write the log" in res.stderr, res.stderr
        text = (small / "log.jsonl").read_text()
        assert text.endswith("\n") and 0 < len(text) <= 4096, len(text)
        assert all("step" in json.loads(line) for line in text.splitlines())
        plot = cli("plot", small / "log.jsonl", "--out", tmp_path / "p.png")
        assert plot.returncode == 0, plot.stderr
    finally:
        subprocess.run(["umount", str(small)])


def test_a_trace_that_cannot_be_written_never_costs_the_model_or_the_result(tmp_path):
    from test_edge_cases import run
    rc, lines = run(*TINY[:1], *TINY[1:], "-n", "2", "--trace", tmp_path / "trace.json", "-o",
                    tmp_path / "o", full_disk_at="trace.json")
    assert rc == 1 and len(lines) == 1, lines
    assert lines[0].startswith("error: could not write the trace") and "disk full" in lines[0]
    assert (tmp_path / "o" / "model.bin").exists() and not (tmp_path / "trace.json").exists()
    rc, lines = run("bench", "--steps", "1", "--warmup", "0", "--trace", tmp_path / "bt.json",
                    "--out", tmp_path / "b.json", full_disk_at="bt.json")  # (bench's result)
    assert rc == 1 and lines[-1].startswith("error: could not write the trace") and \
        lines[-1].endswith(f"the result was written: {tmp_path / 'b.json'}"), lines
    assert json.loads((tmp_path / "b.json").read_text())["ms_per_step_median"] > 0


def with_nan(src, dst, where=5):
    from cupygpt.formats.llmc import read_model, write_model
    cfg, params = read_model(src)
    params = params.copy()
    params[where] = np.nan
    write_model(dst, cfg, params)
    return str(dst)


def test_non_finite_weights_are_named_by_every_command(tmp_path):
    bad = with_nan(MODEL, tmp_path / "bad.bin")
    said = "bad.bin: holds non-finite weights (NaN or inf)"
    one_line(cli("sample", "--model", with_nan(fixture("gpt2v_model.bin"), tmp_path / "bad.bin")),
             said)
    one_line(cli("verify", "--model", with_nan(MODEL, tmp_path / "bad.bin"), "--state",
                 fixture("tiny_debug_state.bin")), said)
    one_line(cli("train", "-e", bad, "-t", "32", "-i", small_shard(tmp_path / "s.bin"), "-j",
                 "", "-n", "1", "-o", tmp_path / "o"), said)
    assert not (tmp_path / "o").exists()


def test_a_model_whose_forward_overflows_is_named_by_every_command(tmp_path):
    """Finite weights of 3e38 give NaN logits: sample raised NumPy's ValueError, eval scored
    the share of label 0 (argmin over NaN) with bare NaN in its JSON, train told to lower
    -l."""
    from test_hellaswag import write_llmc_eval

    from cupygpt.formats.llmc import read_model, write_model
    for src, dst in ((MODEL, "huge.bin"), (fixture("gpt2v_model.bin"), "huge_v.bin")):
        shape, params = read_model(src)
        write_model(tmp_path / dst, shape, np.full_like(params, 3e38))
    one_line(cli("sample", "--model", tmp_path / "huge_v.bin", "--max-new-tokens", "8"),
             "the model's logits are not finite")
    write_llmc_eval(tmp_path / "h.bin", [(0, [1, 2], [[2], [3], [4], [5]])] * 4)
    one_line(cli("eval", tmp_path / "huge.bin", "--hellaswag", tmp_path / "h.bin"),
             f"{tmp_path / 'huge.bin'}: its losses are not finite on 4 of 4 examples")
    one_line(cli("train", "-e", tmp_path / "huge.bin", "-t", "32", "-i",
                 small_shard(tmp_path / "s.bin"), "-j", "", "-n", "1", "-o", tmp_path / "o"),
             f"step 1: train loss is nan with the weights this run started from "
             f"({tmp_path / 'huge.bin'}), before any update")


def test_a_resume_from_a_non_finite_checkpoint_renames_it_and_names_the_last_good(tmp_path):
    shard = small_shard(tmp_path / "s.bin")
    run = ["train", "-e", MODEL, "-b", "1", "-t", "16", "-i", shard, "-j", "", "-g", "0"]
    a = cli(*run, "-n", "2", "--checkpoint-every", "1", "-o", tmp_path / "o")
    assert a.returncode == 0, a.stderr
    newest = tmp_path / "o" / "ckpt_00000002"
    with_nan(newest / "model.bin", newest / "model.bin")
    # as a run that wrote those weights records them (else: another model.bin, damage)
    from test_resume import edit_meta

    from cupygpt.formats.checkpoint import model_digest
    edit_meta(newest, lambda m: {**m, "model_bin": model_digest(newest / "model.bin")})
    res = cli(*run, "-n", "4", "--resume", tmp_path / "o", "-o", tmp_path / "o")
    one_line(res, f"{newest / 'model.bin'}: holds non-finite weights (NaN or inf); renamed "
                  f"{newest}.nan. Last good checkpoint: {tmp_path / 'o' / 'ckpt_00000001'}")
    assert open(tmp_path / "o" / "latest").read() == "ckpt_00000001"
    assert (tmp_path / "o" / "ckpt_00000002.nan" / "model.bin").exists()
