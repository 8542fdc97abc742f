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
