"""dev.predict_step on a made-up trace of README's 2-stage pipeline and a made-up bench
--comm report: the prediction is the simulator's from exactly those times."""
import json
import subprocess
import sys

import pytest
from harness import ROOT

from cupygpt.model.shape import preset
from cupygpt.parallel.pipeline.predict import predict_step
from dev.predict_step import predict_from

MS = 1e3  # trace time units (microseconds) per millisecond


def made_up(tmp_path):
    """A 1f1b step of one micro-batch on 2 ranks (F0, F1, B1, B0, each rank's step action
    after) and an nvshmem handoff of 12 us."""
    def sl(tid, cat, ts, dur):
        return {"name": cat, "cat": cat, "ph": "X", "pid": 0, "tid": tid, "ts": ts * MS,
                "dur": dur * MS, "args": {"micro_batch": 0, "chunk": 0}}
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": [
        sl(0, "fwd", 0.0, 1.0), sl(1, "fwd", 1.1, 1.5), sl(1, "bwd", 2.6, 2.5),
        sl(0, "bwd", 5.2, 2.0), sl(1, "step", 5.1, 0.4), sl(0, "step", 7.2, 0.3)],
        "pipeline": {"schedule": "1f1b", "stages": 2, "micro_batches": 1}}))
    comm = {"device": "made up", "seeds": {"nvshmem": {"handoff_8B": {
        "host_us": 40.0, "loop_us": 12.0, "issue_us": 9.0}}}}
    path = tmp_path / "comm.json"
    path.write_text(json.dumps(comm))
    return trace, comm, path


def test_the_prediction_is_the_simulators_from_the_measured_parts(tmp_path):
    trace, comm, _ = made_up(tmp_path)
    r = predict_from(str(trace), comm, link_GBps=450.0)
    d12 = preset("d12")
    want = predict_step(2, 1, "1f1b", [1e-3, 1.5e-3], [2e-3, 2.5e-3],
                        handoff_bytes=4 * 128 * d12.C * 2, latency_s=12e-6,
                        bandwidth_Bps=450e9, t_close=[0.3e-3, 0.4e-3],
                        close_bytes=d12.Vp * d12.C * 2)
    assert r["step_ms"] == pytest.approx(want["step_s"] * 1e3)
    assert r["handoff_bytes"] == 4 * 128 * 768 * 2 and r["latency_us"] == 12.0
    # by hand: the four ops, two handoffs, the slower close and the wte gradient's crossing
    hop = 12e-6 + 4 * 128 * 768 * 2 / 450e9
    assert r["step_ms"] == pytest.approx(
        1e3 * (7.0e-3 + 2 * hop + 0.4e-3 + 12e-6 + 50304 * 768 * 2 / 450e9))
    assert r["bubble"] == pytest.approx(0.5, abs=0.01)  # one micro-batch on two stages


def test_the_command_prints_the_prediction_and_refuses_a_transport_not_timed(tmp_path):
    trace, _, comm = made_up(tmp_path)
    res = subprocess.run([sys.executable, "-m", "dev.predict_step", str(trace), str(comm),
                          "--link-GBps", "450"], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    first, second = res.stdout.splitlines()
    assert json.loads(first)["transport"] == "nvshmem" and second.startswith(
        "predicted 2-GPU step: ")
    res = subprocess.run([sys.executable, "-m", "dev.predict_step", str(trace), str(comm),
                          "--transport", "nccl"], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert res.returncode == 1 and res.stderr.strip() == (
        f"error: {comm} has no nccl handoff (it timed nvshmem)")
