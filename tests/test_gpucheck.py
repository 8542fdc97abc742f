"""The GPU check end to end, as a dry run on cudasim: every GPU test (on the stand-in),
the benchmarks and the nvshmem pipeline, into one report. Without a GPU it refuses."""
import json

import pytest

from conftest import cli, device_env, gpu_available, requires_sim


@requires_sim
@pytest.mark.timeout(1500)  # it runs the GPU tests again, inside
def test_gpucheck_dry_run_on_cudasim(tmp_path):
    res = cli("gpucheck", "--quick", "--out", tmp_path, env=device_env("sim"), timeout=1500)
    assert res.returncode == 0, res.stdout + res.stderr
    r = json.loads((tmp_path / "report.json").read_text())
    assert r["plan"] == "quick" and r["versions"]["device"] == "cudasim (CPU)"
    t = r["tests"]
    assert t["failed"] == 0 and t["errors"] == 0 and t["passed"] >= 20, t
    assert r["bench"] and all("error" not in b for b in r["bench"].values()), r["bench"]
    assert r["pipeline"]["max_rel_loss_diff"] < 1e-5
    assert all(r["sanitizer"][tool]["clean"] for tool in ("memcheck", "racecheck"))
    md = (tmp_path / "report.md").read_text()
    assert "| tiny_T64_B4_profile |" in md and "| classifier |" in md and "nvshmem_2" in md


def test_gpucheck_refuses_without_a_gpu(tmp_path):
    if gpu_available():
        return
    res = cli("gpucheck", "--out", tmp_path)
    assert res.returncode == 1 and res.stderr.strip().startswith("error: gpucheck: no GPU")
