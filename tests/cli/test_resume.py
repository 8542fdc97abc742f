"""Resuming a run: bit for bit where it stopped (fp32 and bf16, one process and two ranks,
the sampler's RNG too), refused from a checkpoint of another run's settings, from the
newest complete checkpoint, naming a damaged one."""
import json
import os
import re

import numpy as np
import pytest
from harness import TRAIN, cli, one_line


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
    if ranks is None:  # another --seed: the checkpoint's order and RNG go on, and it says so
        c = cli(*TRAIN, *samples, "-n", "8", "--resume", full / "ckpt_00000004", "--seed", "7",
                "-o", tmp_path / "seeded")
        assert "note: --seed 7: this run continues the checkpoint's data order and samples " \
               "(its seed 1337)" in c.stdout, c.stdout
        assert log_losses(tmp_path / "seeded" / "log.jsonl") == lb


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
    one_line(res, f"{state}: damaged checkpoint file (its outlier detectors' window")
    assert "num_parameters" not in res.stdout, "refused after loading the model"


def test_a_resume_in_its_own_o_whose_newest_checkpoint_links_elsewhere(tmp_path):
    """-o D --resume D, D's newest ckpt_ a link to another run's: refused as "an earlier
    run's output; add --resume D", which was given."""
    for run, every in (("a", "2"), ("b", "1")):
        assert cli(*TRAIN, "-n", "2", "--checkpoint-every", every, "-o",
                   tmp_path / run).returncode == 0
    os.symlink(tmp_path / "a" / "ckpt_00000002", tmp_path / "b" / "ckpt_00000003")
    res = cli(*TRAIN, "-n", "3", "--resume", tmp_path / "b", "-o", tmp_path / "b")
    assert res.returncode == 0, res.stderr
    assert sorted(log_losses(tmp_path / "b" / "log.jsonl")) == [1, 2, 3]


def test_going_back_to_an_earlier_checkpoint_in_its_own_o(tmp_path):
    """Resuming ckpt 1 into the -o that holds ckpts 2 and 3 would leave them as if this run
    wrote them (a later --resume of -o takes the newest): refused, naming them; with
    --overwrite they go, and a later --resume continues this run, its log whole."""
    out = tmp_path / "r"
    args = [*TRAIN, "--checkpoint-every", "1", "--keep", "5", "-o", out]
    assert cli(*args, "-n", "3").returncode == 0
    back = [*args, "--resume", out / "ckpt_00000001", "-n", "2"]
    res = cli(*back)
    one_line(res, f"error: -o {out}: holds checkpoints after the resumed ckpt_00000001 "
                  f"(ckpt_00000002, ckpt_00000003): continuing here would leave them as if "
                  f"this run wrote them; add --overwrite to remove them, or give another -o")
    assert sorted(os.listdir(out)) == ["ckpt_00000001", "ckpt_00000002", "ckpt_00000003",
                                       "latest", "log.jsonl", "model.bin"]
    assert cli(*back, "--overwrite").returncode == 0
    assert sorted(os.listdir(out)) == ["ckpt_00000001", "ckpt_00000002", "latest",
                                       "log.jsonl", "model.bin"]
    res = cli(*args, "--resume", out, "-n", "4")
    assert res.returncode == 0 and f"{out}/ckpt_00000002" in res.stdout, res.stdout
    assert sorted(log_losses(out / "log.jsonl")) == [1, 2, 3, 4]


def test_overwrite_never_removes_the_runs_own_input(tmp_path):
    """-e inside one of -o's checkpoints with --overwrite (which removes them): refused
    before anything is removed."""
    out = tmp_path / "r"
    args = [*TRAIN, "--checkpoint-every", "1", "-n", "2", "-o", out]
    assert cli(*args).returncode == 0
    before = sorted(os.listdir(out))
    model = out / "ckpt_00000002" / "model.bin"
    res = cli(*[a for a in args if a not in ("-e", "tiny")], "-e", model, "--overwrite")
    one_line(res, f"error: -o {out}: --overwrite removes its earlier checkpoints, "
                  f"ckpt_00000002 among them, which holds this run's input {model}; copy that "
                  f"out of -o first, or give another -o")
    assert sorted(os.listdir(out)) == before and model.is_file()


def test_a_model_bin_swapped_into_a_checkpoint_is_damage(tmp_path):
    """The state records model.bin's length and hash: another model of the same shape (it
    resumed silently, with other losses) or of another shape (blamed on the run's flags)
    is a damaged checkpoint, naming the one before; a checkpoint written before the record
    existed still resumes."""
    out = tmp_path / "r"
    args = [*TRAIN, "-e", "tiny", "-n", "2", "--checkpoint-every", "1", "--keep", "3"]
    assert cli(*args, "-o", out).returncode == 0
    ckpt = out / "ckpt_00000002"
    good = (ckpt / "model.bin").read_bytes()
    assert cli(*args, "--seed", "5", "-o", tmp_path / "other").returncode == 0
    assert cli(*TRAIN, "-e", "d6", "-n", "1", "-t", "16", "-b", "1", "-o", tmp_path / "d6",
               "--backend", "numpy").returncode == 0
    for swapped, how in ((tmp_path / "other" / "model.bin", "other bytes of the same length"),
                         (tmp_path / "d6" / "model.bin", "bytes, ")):
        (ckpt / "model.bin").write_bytes(swapped.read_bytes())
        res = cli(*TRAIN, "-n", "3", "--resume", ckpt, "-o", tmp_path / "b")
        one_line(res, f"error: {ckpt}/model.bin: damaged checkpoint file (not the model.bin "
                      f"its adamw.npz was written with (")
        assert how in res.stderr and f"{out}/ckpt_00000001 can be resumed" in res.stderr
    (ckpt / "model.bin").write_bytes(good)
    with np.load(ckpt / "adamw.npz") as z:  # as written before the record: without it
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(str(arrays["meta"]))
    del meta["model_bin"]
    np.savez(ckpt / "adamw.npz", **{**arrays, "meta": np.array(json.dumps(meta))})
    assert cli(*TRAIN, "-n", "3", "--resume", ckpt, "-o", tmp_path / "c").returncode == 0


