"""The GPU check: verify against llm.c's references, README's training commands, every
GPU test, the benchmarks beside their peers (llm.c, PyTorch), a pipeline run and
compute-sanitizer over our kernels, into one report (report.json + report.md), in that
order (the most valuable first) and within a budget of seconds: a lent GPU comes for about
15 minutes, its start included. Each piece runs in its own process, so one failure is
reported and the rest still runs; each is bounded by what is left of the budget, and one
that cannot fit is skipped, the report saying why.

The report is rewritten after each result, and a run of some parts (--part) merges into
the report already in the directory: a run cut short keeps what it finished. The directory
holds five files (report.json, report.md, the test and the two sanitizer logs); the runs'
own outputs go to a temporary one, which is also where they run. What each part runs is in
parts.py (the peers' in peers.py, how every run is bounded in runs.py); here are the plans,
the order of the parts and the report (report.py: each part's section of it)."""
import datetime
import json
import os
import platform
import shutil
import subprocess
import tempfile
import time

from cupygpt.paths import json_object

from .config import GPUCHECK_PARTS
from .parts import benches, comm, pipeline, readme, run_tests, sanitize, verify
from .peers import PeersBuild, peers
from .report import SECTIONS, ratios
from .runs import Budget, BudgetSpent, Skip

REPORT = "report gpucheck wrote"

# What the check benchmarks: the full plan is the (d12, T 128 and 1024); the quick
# one runs in minutes anywhere, cudasim included (a dry run of the check itself, which the
# tests run: every bench and pipeline run there, at the least size that still shows each).
# verify: llm.c's reference files (cupygpt/reference), whose shapes differ (odd T, 16 heads).
# warmup: untimed bench steps first; pipe_steps: the pipeline's median skips its first two.
# train_args: added to README's training commands (the quick plan's tiny model, 2 steps).
# need: the seconds one run of each part takes (full: measured on an H200, 2026-11-26, but
# comm's, a guess until a GPU has run it; quick: on cudasim, 2 busy cores): a run with less
# of the budget left is skipped. comm_steps: bench --comm's messages per timing.
PLANS = {"full": {"model": "d12", "t_short": 128, "t_long": 1024, "batches": (8, 16, 32),
                  "steps": 10, "warmup": 3, "pipe_steps": 20, "verify": ("tiny", "odd", "gpt2v"),
                  "train_args": (), "comm_steps": 50,
                  "need": {"verify": 5, "readme": 40, "tests": 100, "bench": 15, "peers": 60,
                           "pipeline": 20, "sanitizer": 10, "comm": 40}},
         "quick": {"model": "tiny", "t_short": 16, "t_long": 32, "batches": (8,),
                   "steps": 2, "warmup": 1, "pipe_steps": 4, "verify": ("tiny",),
                   "train_args": ("-e", "tiny", "-t", "16", "-n", "2"), "comm_steps": 2,
                   "need": {"verify": 10, "readme": 10, "tests": 15, "bench": 6, "peers": 5,
                            "pipeline": 10, "sanitizer": 3, "comm": 45}}}

# What each part runs, in the order they run (named in config.py, --part's choices)
PARTS = dict(zip(GPUCHECK_PARTS, (verify, readme, run_tests, benches, peers, pipeline,
                                  sanitize, comm)))


def versions():
    from importlib import metadata
    out = {"python": platform.python_version()}
    for pkg in ("cupy-cuda13x", "cupy-cuda12x", "nvshmem4py-cu13", "nvshmem4py-cu12",
                "cuda-bindings", "mpi4py", "numpy"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    try:
        import cupy as cp
        props = cp.cuda.runtime.getDeviceProperties(0)
        out.update(device=props["name"].decode(), gpus=cp.cuda.runtime.getDeviceCount(),
                   driver=cp.cuda.runtime.driverGetVersion(),
                   cuda_runtime=cp.cuda.runtime.runtimeGetVersion(),
                   memory_gib=round(props["totalGlobalMem"] / 2**30, 1))
    except Exception as e:  # reported, not fatal: the tests will say the rest
        out["device_error"] = str(e)
    mps = shutil.which("nvidia-cuda-mps-control")
    out["mps"] = "running" if mps and subprocess.run(
        ["pgrep", "-f", "nvidia-cuda-mps"], capture_output=True).returncode == 0 \
        else ("available, not running" if mps else "not installed")
    return out


def gpucheck(out, plan_name="full", parts=(), budget=420, peers_dir=None,
             clock=time.monotonic):
    """Runs the named parts (none named: all) in PARTS' order into out/report.{json,md}
    within `budget` seconds, keeping the other parts of a report of the same plan already
    there; the report is rewritten after each result. With peers_dir (the peers'
    directory, holding run-peers.sh), llm.c's build starts now, in the background, and the
    peers run after bench."""
    budget_s, budget = budget, Budget(budget, clock)
    plan = PLANS[plan_name]
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "report.json")  # (its parts are kept; none: {})
    report = json_object(path, REPORT) if os.path.lexists(path) else {}
    if report.get("plan") != plan_name:
        report = {"plan": plan_name}
    report.update(versions=versions(), budget_s=budget_s)
    # this call, named in each part it runs: bench and peers compare only within one call
    call = datetime.datetime.now().isoformat(timespec="milliseconds")
    todo = [part for part in PARTS if part in parts or not parts]
    with tempfile.TemporaryDirectory(prefix="gpucheck-") as work:
        build = PeersBuild(peers_dir, work, 4, plan["t_long"]) \
            if peers_dir and "peers" in todo else None
        try:
            for part in todo:
                run_part(report, part, out, work, {**plan, "peers": build}, budget, call, clock)
        finally:
            if build is not None:
                build.stop()
    return report, summary(report)


