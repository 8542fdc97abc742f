"""The GPU check's parts in-process (dev/gpucheck): the report and its verdict, each
part's runs within the budget, in order of value, the MPS server, the tests part, the
peers' comparisons (the command itself, its dry run on cudasim:
test_gpucheck_command.py)."""
import contextlib
import json
import os
import re
import sys
import time

import pytest
from harness import helpers_of

from cupygpt.paths import DATA, PACKAGE


def tools(tmp_path, **scripts):
    """A bin directory (put first on PATH) holding each named shell script."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in scripts.items():
        (bin_dir / name.replace("_", "-")).write_text("#!/bin/sh\n" + body)
        (bin_dir / name.replace("_", "-")).chmod(0o755)
    return str(bin_dir)


def test_report_names_each_failure():
    from dev.gpucheck.check import problems, summary

    def verified(ok):
        return {"ok": ok, "logits": 1e-6, "loss": 1e-7, "grad_abs": 1e-6, "grad_rel": 1e-5,
                "steps": 1e-6}

    r = {"plan": "quick", "versions": {"device": "X"},
         "tests": {"passed": 3, "failed": 1, "skipped": 0, "errors": 0, "rc": 1,
                   "failures": ["test_a"], "workers": 6},
         "sanitizer": {"memcheck": {"clean": True, "summary": "0 errors"},
                       "racecheck": {"clean": False, "summary": "2 hazards"}},
         "verify": {"tiny_no_tf32": verified(True), "tiny_tf32": verified(False),
                    "odd_no_tf32": {"error": "Traceback"}},
         "readme": {"python cli.py train": {"error": "NotImplementedError: cuBLAS during "
                                                      "stream capture", "seconds": 3.1}},
         "bench": {"tiny_T32_B4": {"error": "out of GPU memory"}}}
    assert problems(r) == ["pipeline: not run", "comm: not run",
                           "tests: 1 failed, 0 errors (pytest exit 1)",
                           "sanitizer racecheck: 2 hazards",
                           "verify tiny_tf32: outside the tolerances",
                           "verify odd_no_tf32: Traceback",
                           "readme `python cli.py train`: NotImplementedError: cuBLAS during "
                           "stream capture", "bench tiny_T32_B4: out of GPU memory"]
    md = summary(r)
    assert "result: FAIL: pipeline: not run; comm: not run; tests: 1 failed" in md
    assert "tests (6 processes): 3 passed, 1 failed, 0 skipped, 0 errors (test_a)" in md
    assert "pipeline (" not in md, "a part that did not run gets no section"
    assert problems({**r, "sanitizer": {"error": "compute-sanitizer not found"}})[3] == \
        "sanitizer error: compute-sanitizer not found"
    assert problems({**r, "unfinished": "bench"})[2] == "bench: cut short"
    # NCCL's run beside nvshmem on one GPU is experimental in NCCL: only nvshmem's counts
    refused = {"error": "error: --against nccl: 2 ranks but 1 GPU(s)"}
    comm = {"mps": "running", "against_nccl": refused, "nvshmem": {"error": "lost rank 1"}}
    assert problems({**r, "comm": comm})[-1] == "comm nvshmem: lost rank 1"
    assert not [x for x in problems({**r, "comm": comm}) if "against" in x]


def test_result_says_what_was_skipped_and_only_the_comparisons_may_be():
    """A part the budget skipped leaves the check INCOMPLETE (it proved less); the peers
    and the MPS run are comparisons, whose skips are listed but decide nothing."""
    from dev.gpucheck.check import PARTS, summary, verdict
    r = {"plan": "quick", "versions": {"device": "X"}, "budget_s": 60,
         **{p: {} for p in PARTS}, "elapsed_s": {"verify": 12.5, "bench": 40.0},
         "skipped": {"peers": "nvcc not found: llm.c cannot be built here",
                     "pipeline nvshmem_2_mps": "needs about 10 s, 4 s of the budget left"}}
    assert verdict(r) == "PASS"
    md = summary(r)
    assert "\nresult: PASS\n" in md
    assert "budget 60 s (this call's); elapsed: verify 12.5 s, bench 40 s (sum 52.5 s)" in md
    assert ("skipped: peers (nvcc not found: llm.c cannot be built here); pipeline nvshmem_2_mps "
            "(needs about 10 s, 4 s of the budget left)") in md
    cut = {**r["skipped"], "sanitizer": "needs about 3 s, 1 s of the budget left"}
    del r["sanitizer"]  # skipped whole: never started, so not in the report
    assert verdict({**r, "skipped": cut}) == \
        "INCOMPLETE: sanitizer: skipped (needs about 3 s, 1 s of the budget left)"
    assert verdict({**r, "skipped": cut, "unfinished": "bench"}) == \
        "FAIL: bench: cut short; sanitizer: skipped (needs about 3 s, 1 s of the budget left)"
    assert verdict(r) == "FAIL: sanitizer: not run", "neither run nor skipped: --part left it"


def test_mps_server_is_started_for_the_runs_inside_and_stopped(tmp_path, monkeypatch):
    from dev.gpucheck.parts import mps_server
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
    from dev.gpucheck import check as gpucheck

    def bench(out, work, plan, budget):
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
    from dev.gpucheck import parts as gpucheck_parts
    from dev.gpucheck import runs as gpucheck_runs
    from dev.gpucheck.check import PLANS
    runs = {"single": {"error": "out of GPU memory"},
            "nvshmem_2": {"ms_per_step_median": 1.0, "losses": [10.0, 9.0]},
            "nvshmem_2_mps": {"ms_per_step_median": 0.9, "losses": [10.0, 9.8]}}
    monkeypatch.setattr(gpucheck_parts, "train_run",
                        lambda work, label, plan, pre, budget: dict(runs[label]))
    monkeypatch.setattr(gpucheck_parts, "mps_server", lambda work: contextlib.nullcontext())
    budget = gpucheck_runs.Budget(60)
    got = {}
    for r in gpucheck_parts.pipeline(str(tmp_path), str(tmp_path), PLANS["quick"], budget):
        got.update(r)
    assert got["single"] == runs["single"] and got["nvshmem_2"] == runs["nvshmem_2"]
    runs["single"] = {"ms_per_step_median": 1.0, "losses": [10.0, 9.9]}
    got = {}
    for r in gpucheck_parts.pipeline(str(tmp_path), str(tmp_path), PLANS["quick"], budget):
        got.update(r)
    assert got["nvshmem_2"]["max_rel_loss_diff"] == pytest.approx(0.9 / 9.9)
    assert got["nvshmem_2_mps"]["max_rel_loss_diff"] == pytest.approx(0.1 / 9.9)


def test_runs_start_in_the_work_dir_with_this_cupygpt(tmp_path):
    """Not in the repository (an installed wheel has none), yet importing the cupygpt that
    runs the check, also where it is not pip-installed (the PYTHONPATH it gets)."""
    from dev.gpucheck import runs as gpucheck_runs
    rc, text = gpucheck_runs.sh(
        [sys.executable, "-c", "import os, cupygpt; print(os.getcwd(), cupygpt.__file__)"],
        60, str(tmp_path / "log"), str(tmp_path), gpucheck_runs.Budget(60))
    assert rc == 0 and text.split() == [
        str(tmp_path), os.path.join(PACKAGE, "__init__.py")], text


def test_parts_run_in_order_of_value_within_the_budget(tmp_path, monkeypatch):
    """Whatever order --part names them in; a part starts only with its one run's need
    left (quick plan: bench 6 s, pipeline 10 s), and the report has each part's seconds."""
    from dev.gpucheck import check as gpucheck
    assert list(gpucheck.PARTS) == ["verify", "readme", "tests", "bench", "peers", "pipeline",
                                    "sanitizer", "comm"]
    now, ran = [0.0], []
    takes = {"verify": 30, "readme": 30, "tests": 35, "sanitizer": 2}  # the others never start

    def part(name):
        def run(out, work, plan, budget):
            ran.append(name)
            now[0] += takes[name]
            yield from ()
        return run

    for name in gpucheck.PARTS:
        monkeypatch.setitem(gpucheck.PARTS, name, part(name))
    monkeypatch.setattr(gpucheck, "versions", lambda: {"device": "X"})
    report, md = gpucheck.gpucheck(str(tmp_path), "quick", tuple(reversed(gpucheck.PARTS)),
                                   budget=100, clock=lambda: now[0])
    assert ran == ["verify", "readme", "tests", "sanitizer"]
    assert report["elapsed_s"] == {"verify": 30, "readme": 30, "tests": 35, "bench": 0,
                                   "peers": 0, "pipeline": 0, "sanitizer": 2, "comm": 0}
    assert report["skipped"] == {"bench": "needs about 6 s, 5 s of the budget left",
                                 "peers": "no --peers DIR given",
                                 "pipeline": "needs about 10 s, 5 s of the budget left",
                                 "comm": "needs about 45 s, 3 s of the budget left"}
    assert gpucheck.verdict(report) == (
        "INCOMPLETE: bench: skipped (needs about 6 s, 5 s of the budget left); "
        "pipeline: skipped (needs about 10 s, 5 s of the budget left); "
        "comm: skipped (needs about 45 s, 3 s of the budget left)")
    assert json.loads((tmp_path / "report.json").read_text())["skipped"] == report["skipped"]
    assert "budget 100 s (this call's); elapsed: verify 30 s, readme 30 s, tests 35 s" in md


