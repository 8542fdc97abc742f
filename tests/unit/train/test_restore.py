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
