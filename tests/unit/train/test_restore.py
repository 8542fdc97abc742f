"""train/checkpoint.py: writing and reading a run's checkpoints."""
import pytest


def test_a_checkpoint_removed_while_a_resume_reads_it_is_named_so(tmp_path):
    """(a live run's --keep removed it: "cannot open model file" said nothing of why)"""
    from cupygpt import CupyGPTError
    from cupygpt.train.checkpoint import restore
    gone = tmp_path / "run" / "ckpt_00000003"
    with pytest.raises(CupyGPTError, match=f"{gone}: removed while this run read it \\(a run "
                                           f"still writing {tmp_path / 'run'} keeps only"):
        restore(None, str(gone))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run's -o holding ckpt_00000002 and ckpt_00000004."""
    from harness import TINY, cli
    out = tmp_path_factory.mktemp("live") / "run"
    made = cli(*TINY, "-n", "4", "--checkpoint-every", "2", "-o", out)
    assert made.returncode == 0, made.stderr
    return out


def pruned_while_read(monkeypatch, reader, whole):
    """config/train.py's reader, patched to see the first checkpoint it reads removed as it
    starts: whole, as a live run's --keep prunes it (train/checkpoint.prune), or its files
    gone and the directory not yet (a remover that goes file by file)."""
    import os

    import cupygpt.config.train as config_train
    from cupygpt.train.checkpoint import prune
    real, seen = getattr(config_train, reader), []

    def reading(path, *rest):
        ckpt = os.path.dirname(path) if path.endswith("model.bin") else path
        if not seen:
            seen.append(ckpt)
            if whole:
                prune(ckpt)
            for f in ([] if whole else os.listdir(ckpt)):
                os.remove(os.path.join(ckpt, f))
        return real(path, *rest)
    monkeypatch.setattr(config_train, reader, reading)


@pytest.mark.parametrize("whole", [True, False])
@pytest.mark.parametrize("reader", ["check_model", "model_shape", "check_resume"])
def test_a_resume_of_a_live_run_takes_the_newest_checkpoint_that_stays(
        tmp_path, run_dir, monkeypatch, reader, whole):
    import shutil

    from cupygpt.backends.numpy.backend import NumpyBackend
    from cupygpt.config.train import TrainConfig
    out = tmp_path / "run"
    shutil.copytree(run_dir, out)
    pruned_while_read(monkeypatch, reader, whole)
    c, _ = TrainConfig(resume=str(out), out=str(tmp_path / "o"), steps=8, batch=1,
                       seq=16).validate(NumpyBackend(), 1)
    assert c.resume == str(out / "ckpt_00000002")


@pytest.mark.parametrize("whole", [True, False])
@pytest.mark.parametrize("reader", ["check_model", "model_shape", "check_resume"])
def test_a_named_checkpoint_removed_while_read_is_named_so(tmp_path, run_dir, monkeypatch,
                                                           reader, whole):
    import shutil

    from cupygpt import CupyGPTError
    from cupygpt.backends.numpy.backend import NumpyBackend
    from cupygpt.config.train import TrainConfig
    out = tmp_path / "run"
    shutil.copytree(run_dir, out)
    pruned_while_read(monkeypatch, reader, whole)
    named = out / "ckpt_00000004"
    with pytest.raises(CupyGPTError) as e:
        TrainConfig(resume=str(named), out=str(tmp_path / "o"), steps=8, batch=1,
                    seq=16).validate(NumpyBackend(), 1)
    assert str(e.value) == (f"{named}: removed while this run read it (a run still writing "
                            f"{out} keeps only its newest checkpoints, --keep); resume from "
                            f"{out} again to take its newest")


def test_a_checkpoint_losing_its_files_while_restored_is_named_so(tmp_path, run_dir):
    """(a remover going file by file left the directory: "cannot open model file")"""
    import os
    import shutil

    from cupygpt import CupyGPTError
    from cupygpt.train.checkpoint import restore
    out = tmp_path / "run"
    shutil.copytree(run_dir, out)
    os.remove(out / "ckpt_00000004" / "adamw.npz")
    with pytest.raises(CupyGPTError, match="ckpt_00000004: removed while this run read it"):
        restore(None, str(out / "ckpt_00000004"))


def test_a_prune_cut_short_is_litter_the_next_run_removes(tmp_path):
    """A run killed between --keep's rename and its removal leaves ckpt_STEP.pruned, which
    no resume takes (listed passes it over) and the next run in that -o removes."""
    from cupygpt.formats.checkpoint import listed
    from cupygpt.train.checkpoint import clean_litter
    for name in ("ckpt_00000002.pruned", "ckpt_00000004"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.bin").write_bytes(b"x")
        (tmp_path / name / "adamw.npz").write_bytes(b"x")
    assert listed(tmp_path) == ["ckpt_00000004"]
    clean_litter(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt_00000004"]
