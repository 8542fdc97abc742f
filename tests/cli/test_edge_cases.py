"""What a new user trips on (issue 21) beyond one-line refusals (test_bad_input.py): a full
disk leaves nothing half-made, logs restart or continue, re-running a resume, defaults."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from harness import ROOT, cli, fixture

from cupygpt.log import Log

TEXT = os.path.join(ROOT, "data", "tinyshakespeare.txt")
TRAIN = ["train", "--backend", "numpy", "-b", "1", "-t", "16", "-v", "0", "-g", "0"]


# The CLI in a process of its own (in-process, tiktoken can break after NVRTC is loaded by
# another test), with FULL_DISK_AT: writing (at its fsync) a file whose name holds it fails
# as on a full disk.
BOOT = """import errno, os
at = os.environ.get("FULL_DISK_AT")
real = os.fsync

def fsync(fd):
    if at and at in os.readlink(f"/proc/self/fd/{fd}"):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return real(fd)
os.fsync = fsync
from cupygpt.cli.main import main
main()
"""


def run(*args, full_disk_at="", cwd=None):
    """(exit code, stderr lines)"""
    env = {**os.environ, "FULL_DISK_AT": full_disk_at,
           "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    res = subprocess.run([sys.executable, "-c", BOOT, *map(str, args)], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=300)
    return res.returncode, [ln for ln in res.stderr.splitlines() if ln.strip()]


@pytest.mark.parametrize("args,at,final", [
    (["prepare", TEXT, "--name", "x"], "x_train.bin", []),           # val written, not kept
    (TRAIN + ["-n", "1"], "model.bin", ["log.jsonl"]),  # the steps' log is whole
    (TRAIN + ["-n", "2", "--checkpoint-every", "2"], "adamw.npz", ["log.jsonl"]),
], ids=["prepare", "train model", "checkpoint"])
def test_a_full_disk_is_named_and_leaves_nothing_half_made(tmp_path, args, at, final):
    rc, lines = run(*args, "-o" if args[0] == "train" else "--out", tmp_path, full_disk_at=at)
    assert rc == 1 and len(lines) == 1, lines
    assert lines[0].startswith("error: ") and f"{at}: disk full" in lines[0], lines
    assert "nothing was written there" in lines[0]
    assert sorted(os.listdir(tmp_path)) == final  # no shard, model, .partial or .tmp


def test_a_tiny_context_writes_its_model_and_says_why_no_sample(tmp_path):
    res = cli("train", "--backend", "numpy", "-b", "1", "-t", "1", "-n", "2", "-o", tmp_path)
    assert res.returncode == 0, res.stderr
    assert "note: -t 1 leaves no room after the start token: no samples" in res.stdout
    assert (tmp_path / "model.bin").exists()


def steps_logged(out):
    return [(r["step"], "val" if "val_loss" in r else "train")
            for r in map(json.loads, open(out / "log.jsonl"))]


def test_a_fresh_run_starts_its_log_and_a_resume_continues_it(tmp_path):
    """Two fresh runs into one -o (the second with --overwrite): one run's log. A resume from
    step 2 of a run that went on to step 4, re-run with the same -e preset (and --overwrite,
    for the later checkpoint it goes back past): steps 3 and 4 logged once each. A fresh
    checkpointing run is not mixed into the checkpoints of an earlier one."""
    for ck in ([], ["--checkpoint-every", "2", "--keep", "2", "--overwrite"]):
        rc, lines = run(*TRAIN, "-n", "4", "-v", "2", *ck, "-o", tmp_path)
        assert rc == 0, lines
    once = [(0, "val"), (1, "train"), (2, "train"), (2, "val"), (3, "train"), (4, "train"),
            (4, "val")]
    assert steps_logged(tmp_path) == once
    rc, lines = run(*TRAIN, "-n", "4", "-v", "2", "-e", "tiny", "--resume",
                    tmp_path / "ckpt_00000002", "-o", tmp_path, "--overwrite")
    assert rc == 0, lines
    assert steps_logged(tmp_path) == once
    rc, lines = run(*TRAIN, "-n", "2", "--checkpoint-every", "1", "-o", tmp_path)
    assert rc == 1 and lines == [f"error: -o {tmp_path}: holds an earlier run's output "
                                 f"(model.bin; log.jsonl; 1 checkpoint(s), the newest "
                                 f"ckpt_00000002, which a resume from it would take for this "
                                 f"run's); add --resume {tmp_path} to continue that run, add "
                                 f"--overwrite to replace it, or give another -o"]
    assert steps_logged(tmp_path) == once


def test_verify_with_no_arguments_checks_the_shipped_losses():
    res = cli("verify", "--backend", "numpy", "--steps", "3")
    assert res.returncode == 0, res.stderr
    assert "step 2: loss 5.66" in res.stdout and "expected 5.66" in res.stdout
    other = cli("verify", "--backend", "numpy", "--steps", "2", "--lr", "1e-3")
    steps = [ln for ln in other.stdout.splitlines() if re.match(r"step \d+:", ln)]
    assert steps and not any("expected" in ln for ln in steps)  # other lr: nothing to compare
    assert "step losses: 0 of 2 compared" in other.stdout


def test_a_tiny_temperature_samples_greedily():
    res = cli("sample", "--backend", "numpy", "--model", fixture("gpt2v_model.bin"),
              "--temperature", "1e-310", "--max-new-tokens", "4")
    greedy = cli("sample", "--backend", "numpy", "--model", fixture("gpt2v_model.bin"),
                 "--temperature", "0", "--max-new-tokens", "4")
    assert res.returncode == 0, res.stderr
    assert res.stdout == greedy.stdout


def test_prepare_names_shards_after_the_text_and_never_overwrites_unasked(tmp_path):
    text = tmp_path / "other.txt"
    shutil.copy(TEXT, text)
    rc, lines = run("prepare", text, cwd=tmp_path)  # (the default --out is ./data)
    assert rc == 0, lines
    assert sorted(os.listdir(tmp_path / "data")) == ["other_train.bin", "other_val.bin"]
    rc, lines = run("prepare", text, cwd=tmp_path)
    assert rc == 1 and lines == [f"error: --out data: {os.path.join('data', 'other_val.bin')} "
                                 f"exists; add --overwrite to replace them, or another --out or "
                                 f"--name"]
    assert run("prepare", text, "--force", cwd=tmp_path)[0] == 0


def test_each_message_is_one_write_so_ranks_do_not_interleave(monkeypatch):
    r, w = os.pipe()

    class Stdout:  # a stdout on the pipe
        def fileno(self):
            return w

        def flush(self):
            pass

        def isatty(self):
            return False
    monkeypatch.setattr(sys, "stdout", Stdout())
    writes, real = [], os.write
    monkeypatch.setattr(os, "write", lambda fd, b: writes.append(b) or real(fd, b))
    Log(1, 2)("a\nb", every_rank=True)
    assert writes == [b"[pe1] a\n[pe1] b\n"]
    os.close(w)
    assert os.read(r, 100) == b"[pe1] a\n[pe1] b\n"
    os.close(r)


def test_a_directory_named_like_a_preset_does_not_hide_it(tmp_path, monkeypatch):
    """`train -e d12 -o d12` run twice: the second run's -e is still the preset."""
    from cupygpt.formats.llmc import is_model_file
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d12").mkdir()
    assert not is_model_file("d12") and is_model_file("d12.bin")


