"""The GPU check: every GPU test, verify against llm.c's references, compute-sanitizer over
our kernels, the benchmarks and a pipeline run, into one report (report.json + report.md).
Each piece runs in its own process, so one failure is reported and the rest still runs.

The report is rewritten after each result, and a run of some parts (--part) merges into
the report already in the directory: a machine that allows ten minutes per command runs
the check in pieces, and a run cut short keeps what it finished. The directory holds five
files (report.json, report.md, the test and the two sanitizer logs); the runs' own outputs
go to a temporary one, which is also where they run. What each part runs is in
gpucheck_parts.py; here are the plans, the order of the parts and the report."""
import json
import os
import platform
import shutil
import subprocess
import tempfile

from .gpucheck_parts import benches, pipeline, run_tests, sanitize, verify

# What the check benchmarks: the full plan is the (d12, T 128 and 1024); the quick
# one runs in minutes anywhere, cudasim included (a dry run of the check itself, which the
# tests run: every bench and pipeline run there, at the least size that still shows each).
# verify: llm.c's reference files (cupygpt/reference), whose shapes differ (odd T, 16 heads).
# warmup: untimed bench steps first; pipe_steps: the pipeline's median skips its first two.
PLANS = {"full": {"model": "d12", "t_short": 128, "t_long": 1024, "batches": (8, 16, 32),
                  "steps": 10, "warmup": 3, "pipe_steps": 20, "verify": ("tiny", "odd", "gpt2v")},
         "quick": {"model": "tiny", "t_short": 16, "t_long": 32, "batches": (8,),
                   "steps": 2, "warmup": 1, "pipe_steps": 4, "verify": ("tiny",)}}

PARTS = {"tests": run_tests, "verify": verify, "sanitizer": sanitize, "bench": benches,
         "pipeline": pipeline}


def versions():
    from importlib import metadata  # here, not at the top: cli.py imports this module
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


def gpucheck(out, plan_name="full", parts=(), mps=False):
    """Runs the named parts (none named: all) into out/report.{json,md}, keeping the other
    parts of a report of the same plan already there; the report is rewritten after each
    result."""
    plan = {**PLANS[plan_name], "mps": mps}
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "report.json")
    report = json.load(open(path)) if os.path.exists(path) else {}
    if report.get("plan") != plan_name:
        report = {"plan": plan_name}
    report["versions"] = versions()
    with tempfile.TemporaryDirectory(prefix="gpucheck-") as work:
        for part in PARTS:  # in this order whatever the order asked
            if part in parts or not parts:
                report[part], report["unfinished"] = {}, part
                for result in PARTS[part](out, work, plan):
                    report[part].update(result)
                    write(out, report)
                del report["unfinished"]
                write(out, report)
    return report, summary(report)


def write(out, report):
    """Both files replaced whole, so a run killed mid-write leaves the previous report."""
    for name, text in (("report.json", json.dumps(report, indent=1)),
                       ("report.md", summary(report))):
        with open(os.path.join(out, name + ".tmp"), "w") as f:
            f.write(text)
        os.replace(os.path.join(out, name + ".tmp"), os.path.join(out, name))


def problems(report):
    """Why the check fails, one line each; empty when every part ran and passed."""
    out = [f"{part}: not run" for part in PARTS if part not in report]
    if "unfinished" in report:
        out.append(f"{report['unfinished']}: cut short")
    t = report.get("tests", {})
    if "error" in t:  # from an installed wheel: no tests to run
        out.append(f"tests: {t['error']}")
    elif t and t["rc"] != 0:  # pytest's 5 (no GPU test collected) fails too
        out.append(f"tests: {t['failed']} failed, {t['errors']} errors (pytest exit {t['rc']})")
    for tool, v in report.get("sanitizer", {}).items():
        if not isinstance(v, dict) or not v["clean"]:
            out.append(f"sanitizer {tool}: {v if isinstance(v, str) else v['summary']}")
    out += [f"verify {name}: " + v.get("error", "outside README's tolerances")
            for name, v in report.get("verify", {}).items() if not v.get("ok")]
    out += [f"bench {name}: {b['error']}" for name, b in report.get("bench", {}).items()
            if "error" in b]
    # MPS is optional (NVSHMEM's limited mode is what must work): its run is reported only
    out += [f"pipeline {k}: {v['error']}" for k, v in report.get("pipeline", {}).items()
            if isinstance(v, dict) and "error" in v and not k.endswith("_mps")]
    return out


