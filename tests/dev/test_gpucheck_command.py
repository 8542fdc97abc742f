"""The GPU check end to end, as a dry run on cudasim: every GPU test (on the stand-in),
the benchmarks and the nvshmem pipeline, into one report. Without a GPU it refuses; a bad
flag is one line before anything runs."""
import json
import os
import re
import time

import pytest
from harness import ROOT, device_env, gpu_available, gpucheck, helpers_of, one_line, requires_sim

PKG = os.path.join(ROOT, "cupygpt")

# The dry run proves the check's plumbing; the GPU tests themselves already run on cudasim
# as their "sim" variants, so its nested pytest takes a subset (pytest reads PYTEST_ADDOPTS):
# the kernel tests, in-process and quick.
NESTED = "-k kernels_match"


@requires_sim
@pytest.mark.timeout(1200)
def test_gpucheck_dry_run_on_cudasim(tmp_path):
    """The whole check in one call within its default budget, then one part again merged
    into its report. The peers cannot build here (nvidia-smi finds no GPU, as where there
    is none): a reported skip, which fails nothing."""
    from dev.gpucheck.check import PARTS, PLANS
    peers = tmp_path / "peers"
    peers.mkdir()
    (peers / "run-peers.sh").write_text("echo '{\"peer\": \"ran without a GPU\"}'\n")
    no_gpu = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."
    tools = helpers_of("dev/test_gpucheck.py").tools  # (the peers' tests' fakes)
    bin_dir = tools(tmp_path, nvcc="exit 0\n", nvidia_smi=f'echo "{no_gpu}"; exit 9\n')
    sim = device_env("sim")
    env = {**sim, "PYTEST_ADDOPTS": NESTED, "PATH": bin_dir + os.pathsep + sim["PATH"]}
    out = tmp_path / "report"
    start = time.monotonic()
    res = gpucheck("--quick", "--budget", "420", "--peers", peers, "--out", out,
              env=env, timeout=900)
    wall = time.monotonic() - start
    assert res.returncode == 0, res.stdout + res.stderr
    assert wall < 420, f"the check took {wall:.0f} s of its 420"
    assert sorted(p.name for p in out.iterdir()) == [
        "gpu_tests.log", "report.json", "report.md", "sanitize_memcheck.log",
        "sanitize_racecheck.log"], "the runs' own outputs stay out of the report directory"
    r = json.loads((out / "report.json").read_text())
    assert r["plan"] == "quick" and r["versions"]["device"] == "cudasim (CPU)"
    no_cudnn = r["skipped"]["verify tiny_bf16_cudnn"]  # cudasim's cuDNN: no library
    assert no_cudnn.startswith("error: --attention cudnn: the cuDNN library is not installed")
    assert r["skipped"] == {"verify tiny_bf16_cudnn": no_cudnn,
                            "peers": f"nvidia-smi found no GPU to build llm.c for: {no_gpu}"}
    assert "peers" not in r and r["ratios"] == {}
    assert list(r["elapsed_s"]) == list(PARTS) and r["elapsed_s"]["peers"] == 0
    assert all(r["elapsed_s"][p] > 0 for p in PARTS if p != "peers"), r["elapsed_s"]
    assert sum(r["elapsed_s"].values()) < wall
    v = r["verify"]
    assert v["tiny_no_tf32"]["ok"] and v["tiny_no_tf32"]["logits"] < 1e-5, v
    assert v["tiny_tf32"]["ok"] and v["tiny_tf32"]["logits"] > 10 * v["tiny_no_tf32"]["logits"]
    assert v["tiny_bf16"]["ok"] and v["tiny_bf16"]["logits"] > 10 * v["tiny_no_tf32"]["logits"]
    for cmd, run in r["readme"].items():  # a fresh tiny model's loss: about ln(50257) = 10.8
        assert "error" not in run and 10 < run["val_loss"] < 11.5, (cmd, run)
    t = r["tests"]
    assert t["failed"] == 0 and t["errors"] == 0 and t["passed"] >= 4, t  # 4 kernel shapes
    assert r["bench"] and all("error" not in b for b in r["bench"].values()), r["bench"]
    for run in ("nvshmem_2", "nvshmem_2_mps"):
        assert r["pipeline"][run]["max_rel_loss_diff"] < 1e-5, r["pipeline"]
    assert all(r["sanitizer"][tool]["clean"] for tool in ("memcheck", "racecheck"))
    c = r["comm"]  # nvshmem against NCCL on the one (simulated) GPU, and the prediction
    assert c["mps"] == "running" and c["against_nccl"]["transports"] == ["nvshmem", "nccl"]
    assert set(c["against_nccl"]["seeds"]) == {"nvshmem", "nccl"}
    assert c["prediction"]["stages"] == 2 and c["prediction"]["step_ms"] > 0
    md = (out / "report.md").read_text()
    assert md.startswith("# GPU check: cudasim (CPU)") and "\nresult: PASS\n" in md
    assert "budget 420 s (this call's); elapsed: verify " in md
    assert f"skipped: verify tiny_bf16_cudnn ({no_cudnn}); peers (nvidia-smi found no GPU to " \
        f"build llm.c for: {no_gpu})" in md
    assert "| tiny_no_tf32 | True |" in md and "| `python cli.py train` | ok |" in md
    profile = f"| tiny_T{PLANS['quick']['t_long']}_B4_profile |"  # the profiled bench's ops
    assert profile in md and "| cross_entropy |" in md and "nvshmem_2" in md
    assert md.index("| verify") < md.index("| README") < md.index("tests (") < md.index(
        "| bench") < md.index("pipeline (") < md.index("compute-sanitizer") < md.index(
        "comm (tiny, 2 PEs on one GPU"), "the parts' order"
    res = gpucheck("--quick", "--out", out, "--part", "sanitizer", env=env, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    again = json.loads((out / "report.json").read_text())
    assert {k: again[k] for k in PARTS if k in r} == {k: r[k] for k in PARTS if k in r}
    assert again["ran_at"]["sanitizer"] > r["ran_at"]["sanitizer"]
    assert again["ran_at"]["verify"] == r["ran_at"]["verify"], "a part not run keeps its call"
    assert again["skipped"] == r["skipped"], "the peers' skip stays until they run again"


@requires_sim
def test_a_budget_too_small_for_any_part_skips_each_and_exits_1(tmp_path):
    """The command's own path: the report written, every part skipped and why, none run."""
    from dev.gpucheck.check import PARTS, PLANS
    res = gpucheck("--quick", "--budget", "1", "--out", tmp_path, env=device_env("sim"))
    assert res.returncode == 1, res.stdout + res.stderr
    r = json.loads((tmp_path / "report.json").read_text())
    assert set(r) & set(PARTS) == set() and r["elapsed_s"] == {p: 0 for p in PARTS}
    assert r["skipped"].pop("peers") == "no --peers DIR given"
    for part, why in r["skipped"].items():
        assert re.fullmatch(rf"needs about {PLANS['quick']['need'][part]} s, [01] s of the "
                            "budget left", why), (part, why)
    assert "result: INCOMPLETE: verify: skipped (needs about 10 s" in res.stdout


@pytest.mark.skipif(gpu_available(), reason="this machine has a GPU")
def test_gpucheck_refuses_without_a_gpu(tmp_path):
    res = gpucheck("--out", tmp_path)
    assert res.returncode == 1 and res.stderr.strip().startswith("error: gpucheck: no GPU")
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


@pytest.mark.parametrize("flags, line", [
    (("--budget", "-5"), "error: --budget -5.0: must be a positive number of seconds"),
    (("--budget", "0"), "error: --budget 0.0: must be a positive number of seconds"),
    (("--budget", "nan"), "error: --budget nan: must be a positive number of seconds"),
    (("--peers", "MISSING"), "error: --peers MISSING: must be the peers' directory (it has "
                             "no run-peers.sh)")])
def test_bad_flags_say_one_line_before_anything_runs(tmp_path, flags, line):
    """Before the GPU is looked for (so here, without one, the flag's line and not the
    GPU's) and before the report's directory is made."""
    missing = str(tmp_path / "MISSING")  # no such directory
    res = gpucheck("--out", tmp_path / "report",
              *[missing if f == "MISSING" else f for f in flags])
    assert res.returncode == 1 and res.stderr == line.replace("MISSING", missing) + "\n"
    assert not (tmp_path / "report").exists()


def test_gpucheck_writes_nothing_into_the_installed_package(tmp_path):
    (tmp_path / "link").symlink_to(PKG)
    for out in (os.path.join(PKG, "gpurep"), tmp_path / "link" / "gpurep"):
        one_line(gpucheck("--out", out, "--budget", 20, "--part", "peers"),
                 f"--out {out}: lies in the installed package")
        assert not os.path.exists(os.path.join(PKG, "gpurep"))


def test_gpucheck_refuses_an_out_it_cannot_use_in_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    one_line(gpucheck("--out", tmp_path / "file"),
             f"--out {tmp_path / 'file'}: is a file, not a directory")
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "report.json").write_text("not JSON")
    one_line(gpucheck("--out", tmp_path / "r"), "report.json: not a report gpucheck "
                                                        "wrote (not a JSON object")
    assert (tmp_path / "r" / "report.json").read_text() == "not JSON"
    (tmp_path / "r" / "report.json").write_text("[1]")
    one_line(gpucheck("--out", tmp_path / "r"), "not a report gpucheck wrote")
    one_line(gpucheck("--out", "/proc/1/x"), "--out /proc/1/x: cannot")