def test_bench_runs_the_peers_comparisons_first_and_skips_what_cannot_fit(monkeypatch):
    from dev.gpucheck import parts as gpucheck_parts
    from dev.gpucheck import runs as gpucheck_runs
    from dev.gpucheck.check import PLANS
    now, ran = [0.0], []

    def bench(work, name, budget, *args):
        ran.append((name, args[args.index("-b") + 1], args[args.index("-t") + 1], args[10:]))
        now[0] += 5
        return {"ms_per_step_median": 1.0}

    monkeypatch.setattr(gpucheck_parts, "bench", bench)
    budget = gpucheck_runs.Budget(22, clock=lambda: now[0])  # 4 runs of 5 s, a need of 6
    got = {}
    for r in gpucheck_parts.benches("out", "work", PLANS["quick"], budget):
        got.update(r)
    assert ran == [("tiny_T32_B4", "4", "32", ()),
                   ("tiny_T32_B4_no_graphs", "4", "32", ("--no-graphs",)),
                   ("tiny_T32_B4_dtype_fp32", "4", "32", ("--dtype=fp32",)),
                   ("tiny_T32_B4_profile", "4", "32", ("--profile",))]
    assert {k: v for k, v in got.items() if isinstance(v, gpucheck_runs.Skip)} == {
        "tiny_T16_B4": "needs about 6 s, 2 s of the budget left",
        "tiny_T32_B8": "needs about 6 s, 2 s of the budget left"}