def test_a_log_line_cut_short_is_dropped_with_a_note(tmp_path):
    out = tmp_path / "r"
    args = [*TRAIN, "-e", "tiny", "--checkpoint-every", "1", "--keep", "3", "-o", out]
    assert cli(*args, "-n", "3").returncode == 0
    log = out / "log.jsonl"
    log.write_bytes(log.read_bytes()[:-20])  # step 3's record cut, as a kill mid-write would
    res = cli(*args, "-n", "4", "--resume", out / "ckpt_00000003")
    assert res.returncode == 0, res.stderr
    assert f"note: {log}: dropped 1 unreadable line (a run stopped while writing one, or an " \
           f"edit)" in res.stdout + res.stderr
    assert sorted(log_losses(log)) == [1, 2, 4]


def test_a_resume_says_when_it_redoes_logged_steps_or_trains_none(tmp_path):
    """A run that went on past its newest checkpoint (no later one written) logged steps a
    resume redoes; a resume at the checkpoint's own step trains none: each says so."""
    out = tmp_path / "r"
    args = [*TRAIN, "-e", "tiny", "-o", out]
    assert cli(*args, "-n", "3", "--checkpoint-every", "1").returncode == 0
    res = cli(*args, "-n", "3", "--resume", out)
    assert res.returncode == 0 and "note: the checkpoint is at step 3, -n 3: no step to " \
        "train; its model is written as the run's" in res.stdout + res.stderr
    assert cli(*args, "-n", "5", "--resume", out, "--checkpoint-every", "0").returncode == 0
    res = cli(*args, "-n", "6", "--resume", out)
    assert res.returncode == 0 and f"note: {out}/log.jsonl went on to step 5, past the " \
        f"checkpoint's 3: its records after step 3 are dropped, this run writing its own" in \
        res.stdout + res.stderr
    assert sorted(log_losses(out / "log.jsonl")) == [1, 2, 3, 4, 5, 6]


def edit_meta(ckpt, edit):
    """The checkpoint's run state (adamw.npz's meta) replaced by edit(meta)."""
    with np.load(ckpt / "adamw.npz") as z:
        arrays = {k: z[k] for k in z.files}
    arrays["meta"] = np.array(json.dumps(edit(json.loads(str(arrays["meta"])))))
    np.savez(ckpt / "adamw.npz", **arrays)


@pytest.mark.parametrize("edit,why", [
    (lambda m: None, "its run state is not a JSON object"),
    (lambda m: [1, 2], "its run state is not a JSON object"),
    (lambda m: {**m, "model_bin": None}, "its record of model.bin is malformed"),
    (lambda m: {**m, "model_bin": {**m["model_bin"], "bytes": -5}},
     "its record of model.bin is malformed"),
    (lambda m: {**m, "step": 1}, "its step 1 is not its directory's 2")])
def test_a_checkpoints_run_state_out_of_shape_is_damage(tmp_path, edit, why):
    """(a traceback; a null record turned the model check off; the step of another
    checkpoint made the run jump there)"""
    out = tmp_path / "r"
    args = [*TRAIN, "-e", "tiny", "--checkpoint-every", "1", "--keep", "5", "-o", out]
    assert cli(*args, "-n", "2").returncode == 0
    edit_meta(out / "ckpt_00000002", edit)
    res = cli(*args, "-n", "3", "--resume", out / "ckpt_00000002", "-o", tmp_path / "b")
    one_line(res, f"error: {out}/ckpt_00000002/adamw.npz: damaged checkpoint file ({why}); "
                  f"the previous checkpoint {out}/ckpt_00000001 can be resumed instead")


def test_keep_passes_over_an_older_checkpoint_it_cannot_read(tmp_path):
    """--keep's pruning asks each older checkpoint whether -nm kept it: one whose run state
    is no JSON object stays (it was a traceback after the step was trained)."""
    out = tmp_path / "r"
    args = [*TRAIN, "-e", "tiny", "--checkpoint-every", "1", "-o", out]
    assert cli(*args, "-n", "2", "--keep", "5").returncode == 0
    edit_meta(out / "ckpt_00000001", lambda m: None)
    res = cli(*args, "-n", "4", "--keep", "1", "--resume", out)
    assert res.returncode == 0, res.stderr
    assert sorted(d for d in os.listdir(out) if d.startswith("ckpt")) == [
        "ckpt_00000001", "ckpt_00000004"]


def test_a_log_an_editor_saved_with_a_bom_keeps_its_first_record(tmp_path):
    out = tmp_path / "r"
    args = [*TRAIN, "-e", "tiny", "--checkpoint-every", "1", "-o", out]
    assert cli(*args, "-n", "2").returncode == 0
    log = out / "log.jsonl"
    log.write_bytes(b"\xef\xbb\xbf" + log.read_bytes())
    res = cli(*args, "-n", "3", "--resume", out)
    assert res.returncode == 0 and "unreadable" not in res.stdout + res.stderr
    assert sorted(log_losses(log)) == [1, 2, 3]