def summary(r):
    v, plan = r["versions"], PLANS[r["plan"]]
    m, ts, tl = plan["model"], plan["t_short"], plan["t_long"]
    bad = problems(r)
    lines = [f"# GPU check: {v.get('device', '?')} ({v.get('gpus', '?')} GPU), {r['plan']} plan",
             "versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if k != "device"),
             "result: " + ("PASS" if not bad else "FAIL: " + "; ".join(bad))]
    if "tests" in r and "error" not in r["tests"]:  # an error is in the result line
        t = r["tests"]
        lines.append(f"tests: {t['passed']} passed, {t['failed']} failed, {t['skipped']} "
                     f"skipped, {t['errors']} errors" +
                     (f" ({', '.join(t['failures'])})" if t.get("failures") else ""))
    if "verify" in r:
        lines += ["", "| verify (max abs diff vs PyTorch) | ok | logits | loss | grads (abs / rel "
                  "to max) | AdamW step losses |", "|---|---|---|---|---|---|"]
        for name, x in r["verify"].items():
            lines.append(f"| {name} | {x['error'][:60]} | | | | |" if "error" in x else
                         f"| {name} | {x['ok']} | {x['logits']:.2e} | {x['loss']:.2e} | "
                         f"{x['grad_abs']:.2e} / {x['grad_rel']:.2e} | {x['steps']:.2e} |")
    if "sanitizer" in r:
        lines.append("compute-sanitizer: " + json.dumps(r["sanitizer"]))
    if "bench" in r:
        lines += ["", "| bench | ms/step | tok/s | MFU | host launch | peak GiB |",
                  "|---|---|---|---|---|---|"]
        for name, b in r["bench"].items():
            if "error" in b:
                lines.append(f"| {name} | {b['error'][:60]} | | | | |")
                continue
            mfu = f"{100 * b['mfu']:.1f}%" if b.get("mfu") else "-"
            lines.append(f"| {name} | {b['ms_per_step_median']:.2f} | {b['tok_per_s']:.0f} | "
                         f"{mfu} | {100 * b['host_launch_fraction']:.1f}% | "
                         f"{b['peak_memory_bytes'] / 2**30:.2f} |")
        prof = r["bench"].get(f"{m}_T{tl}_B4_profile", {})
        if prof.get("per_op"):
            lines += ["", f"| op ({m} B4 T{tl}, eager) | ms/step | share |", "|---|---|---|"]
            lines += [f"| {p['op']} | {p['ms_per_step']:.3f} | {100 * p['share']:.1f}% |"
                      for p in prof["per_op"]]
            lines += ["", "| op: kernel (top 20) | calls/step | ms/step | share |",
                      "|---|---|---|---|"]
            lines += [f"| {p['op']}: {p['kernel']} | {p['calls_per_step']} | "
                      f"{p['ms_per_step']:.3f} | {100 * p['share']:.1f}% |"
                      for p in prof["per_kernel"][:20]]
    if "pipeline" in r:
        lines += ["", f"pipeline ({m}, B=4, T={ts}, 2 PEs over nvshmem): " +
                  json.dumps({k: (v if not isinstance(v, dict) else
                                  {kk: vv for kk, vv in v.items() if kk != "losses"})
                              for k, v in r["pipeline"].items()})]
    return "\n".join(lines) + "\n"
