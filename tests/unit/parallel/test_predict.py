"""The step predicted from measured parts (parallel/pipeline/predict.py) on made-up
measurements whose answers are known by hand or from the published bubbles."""
import pytest

from cupygpt.parallel.pipeline.predict import handoff_seconds, predict_step


def test_a_handoff_is_its_latency_then_its_bytes_at_the_bandwidth():
    assert handoff_seconds(1e6, 1e-5, 1e9) == pytest.approx(1.01e-3)
    assert handoff_seconds(0, 5e-6, 450e9) == 5e-6


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (8, 16)])
def test_free_handoffs_give_1f1b_s_published_bubble(p, m):
    r = predict_step(p, m, "1f1b", 1.0, 2.0, handoff_bytes=1 << 20, latency_s=0.0,
                     bandwidth_Bps=float("inf"))
    assert r["bubble"] == pytest.approx((p - 1) / (m + p - 1))
    assert r["step_s"] == r["pipeline_s"] == pytest.approx(3.0 * (m + p - 1))


def test_two_stages_of_one_micro_batch_add_up_with_two_handoffs_and_the_close():
    """d12-like stages (the head on the last: its forward and backward longer), one
    micro-batch: F0, the activation over, F1, B1, the gradient back, B0, then the slower
    rank's close and the tied wte's gradient over the link."""
    ms = 1e-3
    r = predict_step(2, 1, "1f1b", [1.0 * ms, 1.5 * ms], [2.0 * ms, 2.5 * ms],
                     handoff_bytes=1_572_864, latency_s=20e-6, bandwidth_Bps=450e9,
                     t_close=[0.3 * ms, 0.4 * ms], close_bytes=154_389_504)
    hop = 20e-6 + 1_572_864 / 450e9
    assert r["handoff_s"] == pytest.approx(hop)
    assert r["pipeline_s"] == pytest.approx(7.0 * ms + 2 * hop)
    assert r["close_s"] == pytest.approx(0.4 * ms + 20e-6 + 154_389_504 / 450e9)
    assert r["step_s"] == pytest.approx(r["pipeline_s"] + r["close_s"])
    assert r["bubble"] == pytest.approx(1 - 7.0 * ms / (2 * r["pipeline_s"]))


def test_a_slower_link_lengthens_the_step_by_each_handoff_on_the_critical_path():
    """1f1b on 2 stages, 4 micro-batches: the slower link costs more than one handoff's
    difference (several are on the critical path) and less than all eight's."""
    fast, slow = (predict_step(2, 4, "1f1b", 1e-3, 2e-3, handoff_bytes=1e6, latency_s=5e-6,
                               bandwidth_Bps=bw) for bw in (450e9, 10e9))
    extra = handoff_seconds(1e6, 5e-6, 10e9) - handoff_seconds(1e6, 5e-6, 450e9)
    assert 2 * extra <= slow["step_s"] - fast["step_s"] < 8 * extra
