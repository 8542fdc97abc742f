"""timeline: a trace built from the simulator's own run (no MPI needed) draws, and its
measured bubble is the simulator's."""
import json
import re

from harness import cli

from cupygpt.parallel.pipeline.simulate import simulate


def synthetic_trace(path, p, m, name, v):
    """The simulator's events as --trace writes them (ms units: 1 op = 1 ms), a step slice
    after each rank's work, and the top-level pipeline object."""
    sim = simulate(p, m, name, v, t_fwd=1.0, t_bwd=1.0, t_wgt=1.0)
    events = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": r,
               "args": {"name": f"rank {r}"}} for r in range(p)]
    for r, ev in enumerate(sim["events"]):
        for a, start, end in ev:
            events.append({"name": f"{a.op.value} {a.mb}", "cat": a.op.value, "ph": "X",
                           "pid": 0, "tid": r, "ts": start * 1e3, "dur": (end - start) * 1e3,
                           "args": {"micro_batch": a.mb, "chunk": a.chunk}})
        events.append({"name": "step", "cat": "step", "ph": "X", "pid": 0, "tid": r,
                       "ts": sim["makespan"] * 1e3, "dur": 50.0, "args": {"micro_batch": None}})
    path.write_text(json.dumps({"traceEvents": events, "pipeline": {
        "schedule": name, "stages": p, "micro_batches": m, "virtual_stages": v}}))
    return sim


def test_timeline_draws_and_measures_the_bubble(tmp_path):
    for name, v in (("zb1p", 1), ("zbv", 2)):
        trace, out = tmp_path / f"{name}.json", tmp_path / f"{name}.png"
        sim = synthetic_trace(trace, 4, 8, name, v)
        res = cli("timeline", trace, "--out", out)
        assert res.returncode == 0, res.stderr
        got = re.search(r"measured bubble (\d\.\d+), simulated from each rank.s op and "
                        r"transfer times (\d\.\d+)", res.stdout)
        assert got and got[1] == got[2] == f"{sim['bubble']:.4f}", res.stdout
        png = out.read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and 20_000 < len(png) < 2_000_000
        width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
        assert 800 < width < 2000 and 300 < height < 1500, (width, height)


def test_timeline_wants_a_schedule_without_the_pipeline_object(tmp_path):
    trace = tmp_path / "t.json"
    synthetic_trace(trace, 2, 2, "1f1b", 1)
    data = json.loads(trace.read_text())
    del data["pipeline"]
    trace.write_text(json.dumps(data))
    res = cli("timeline", trace, "--out", tmp_path / "t.png")
    assert res.returncode == 1 and "--schedule (none): the trace names no schedule" in res.stderr
    res = cli("timeline", trace, "--out", tmp_path / "t.png", "--schedule", "1f1b",
              "--overwrite")
    assert res.returncode == 0 and "measured bubble 0.3333" in res.stdout, res.stderr