def run_part(report, part, out, work, plan, budget, call, clock):
    """One part into the report: its results as they come, the runs it skipped (and why)
    in report["skipped"], its seconds in report["elapsed_s"]."""
    skipped = report.setdefault("skipped", {})
    for key in [k for k in skipped if k.split(" ")[0] == part]:  # an earlier call's
        del skipped[key]
    report.pop(part, None)
    report.setdefault("ran_at", {})[part] = call
    report.setdefault("elapsed_s", {})[part] = 0.0
    why = ("no --peers DIR given" if part == "peers" and plan["peers"] is None
           else budget.short(plan["need"][part]))
    if why:
        skipped[part] = why
        write(out, report)
        return
    report[part], report["unfinished"] = {}, part
    start = clock()
    try:
        for result in PARTS[part](out, work, plan, budget):
            if isinstance(result, Skip):  # the whole part, e.g. no GPU to build llm.c for
                skipped[part] = result
            else:
                for key, value in result.items():
                    if isinstance(value, Skip):
                        skipped[f"{part} {key}"] = value
                    else:
                        report[part][key] = value
            report["elapsed_s"][part] = round(clock() - start, 1)
            write(out, report)
    except BudgetSpent as e:
        skipped[part] = str(e)
    if part in skipped and not report[part]:  # as a part the budget skipped before it began
        del report[part]
    report["elapsed_s"][part] = round(clock() - start, 1)
    del report["unfinished"]
    write(out, report)


def write(out, report):
    """Both files replaced whole, so a run killed mid-write leaves the previous report."""
    report["ratios"] = ratios(report)
    for name, text in (("report.json", json.dumps(report, indent=1)),
                       ("report.md", summary(report))):
        with open(os.path.join(out, name + ".tmp"), "w") as f:
            f.write(text)
        os.replace(os.path.join(out, name + ".tmp"), os.path.join(out, name))


def optional(key):
    """The comparisons and the extras: a peer's failure or skip, MPS's, a cuDNN run's skip
    (cuDNN, an extra, not installed) or NCCL's run beside nvshmem on one GPU (experimental in
    NCCL) is reported, never the check's."""
    return key.split(" ")[0] == "peers" or key.endswith(("_mps", "_cudnn", "_nccl"))


def problems(report):
    """Why the check fails, one line each; empty when every part that ran passed."""
    out = [f"{part}: not run" for part in PARTS if part not in report and not optional(part)
           and part not in report.get("skipped", {})]
    if "unfinished" in report:
        out.append(f"{report['unfinished']}: cut short")
    t = report.get("tests", {})
    if t and t["rc"] != 0:  # pytest's 5 (no GPU test collected) fails too
        out.append(f"tests: {t['failed']} failed, {t['errors']} errors (pytest exit {t['rc']})")
    for tool, v in report.get("sanitizer", {}).items():
        if not isinstance(v, dict) or not v["clean"]:
            out.append(f"sanitizer {tool}: {v if isinstance(v, str) else v['summary']}")
    out += [f"verify {name}: " + v.get("error", "outside the tolerances")
            for name, v in report.get("verify", {}).items() if not v.get("ok")]
    out += [f"readme `{cmd}`: {v['error']}" for cmd, v in report.get("readme", {}).items()
            if "error" in v]
    out += [f"bench {name}: {b['error']}" for name, b in report.get("bench", {}).items()
            if "error" in b]
    # MPS is optional (NVSHMEM's limited mode is what must work): its run is reported only
    out += [f"pipeline {k}: {v['error']}" for k, v in report.get("pipeline", {}).items()
            if isinstance(v, dict) and "error" in v and not optional(k)]
    # NCCL's ranks sharing a GPU are experimental: its comparison's failure is reported only
    out += [f"comm {k}: {v['error']}" for k, v in report.get("comm", {}).items()
            if isinstance(v, dict) and "error" in v and not optional(f"comm {k}")]
    return out


def unchecked(report):
    """What the check skipped that it must run (the budget ran out), one line each."""
    return [f"{key}: skipped ({why})" for key, why in report.get("skipped", {}).items()
            if not optional(key)]


def verdict(report):
    """PASS, FAIL (with each problem, and what was skipped) or INCOMPLETE (nothing failed,
    but some part was skipped): the report's result line; the check exits 0 on PASS."""
    bad, cut = problems(report), unchecked(report)
    if bad:
        return "FAIL: " + "; ".join(bad + cut)
    return "INCOMPLETE: " + "; ".join(cut) if cut else "PASS"


def summary(r):
    """report.md: the result line, the budget, what was skipped, then each part that ran,
    in the order the parts run."""
    v = r["versions"]
    lines = [f"# GPU check: {v.get('device', '?')} ({v.get('gpus', '?')} GPU), {r['plan']} plan",
             "versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if k != "device"),
             "result: " + verdict(r)]
    if r.get("elapsed_s"):  # parts merged from several calls each count their own
        lines.append(f"budget {r['budget_s']:g} s (this call's); elapsed: " +
                     ", ".join(f"{p} {s:g} s" for p, s in r["elapsed_s"].items()) +
                     f" (sum {sum(r['elapsed_s'].values()):.1f} s)")
    if r.get("skipped"):
        lines.append("skipped: " + "; ".join(f"{k} ({why})" for k, why in r["skipped"].items()))
    for part, section in SECTIONS.items():
        if r.get(part):
            lines += [""] + section(r, PLANS[r["plan"]])
    return "\n".join(lines) + "\n"