def test_a_run_past_the_budget_is_cut_with_the_processes_it_started(tmp_path):
    """At the budget's end the whole process group goes (an MPI rank or a pytest worker
    left running would hold the GPU), and the part stops there; a run past its own cap
    is an error of that run."""
    from dev.gpucheck.runs import Budget, BudgetSpent, sh
    start = time.monotonic()
    with pytest.raises(BudgetSpent, match=r"^cut at the budget's end after 2 s, in run$"):
        sh(["bash", "-c", f"sleep 60 & echo $! > {tmp_path}/pid; wait"], 600,
           str(tmp_path / "run.log"), str(tmp_path), Budget(2))
    assert time.monotonic() - start < 10
    status = f"/proc/{(tmp_path / 'pid').read_text().strip()}/status"
    for _ in range(50):  # killed: gone, or a zombie until its new parent reaps it
        if not os.path.exists(status) or "\nState:\tZ" in open(status).read():
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the run's child outlived the budget")
    rc, text = sh(["sleep", "60"], 1, str(tmp_path / "log"), str(tmp_path), Budget(60))
    assert rc == 124 and text.endswith("timed out after 1s")


def test_tests_part_uses_pytest_xdist_when_it_is_there(tmp_path, monkeypatch):
    from dev.gpucheck import parts as gpucheck_parts
    cmds = []
    monkeypatch.setattr(gpucheck_parts, "sh", lambda cmd, *a: cmds.append(cmd) or (0, ""))
    for xdist, workers in ((object(), 6), (None, 1)):
        monkeypatch.setattr(gpucheck_parts.importlib.util, "find_spec",
                            lambda name, found=xdist: found if name == "xdist" else None)
        (r,) = gpucheck_parts.run_tests(str(tmp_path), str(tmp_path), {}, None)
        assert r["workers"] == workers
    assert cmds[0][-2:] == ["-n", "6"] and "-n" not in cmds[1]


