"""dev/pipeline_speedup.py: its prediction from a trace (checked on a trace laid out as
1F1B runs with equal stages, whose step time is known in closed form), and the whole
measurement on a small model, one schedule (its JSON's rows agree with bench's)."""
import json
import subprocess
import sys

import pytest
from harness import ROOT, mpiexec

from cupygpt.parallel.pipeline.schedule import COMPUTE
from cupygpt.parallel.pipeline.simulate import simulate
from dev.pipeline_speedup import closing_and_between, predicted_step, rank_work

F, B, P, M = 0.010, 0.020, 2, 4  # seconds per micro-batch forward and backward; stages


def one_f_one_b_trace(path, closing, between):
    """Two steps of 1F1B as the simulator lays it out (equal stages, free transfers): each
    rank's step action lasts closing[rank] and its next step starts between seconds after
    it (the update), each receive a slice lasting until its message came, as --trace
    records them."""
    sim = simulate(P, M, "1f1b", t_fwd=F, t_bwd=B)
    events, start_of_step, free = [], 0.0, [0.0] * P

    def add(rank, cat, a, b, mb=None):
        events.append({"name": cat, "cat": cat, "ph": "X", "pid": 0, "tid": rank,
                       "ts": a * 1e6, "dur": (b - a) * 1e6,
                       "args": {"micro_batch": mb, "chunk": 0}})
    for _ in range(2):
        for rank, evs in enumerate(sim["events"]):
            for a, t0, t1 in evs:
                assert a.op in COMPUTE
                t0, t1 = start_of_step + t0, start_of_step + t1
                fwd = a.op.value == "fwd"
                if (rank > 0) if fwd else (rank < P - 1):  # (until the peer's message came)
                    add(rank, "recv_act" if fwd else "recv_grad", free[rank], t0, a.mb)
                add(rank, a.op.value, t0, t1, a.mb)
                free[rank] = t1
            add(rank, "step", free[rank], free[rank] + closing[rank])
            free[rank] += closing[rank] + between
        start_of_step = free[0]  # the first stage starts at once; the others wait
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "pipeline": {"schedule": "1f1b", "stages": P,
                                                       "micro_batches": M}}, f)


def test_the_prediction_is_1f1bs_step_plus_what_no_schedule_hides(tmp_path):
    closing, between, trace = [0.003, 0.001], 0.004, tmp_path / "t.json"
    one_f_one_b_trace(trace, closing, between)
    predicted, sim, bubble, handoff, times = predicted_step(str(trace), "1f1b")
    # 1F1B with equal stages: the first stage's last backward ends the schedule, at
    # (M + P - 1)(F + B); then its closing sums and its update
    assert predicted == pytest.approx((M + P - 1) * (F + B) + closing[0] + between)
    assert sim["bubble"] == pytest.approx((P - 1) / (M + P - 1))
    assert bubble == pytest.approx((P - 1) / (M + P - 1)) and handoff == pytest.approx(0)
    assert times["t_fwd"] == pytest.approx([F, F]) and times["t_bwd"] == pytest.approx([B, B])
    work = rank_work(times, closing_and_between(str(trace)), M)
    assert work == pytest.approx([M * (F + B) + c + between for c in closing])


@pytest.mark.skipif(mpiexec() is None, reason="needs mpiexec")
def test_measures_one_schedule_on_a_small_model(tmp_path):
    out = tmp_path / "s.json"
    res = subprocess.run([sys.executable, "-m", "dev.pipeline_speedup", "--models", "tiny",
                          "--seqs", "16", "--batch", "4", "--micro-batches", "2",
                          "--schedules", "1f1b", "--steps", "1", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    (row,) = json.loads(out.read_text())["rows"]
    assert row["speedup"] == pytest.approx(row["single_s"] / row["pipelined_s"])
    assert row["predicted_speedup"] == pytest.approx(row["single_s"] / row["predicted_s"])
    assert 0 < row["predicted_bubble"] < 1 and 0 <= row["bubble"] < 1
    assert row["split_cost"] == pytest.approx(sum(row["rank_work_s"]) / row["single_s"])
    assert 0 < row["balance"] <= 1
    assert "| tiny | 16 | 1f1b |" in res.stdout