def test_a_one_process_command_under_mpiexec_says_so(tmp_path):
    res = cli("prepare", TEXT, "--out", tmp_path, ranks=2)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 1 and lines == ["error: prepare runs in one process: run it "
                                             "without mpiexec"], res.stderr
    assert os.listdir(tmp_path) == []


def test_plot_without_matplotlib_names_the_package_to_install(tmp_path, monkeypatch):
    from cupygpt import CupyGPTError
    from cupygpt.commands.plot import plot
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    with pytest.raises(CupyGPTError, match=r"pip install 'cupygpt\[plot\]'"):
        plot(tmp_path / "log.jsonl", tmp_path / "loss.png")


def test_overlap_help_says_it_works_with_zero_1():
    res = cli("train", "--help")
    assert "(with --zero 1: as an all-reduce, each replica updating its slice)" in \
        " ".join(res.stdout.split())


def test_the_tests_never_meet_the_checkouts_out(tmp_path):
    """README's order: `python cli.py train` (writing the checkout's out/), then the tests.
    A test's `train` with the default -o writes into the test's own directory: it neither
    meets the earlier run's output there nor touches it (conftest's own_directory)."""
    from conftest import checkout_out
    before = checkout_out()
    res = cli(*TRAIN, "-n", "1")
    assert res.returncode == 0, res.stderr
    assert os.path.isfile(os.path.join(os.getcwd(), "out", "model.bin"))
    assert not os.path.realpath(os.getcwd()).startswith(os.path.realpath(ROOT) + os.sep)
    assert checkout_out() == before