def test_readme_part_runs_readmes_own_commands():
    """README's commands as it writes them, so that the check tries what a user would."""
    from dev.gpucheck.parts import README_COMMANDS
    commands = helpers_of("cli/test_readme.py").commands
    assert set(README_COMMANDS) <= set(commands())


# run-peers.sh's output as it prints it (as the peers' run-peers.sh prints it: its emit
# lines, PyTorch's JSON nested under "result", and its failure lines, one of them two
# lines long), from a fake whose build step, like the real one, is its lines before the
# first run: it leaves a stamp naming its folder and arguments, which the runs then need.
FAKE_PEERS = r'''#!/usr/bin/env bash
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
B=${1:-4}; T=${2:-1024}; data=${3:-data}
work=${PEERS_WORK:-/tmp/peers}; out=${OUT:-$work}/peers.jsonl; : > "$out"
emit() { echo "$1" | tee -a "$out"; }
[ -f "$work/built" ] || { sleep 1; echo "$here $B $T $data" > "$work/built"; }
tok=$((B * T))
echo "cp: cannot stat 'x': No such file or directory" >&2
[ -f "$work/built" ] || { echo "llm.c fp32 build failed: not built first"; exit 0; }
emit "{\"peer\": \"llm.c train_gpt2_fp32.cu\", \"B\": $B, \"T\": $T, \"ms_per_step\": 54.400, \"tok_s\": 2353}"
emit "{\"peer\": \"llm.c train_gpt2.cu (bf16)\", \"B\": $B, \"T\": $T, \"ms_per_step\": 14.190, \"tok_s\": 9020}"
echo "llm.c bf16 + cuDNN build failed: cudnn_att.cpp(3): error: cudnn_frontend.h: No such file"
emit "{\"peer\": \"pytorch eager\", \"result\": {\"peer\": \"pytorch\", \"device\": \"NVIDIA H200\", \"torch\": \"2.11.0\", \"compile\": false, \"tf32\": true, \"flash\": false, \"bf16\": false, \"L\": 12, \"C\": 768, \"B\": $B, \"T\": $T, \"ms_per_step\": 43.9, \"tok_per_s\": 2916, \"peak_mem_mib\": 3100}}"
printf 'pytorch --compile --flash failed: torch._dynamo.exc.BackendCompilerFailed\nRuntimeError: no triton\n'
emit "{\"peer\": \"pytorch --compile --flash --bf16\", \"result\": {\"peer\": \"pytorch\", \"device\": \"NVIDIA H200\", \"torch\": \"2.11.0\", \"compile\": true, \"tf32\": true, \"flash\": true, \"bf16\": true, \"L\": 12, \"C\": 768, \"B\": $B, \"T\": $T, \"ms_per_step\": 20.0, \"tok_per_s\": 6400, \"peak_mem_mib\": 2000}}"
'''


