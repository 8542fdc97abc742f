"""The GPU check end to end, as a dry run on cudasim: every GPU test (on the stand-in),
the benchmarks and the nvshmem pipeline, into one report. Without a GPU it refuses."""
import json
import os
import sys

import pytest

from conftest import cli, device_env, gpu_available, requires_sim


# The dry run proves the check's plumbing; the GPU tests themselves already run on cudasim
# as their "sim" variants, so its nested pytest takes a subset (pytest reads PYTEST_ADDOPTS):
# the kernel tests, in-process and quick.
NESTED = "-k kernels_match"


@requires_sim
@pytest.mark.timeout(1500)
def test_gpucheck_dry_run_on_cudasim(tmp_path):
    """In two pieces, as on a machine with a per-command time limit: the second merges
    into the first's report, and only the whole check exits 0."""
    from cupygpt.gpucheck import PLANS
    env = {**device_env("sim"), "PYTEST_ADDOPTS": NESTED}
    first = cli("gpucheck", "--quick", "--out", tmp_path, "--part", "tests", "--part",
                "sanitizer", "--part", "verify", env=env, timeout=1500)
    assert first.returncode == 1, first.stdout + first.stderr
    assert "result: FAIL: bench: not run; pipeline: not run" in first.stdout
    part = json.loads((tmp_path / "report.json").read_text())
    assert set(part) == {"plan", "versions", "tests", "verify", "sanitizer"}
    res = cli("gpucheck", "--quick", "--out", tmp_path, "--part", "pipeline", "--part", "bench",
              "--mps", env=env, timeout=1500)
    assert res.returncode == 0, res.stdout + res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "gpu_tests.log", "report.json", "report.md", "sanitize_memcheck.log",
        "sanitize_racecheck.log"], "the runs' own outputs stay out of the report directory"
    r = json.loads((tmp_path / "report.json").read_text())
    assert r["plan"] == "quick" and r["versions"]["device"] == "cudasim (CPU)"
    assert r["tests"] == part["tests"] and r["sanitizer"] == part["sanitizer"]
    v = r["verify"]
    assert v["tiny_no_tf32"]["ok"] and v["tiny_no_tf32"]["logits"] < 1e-5, v
    assert v["tiny_tf32"]["ok"] and v["tiny_tf32"]["logits"] > 10 * v["tiny_no_tf32"]["logits"]
    assert v["tiny_bf16"]["ok"] and v["tiny_bf16"]["logits"] > 10 * v["tiny_no_tf32"]["logits"]
    t = r["tests"]
    assert t["failed"] == 0 and t["errors"] == 0 and t["passed"] >= 4, t  # 4 kernel shapes
    assert r["bench"] and all("error" not in b for b in r["bench"].values()), r["bench"]
    for run in ("nvshmem_2", "nvshmem_2_mps"):
        assert r["pipeline"][run]["max_rel_loss_diff"] < 1e-5, r["pipeline"]
    assert all(r["sanitizer"][tool]["clean"] for tool in ("memcheck", "racecheck"))
    md = (tmp_path / "report.md").read_text()
    assert "| tiny_no_tf32 | True |" in md
    profile = f"| tiny_T{PLANS['quick']['t_long']}_B4_profile |"  # the profiled bench's ops
    assert "result: PASS" in md and profile in md and "| cross_entropy |" in md
    assert "nvshmem_2" in md


@pytest.mark.skipif(gpu_available(), reason="this machine has a GPU")
def test_gpucheck_refuses_without_a_gpu(tmp_path):
    res = cli("gpucheck", "--out", tmp_path)
    assert res.returncode == 1 and res.stderr.strip().startswith("error: gpucheck: no GPU")
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_report_names_each_failure():
    from cupygpt.gpucheck import problems, summary

    def verified(ok):
        return {"ok": ok, "logits": 1e-6, "loss": 1e-7, "grad_abs": 1e-6, "grad_rel": 1e-5,
                "steps": 1e-6}

    r = {"plan": "quick", "versions": {"device": "X"},
         "tests": {"passed": 3, "failed": 1, "skipped": 0, "errors": 0, "rc": 1,
                   "failures": ["test_a"]},
         "sanitizer": {"memcheck": {"clean": True, "summary": "0 errors"},
                       "racecheck": {"clean": False, "summary": "2 hazards"}},
         "verify": {"tiny_no_tf32": verified(True), "tiny_tf32": verified(False),
                    "odd_no_tf32": {"error": "Traceback"}},
         "bench": {"tiny_T32_B4": {"error": "out of GPU memory"}}}
    assert problems(r) == ["pipeline: not run", "tests: 1 failed, 0 errors (pytest exit 1)",
                           "sanitizer racecheck: 2 hazards",
                           "verify tiny_tf32: outside README's tolerances",
                           "verify odd_no_tf32: Traceback", "bench tiny_T32_B4: out of GPU memory"]
    md = summary(r)
    assert "result: FAIL: pipeline: not run; tests: 1 failed" in md and "(test_a)" in md
    assert "pipeline (" not in md, "a part that did not run gets no section"
    assert problems({**r, "sanitizer": {"error": "compute-sanitizer not found"}})[2] == \
        "sanitizer error: compute-sanitizer not found"
    assert problems({**r, "unfinished": "bench"})[1] == "bench: cut short"


