"""Errors met mid-run (a token outside the vocab, memory run out) end the run in one line
that says what it wrote: the steps trained are kept as a signal's stop keeps them
(test_pipes_and_signals.py), byte for byte the model of a run that stopped there; a shard
small enough to read in a step's time is checked before anything is made."""
import os

import numpy as np
import pytest
from harness import TINY, cli, error_line, one_line

from cupygpt.config.train import scan_limit
from cupygpt.formats.llmc import read_shard, write_shard
from cupygpt.model.shape import preset

SHIPPED = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "cupygpt", "data", "tiny_shakespeare_train.bin")
# TINY's model, B*T and the numpy backend's peak (none): a shard this long is checked batch
# by batch as training reads it, not before
UNSCANNED = scan_limit(preset("tiny"), 16, 16, None) + 1
IN_ORDER = ["-k", "constant", "--no-shuffle"]  # (the lr and batches of a step whatever -n)


def shard(path, n, bad_at=None):
    """n of the shipped tokens; token bad_at replaced by one outside GPT-2's vocab."""
    tokens = np.resize(np.asarray(read_shard(SHIPPED)), n)
    if bad_at is not None:
        tokens[bad_at] = 60000
    write_shard(path, tokens)
    return str(path)


@pytest.mark.parametrize("ranks,every", [(None, 0), (None, 2), (None, 1), (2, 0)])
def test_a_token_outside_the_vocab_mid_run_keeps_the_steps_trained(tmp_path, ranks, every):
    bad = shard(tmp_path / "bad.bin", UNSCANNED, bad_at=3 * 16 + 5)  # in step 4's batch
    out = tmp_path / "a"
    run = cli(*TINY, *IN_ORDER, "-n", "10", "-i", bad, "--checkpoint-every", every, "-o", out,
              ranks=ranks)
    line = error_line(run)
    assert "token 60000 (in tokens 48..64) is outside the model's vocab" in line, line
    kept = out / "ckpt_00000003" / "model.bin" if every else out / "model.bin"
    said = {0: f"wrote {kept} of step 3 (no checkpoints: it cannot be resumed exactly)",
            1: f"{out / 'ckpt_00000003'} holds step 3: resume from it",  # (written before)
            2: f"wrote checkpoint {out / 'ckpt_00000003'} of step 3: resume from it"}[every]
    assert line.endswith(said), line
    clean = cli(*TINY, *IN_ORDER, "-n", "3", "-i", shard(tmp_path / "ok.bin", 200), "-o",
                tmp_path / "b", ranks=ranks)
    assert clean.returncode == 0, clean.stderr
    assert kept.read_bytes() == (tmp_path / "b" / "model.bin").read_bytes()


def test_memory_run_out_mid_run_keeps_the_steps_trained(tmp_path):
    out = tmp_path / "a"
    run = cli(*TINY, *IN_ORDER, "-n", "10", "-o", out, fault="memory:3")
    line = error_line(run)
    assert line.startswith("error: out of memory while training, though this host's memory "
                           "had room for the run at its start"), line
    assert "lower -b or -t" in line and line.endswith(
        f"wrote {out / 'model.bin'} of step 2 (no checkpoints: it cannot be resumed exactly)")
    clean = cli(*TINY, *IN_ORDER, "-n", "2", "-o", tmp_path / "b")
    assert clean.returncode == 0, clean.stderr
    assert (out / "model.bin").read_bytes() == (tmp_path / "b" / "model.bin").read_bytes()


def test_a_checkpoint_write_meeting_a_full_disk_names_the_last_whole_one(tmp_path):
    out = tmp_path / "a"
    run = cli(*TINY, *IN_ORDER, "-n", "6", "--checkpoint-every", "2", "-o", out,
              fault="full:4")
    line = error_line(run)
    assert "ckpt_00000004.partial/model.bin: disk full (or over quota)" in line, line
    assert line.endswith(f"{out / 'ckpt_00000002'} holds step 2: resume from it"), line
    assert sorted(p.name for p in out.iterdir()) == ["ckpt_00000002", "latest", "log.jsonl"]
    again = cli(*TINY, *IN_ORDER, "-n", "6", "--checkpoint-every", "2", "--resume", out,
                "-o", out)
    assert again.returncode == 0, again.stderr


@pytest.mark.parametrize("at", [1, 4])
def test_memory_run_out_writing_a_checkpoint_names_ulimit_and_the_last_whole_one(tmp_path, at):
    out = tmp_path / "a"
    run = cli(*TINY, *IN_ORDER, "-n", "6", "--checkpoint-every", "2" if at == 4 else "1",
              "-o", out, fault=f"oom:{at}")
    line = error_line(run)
    assert line.startswith(f"error: out of memory while writing step {at}'s weights; under "
                           f"`ulimit -v {(1 << 42) // 1024}` (4096.00 GiB of address space): "
                           f"raise it"), line
    assert line.endswith(f"{out / 'ckpt_00000002'} holds step 2: resume from it" if at == 4
                         else "this run's steps 1..1 were not written"), line


def test_a_rank_failing_mid_step_says_the_steps_are_not_written(tmp_path):
    """The other ranks wait in the step's transfers: nothing can be gathered, and the line
    says so rather than leaving the user to look for a model."""
    run = cli(*TINY, "-n", "10", "-o", tmp_path / "a", ranks=2, fault="raise:3:1",
              timeout=120)
    assert run.returncode != 0
    assert "This run's steps were not written (the other ranks were mid-step" in run.stdout \
        + run.stderr
    assert not (tmp_path / "a" / "model.bin").exists()


@pytest.mark.parametrize("flag", ["-i", "-j"])
def test_a_shard_small_enough_to_scan_is_refused_before_the_run(tmp_path, flag):
    bad = shard(tmp_path / "bad.bin", 2000, bad_at=40 * 16 + 5)  # step 41's batch
    run = cli(*TINY, flag, bad, "-v", "5", "-o", tmp_path / "a")
    one_line(run, f"{flag} {bad}: token 60000 (the shard's token 645) is outside the model's "
                  f"vocab (V=50257)")
    assert not (tmp_path / "a").exists()