def test_peers_run_after_bench_in_the_same_call_give_ratios(tmp_path, monkeypatch):
    """llm.c's build starts with the check (before bench ends: the fake bench waits for
    its stamp), the peers run after bench at its B=4 and long T, and each ratio divides
    the cupygpt run of the peer's B, T and dtype (graphs where they worked) by the peer,
    auto's attention (cuDNN's here) and the own kernels' each; a peer's failure is
    reported and fails nothing; peers from another call get no ratio; a relative --peers
    works (the check runs them from its own work directory)."""
    from dev.gpucheck import check as gpucheck
    from dev.gpucheck import parts as gpucheck_parts
    from dev.gpucheck import report as gpucheck_report
    peers_dir = tmp_path / "peers"
    peers_dir.mkdir()
    (peers_dir / "run-peers.sh").write_text(FAKE_PEERS)
    monkeypatch.setenv("PATH", tools(tmp_path, nvcc="exit 0\n", nvidia_smi="echo 'NVIDIA H200'\n")
                       + os.pathsep + os.environ["PATH"])
    monkeypatch.setattr(gpucheck, "versions", lambda: {"device": "NVIDIA H200"})
    monkeypatch.setattr(gpucheck_parts, "cudnn_frontend", lambda: True)
    stamps = []

    def bench(work, name, budget, *args):
        stamp = os.path.join(work, "peers", "built")
        for _ in range(300):
            if os.path.exists(stamp):
                break
            time.sleep(0.1)
        stamps.append(open(stamp).read().split())
        B, T = int(args[args.index("-b") + 1]), int(args[args.index("-t") + 1])
        ms = {"tiny_T32_B4": 16.19, "tiny_T32_B4_attention_own": 17.5,
              "tiny_T32_B4_no_graphs": 16.71, "tiny_T32_B4_dtype_fp32": 30.0,
              "tiny_T32_B4_profile": 16.4, "tiny_T16_B4": 9.0, "tiny_T32_B8": 30.2}[name]
        own = "--attention=own" in args or "--dtype=fp32" in args
        return {"device": "NVIDIA H200", "B": B, "T": T, "ms_per_step_median": ms,
                "attention": "own flash kernels" if own else "cuDNN fused sdpa (auto)",
                "graphs": "--no-graphs" not in args,
                "dtype": "fp32" if "--dtype=fp32" in args else "bf16",
                "tok_per_s": B * T / ms * 1e3, "mfu": None, "host_launch_fraction": 0.1,
                "peak_memory_bytes": 2**30}

    monkeypatch.setattr(gpucheck_parts, "bench", bench)
    out = tmp_path / "report"
    monkeypatch.chdir(tmp_path)  # the peers named as README does: a relative path
    report, md = gpucheck.gpucheck(str(out), "quick", ("bench", "peers"), budget=120,
                                   peers_dir="peers")
    assert stamps[0] == [str(peers_dir), "4", "32", DATA], "built from the start"
    h200 = {"device": "NVIDIA H200", "B": 4, "T": 32}
    assert report["peers"] == {
        "llm.c train_gpt2_fp32.cu": {**h200, "ms_per_step": 54.4, "tok_s": 2353, "dtype": "fp32"},
        "llm.c train_gpt2.cu (bf16)": {**h200, "ms_per_step": 14.19, "tok_s": 9020,
                                       "dtype": "bf16"},
        "llm.c bf16 + cuDNN": {"error": "cudnn_att.cpp(3): error: cudnn_frontend.h: No such file"},
        "pytorch eager": {**h200, "ms_per_step": 43.9, "tok_s": 2916, "dtype": "fp32"},
        "pytorch --compile --flash": {"error": "torch._dynamo.exc.BackendCompilerFailed / "
                                               "RuntimeError: no triton"},
        "pytorch --compile --flash --bf16": {**h200, "ms_per_step": 20.0, "tok_s": 6400,
                                             "dtype": "bf16"}}
    ours = {"cupygpt_device": "NVIDIA H200", "peer_device": "NVIDIA H200"}
    bf16 = {**ours, "cupygpt": "tiny_T32_B4", "cupygpt_ms": 16.19}
    fp32 = {**ours, "cupygpt": "tiny_T32_B4_dtype_fp32", "cupygpt_ms": 30.0}
    own = {**ours, "cupygpt": "tiny_T32_B4_attention_own", "cupygpt_ms": 17.5}
    assert report["ratios"] == {
        "llm.c train_gpt2_fp32.cu": {**fp32, "peer_ms": 54.4, "ratio": pytest.approx(30 / 54.4)},
        "llm.c train_gpt2.cu (bf16)": {**bf16, "peer_ms": 14.19,
                                       "ratio": pytest.approx(16.19 / 14.19)},
        "llm.c train_gpt2.cu (bf16) / own": {**own, "peer_ms": 14.19,
                                             "ratio": pytest.approx(17.5 / 14.19)},
        "pytorch eager": {**fp32, "peer_ms": 43.9, "ratio": pytest.approx(30 / 43.9)},
        "pytorch --compile --flash --bf16": {**bf16, "peer_ms": 20.0,
                                             "ratio": pytest.approx(16.19 / 20)},
        "pytorch --compile --flash --bf16 / own": {**own, "peer_ms": 20.0,
                                                   "ratio": pytest.approx(17.5 / 20)}}
    assert json.loads((out / "report.json").read_text())["ratios"] == report["ratios"]
    assert gpucheck.verdict(report) == "FAIL: verify: not run; readme: not run; tests: not run; " \
        "pipeline: not run; sanitizer: not run; comm: not run", \
        "the peer failures are not among them"
    assert ("| llm.c train_gpt2.cu (bf16) | NVIDIA H200 | 4 | 32 | bf16 | 14.19 | tiny_T32_B4: "
            "16.19 ms on NVIDIA H200 | 1.14 |") in md
    assert ("| llm.c train_gpt2.cu (bf16) | NVIDIA H200 | 4 | 32 | bf16 | 14.19 | "
            "tiny_T32_B4_attention_own: 17.50 ms on NVIDIA H200 | 1.23 |") in md
    assert "| pytorch --compile --flash | torch._dynamo.exc.BackendCompilerFailed / Runtime" in md
    # the graph run failing (as every capture did on the H200), the eager one stands in
    failed = {**report, "bench": {**report["bench"], "tiny_T32_B4": {"error": "capture"},
                                  "tiny_T32_B4_attention_own": {"error": "capture"},
                                  "tiny_T32_B4_profile": {"error": "capture"}}}
    assert gpucheck_report.ratios(failed)["llm.c train_gpt2.cu (bf16)"]["cupygpt"] == \
        "tiny_T32_B4_no_graphs"
    report, md = gpucheck.gpucheck(str(out), "quick", ("peers",), budget=60,
                                   peers_dir=str(peers_dir))
    assert report["peers"]["pytorch eager"]["ms_per_step"] == 43.9
    assert report["ratios"] == {} and "| - | - |" in md, "bench ran in another call"