def test_mps_server_is_started_for_the_runs_inside_and_stopped(tmp_path, monkeypatch):
    from cupygpt.gpucheck_parts import mps_server
    calls = tmp_path / "calls"
    fake = tmp_path / "bin" / "nvidia-cuda-mps-control"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\necho "$* $(cat) $CUDA_MPS_PIPE_DIRECTORY" >> {calls}\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    with mps_server(str(tmp_path)) as why:
        assert why is None
        assert os.environ["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path / "mps_pipe")
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ
    assert calls.read_text().split("\n")[:2] == [f"-d  {tmp_path}/mps_pipe",
                                                 f" quit {tmp_path}/mps_pipe"]
    fake.write_text("#!/bin/sh\necho 'cannot start the MPS daemon' >&2; exit 3\n")
    with mps_server(str(tmp_path)) as why:
        assert why == "MPS did not start: cannot start the MPS daemon"


def test_a_run_cut_short_keeps_what_it_finished(tmp_path, monkeypatch):
    from cupygpt import gpucheck

    def bench(out, work, plan):
        yield {"first": {"error": "out of GPU memory"}}
        raise KeyboardInterrupt  # the machine's time limit, arriving mid-part

    monkeypatch.setattr(gpucheck, "versions", lambda: {"device": "X"})
    monkeypatch.setitem(gpucheck.PARTS, "bench", bench)
    with pytest.raises(KeyboardInterrupt):
        gpucheck.gpucheck(str(tmp_path), "quick", ("bench",))
    r = json.loads((tmp_path / "report.json").read_text())
    assert r["bench"] == {"first": {"error": "out of GPU memory"}} and r["unfinished"] == "bench"
    assert "bench: cut short" in (tmp_path / "report.md").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json", "report.md"]


def test_pipeline_part_compares_only_with_a_single_run_that_worked(tmp_path, monkeypatch):
    from cupygpt import gpucheck_parts
    from cupygpt.gpucheck import PLANS
    runs = {"single": {"error": "out of GPU memory"},
            "nvshmem_2": {"ms_per_step_median": 1.0, "losses": [10.0, 9.0]}}
    monkeypatch.setattr(gpucheck_parts, "train_run",
                        lambda work, label, plan, pre: dict(runs[label]))
    got = {}
    for r in gpucheck_parts.pipeline(str(tmp_path), str(tmp_path), PLANS["quick"]):
        got.update(r)
    assert got["single"] == runs["single"] and got["nvshmem_2"] == runs["nvshmem_2"]
    runs["single"] = {"ms_per_step_median": 1.0, "losses": [10.0, 9.9]}
    got = {}
    for r in gpucheck_parts.pipeline(str(tmp_path), str(tmp_path), PLANS["quick"]):
        got.update(r)
    assert got["nvshmem_2"]["max_rel_loss_diff"] == pytest.approx(0.9 / 9.9)


def test_runs_start_in_the_work_dir_with_this_cupygpt(tmp_path):
    """Not in the repository (an installed wheel has none), yet importing the cupygpt that
    runs the check, also where it is not pip-installed (the PYTHONPATH it gets)."""
    from cupygpt import gpucheck_parts
    rc, text = gpucheck_parts.sh(
        [sys.executable, "-c", "import os, cupygpt; print(os.getcwd(), cupygpt.__file__)"],
        60, str(tmp_path / "log"), str(tmp_path))
    assert rc == 0 and text.split() == [
        str(tmp_path), os.path.join(gpucheck_parts.PKG, "__init__.py")], text


def test_tests_part_from_an_installed_wheel_names_what_it_needs(tmp_path, monkeypatch):
    """Outside a clone there are no GPU tests to run: one clear problem, not a crash."""
    from cupygpt import gpucheck_parts
    from cupygpt.gpucheck import PARTS, problems, summary
    monkeypatch.setattr(gpucheck_parts, "CLONE", str(tmp_path))  # what site-packages holds
    (result,) = gpucheck_parts.run_tests(str(tmp_path), str(tmp_path), {})
    need = "needs the repository's tests/ (run gpucheck from a clone)"
    assert result == {"error": need}
    r = {"plan": "quick", "versions": {}, "tests": result, **{p: {} for p in PARTS if p != "tests"}}
    assert problems(r) == [f"tests: {need}"]
    assert f"result: FAIL: tests: {need}" in summary(r)
