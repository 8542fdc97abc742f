"""The checkpoint directory as a resume reads it: the outlier detectors' state is read
strictly (a damaged field is refused, never a traceback later)."""
import pytest


@pytest.mark.parametrize("damage", [
    {"loss": {"buffer": ["x"], "index": 0, "sum": 0.0, "sum_sq": 0.0}},
    {"loss": {"buffer": [1.0], "index": "0", "sum": 1.0, "sum_sq": 1.0}},
    {"loss": {"buffer": [1.0], "index": 0, "sum": None, "sum_sq": 1.0}},
    {"loss": {"buffer": [1.0] * 129, "index": 0, "sum": 1.0, "sum_sq": 1.0}},
    {"loss": {"buffer": [1.0], "index": 200, "sum": 1.0, "sum_sq": 1.0}},
    {"loss": {"buffer": [True], "index": 0, "sum": 1.0, "sum_sq": 1.0}},
    {"loss": []}, {"bogus": {}}, [1, 2]])
def test_outlier_state_is_read_strictly(damage):
    from cupygpt.formats.checkpoint import outliers_ok
    from cupygpt.train.outlier import OutlierDetector
    assert not outliers_ok(damage)
    good = OutlierDetector()
    for x in (1.0, 2.0):
        good.update(x)
    assert outliers_ok({"loss": good.state(), "norm": OutlierDetector().state()})
    assert outliers_ok(None)


def test_only_complete_checkpoints_are_listed(tmp_path):
    """A resume took the newest name in -o: an empty ckpt_ directory, or a file of that
    name, and failed on it beside a whole checkpoint."""
    from cupygpt.formats.checkpoint import listed, named, resolve
    for step in (1, 2):
        (tmp_path / f"ckpt_0000000{step}").mkdir()
    for f in ("model.bin", "adamw.npz"):
        (tmp_path / "ckpt_00000001" / f).write_bytes(b"x")
    (tmp_path / "ckpt_00000002" / "model.bin").write_bytes(b"x")
    (tmp_path / "ckpt_00000003").write_bytes(b"x")
    assert named(tmp_path) == ["ckpt_00000001", "ckpt_00000002", "ckpt_00000003"]
    assert listed(tmp_path) == ["ckpt_00000001"]
    assert resolve(str(tmp_path)) == str(tmp_path / "ckpt_00000001")