def test_peers_cut_at_the_budgets_end_keep_those_that_finished(tmp_path, monkeypatch):
    from dev.gpucheck import check as gpucheck
    peers_dir = tmp_path / "peers"
    peers_dir.mkdir()
    (peers_dir / "run-peers.sh").write_text(FAKE_PEERS + "sleep 60\n")  # torch.compile's
    monkeypatch.setenv("PATH", tools(tmp_path, nvcc="exit 0\n", nvidia_smi="echo 'NVIDIA H200'\n")
                       + os.pathsep + os.environ["PATH"])
    monkeypatch.setattr(gpucheck, "versions", lambda: {"device": "NVIDIA H200"})
    start = time.monotonic()
    report, md = gpucheck.gpucheck(str(tmp_path / "report"), "quick", ("peers",), budget=8,
                                   peers_dir=str(peers_dir))
    assert time.monotonic() - start < 12
    assert report["peers"]["llm.c train_gpt2.cu (bf16)"]["ms_per_step"] == 14.19
    assert len(report["peers"]) == 6
    assert re.fullmatch(r"cut at the budget's end after \d s, in peers", report["skipped"]["peers"])
    assert gpucheck.verdict(report).startswith("FAIL: verify: not run"), "and not for the peers"


def test_peers_output_without_step_times_or_a_line_is_an_error():
    from dev.gpucheck.peers import parse_peers
    text = ('{"peer": "llm.c train_gpt2.cu (bf16)", "B": 4, "T": 1024, "ms_per_step": null, '
            '"tok_s": null}\npytorch  failed: ModuleNotFoundError: No module named torch\n')
    assert parse_peers(text, "NVIDIA H100") == {
        "llm.c train_gpt2.cu (bf16)": {"error": "no step times in its output"},
        "pytorch eager": {"error": "ModuleNotFoundError: No module named torch"}}


def test_peers_need_nvcc_and_nvidia_smi(tmp_path, monkeypatch):
    """Where either is missing the peers are a reported skip (the dry run covers an
    nvidia-smi that finds no GPU)."""
    from dev.gpucheck.peers import PeersBuild
    monkeypatch.setenv("PATH", tools(tmp_path))
    assert PeersBuild.gpu() == ("nvcc not found: llm.c cannot be built here", None)
    tools(tmp_path, nvcc="exit 0\n")
    assert PeersBuild.gpu() == ("nvidia-smi not found: llm.c cannot be built here", None)
