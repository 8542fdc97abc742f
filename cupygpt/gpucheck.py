"""The GPU check: every GPU test, compute-sanitizer over our kernels, the benchmarks and
a pipeline run, into one report (report.json + report.md). Each piece runs in its own
process, so one failure is reported and the rest still runs."""
import glob
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import xml.etree.ElementTree as ET
from importlib import metadata

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLI = [sys.executable, os.path.join(ROOT, "cli.py")]


def sh(cmd, timeout):
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                           env={**os.environ, "PYTHONUNBUFFERED": "1"})
        return r.returncode, r.stdout + r.stderr
    except subprocess.TimeoutExpired as e:
        return 124, f"timed out after {timeout}s\n{e.stdout or ''}"


def versions():
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
    out["mps"] = "running" if mps and sh(["pgrep", "-f", "nvidia-cuda-mps-server"], 10)[0] == 0 \
        else ("available, not running" if mps else "not installed")
    return out


def run_tests(out):
    xml = os.path.join(out, "gpu_tests.xml")
    rc, log = sh([sys.executable, "-m", "pytest", "-q", "-m", "gpu", f"--junitxml={xml}",
                  "-p", "no:cacheprovider"], 1500)
    with open(os.path.join(out, "gpu_tests.log"), "w") as f:
        f.write(log)
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    try:
        suite = ET.parse(xml).getroot()
        suite = suite if suite.tag == "testsuite" else suite[0]
        tests = int(suite.get("tests"))
        counts.update(failed=int(suite.get("failures")), errors=int(suite.get("errors")),
                      skipped=int(suite.get("skipped")))
        counts["passed"] = tests - counts["failed"] - counts["errors"] - counts["skipped"]
        counts["failures"] = [c.get("name") for c in suite.iter("testcase")
                              if c.find("failure") is not None or c.find("error") is not None]
    except (OSError, ET.ParseError, IndexError):
        counts["errors"] = 1
    counts["rc"] = rc
    return counts


# verify on llm.c's tiny reference with CuPy's memory pool off, so that every array is its
# own cudaMalloc and memcheck sees an access past any of them.
SANITIZED = ("import sys, runpy, cupy; cupy.cuda.set_allocator(None); "
             "sys.argv = ['cli.py', 'verify', '--backend', 'cuda', '--steps', '1', '--model', "
             "'tests/fixtures/tiny_model.bin', '--state', 'tests/fixtures/tiny_debug_state.bin']; "
             "runpy.run_path('cli.py', run_name='__main__')")


def sanitize(out):
    """compute-sanitizer's memcheck (out-of-bounds and misaligned accesses) and racecheck
    (shared-memory hazards) over every kernel a verify step launches."""
    exe = shutil.which("compute-sanitizer") or next(
        iter(sorted(glob.glob("/usr/local/cuda*/bin/compute-sanitizer"))), None)
    if exe is None:
        return {"error": "compute-sanitizer not found"}
    res = {}
    for tool in ("memcheck", "racecheck"):
        rc, log = sh([exe, "--tool", tool, "--error-exitcode", "97", sys.executable, "-c",
                      SANITIZED], 1200)
        with open(os.path.join(out, f"sanitize_{tool}.log"), "w") as f:
            f.write(log)
        said = [x.strip("= ") for x in log.splitlines() if "SUMMARY" in x]
        res[tool] = {"rc": rc, "clean": rc == 0,
                     "summary": said[-1] if said else log.strip()[-200:]}
    return res


def bench(out, name, *args, timeout=400):
    path = os.path.join(out, f"bench_{name}.json")
    rc, log = sh(CLI + ["bench", "--out", path, *args], timeout)
    if rc != 0:
        return {"error": log.strip().splitlines()[-1] if log.strip() else f"exit {rc}"}
    return json.load(open(path))


# What the check benchmarks: the full plan is the (d12, T 128 and 1024); the quick
# one runs in minutes anywhere, cudasim included (a dry run of the check itself).
PLANS = {"full": {"model": "d12", "t_short": 128, "t_long": 1024, "batches": (8, 16, 32),
                  "steps": 10, "pipe_steps": 20},
         "quick": {"model": "tiny", "t_short": 32, "t_long": 64, "batches": (8,),
                   "steps": 3, "pipe_steps": 5}}


def pipeline(out, plan, ranks=2):
    """Per-step time of the same run on one GPU and as a `ranks`-stage nvshmem pipeline."""
    from .config import preset
    res = {}
    for label, pre in (("single", []), (f"nvshmem_{ranks}", ["mpiexec", "-n", str(ranks)])):
        log = os.path.join(out, f"pipe_{label}.jsonl")
        if os.path.exists(log):
            os.unlink(log)
        rc, text = sh(pre + CLI + ["train", "-e", plan["model"], "--backend", "cuda", "-b", "4",
                                   "-t", str(plan["t_short"]), "-n", str(plan["pipe_steps"]),
                                   "-v", "0", "-g", "0", "--no-graphs", "--log-file", log,
                                   "-o", os.path.join(out, "pipe_" + label)]
                      + (["--transport", "nvshmem"] if pre else []), 600)
        if rc != 0:
            res[label] = {"error": text.strip().splitlines()[-3:]}
            continue
        steps = [json.loads(x) for x in open(log)]
        steps = [s for s in steps if "train_loss" in s]
        res[label] = {"ms_per_step_median": statistics.median(s["ms"] for s in steps[2:]),
                      "losses": [s["train_loss"] for s in steps]}
    res["bytes_per_handoff"] = 4 * plan["t_short"] * preset(plan["model"]).C * 4  # (B,T,C) fp32
    if all("losses" in res.get(k, {}) for k in ("single", f"nvshmem_{ranks}")):
        a, b = res["single"]["losses"], res[f"nvshmem_{ranks}"]["losses"]
        res["max_rel_loss_diff"] = max(abs(x - y) / abs(x) for x, y in zip(a, b))
    return res


def gpucheck(out, plan_name="full"):
    plan = PLANS[plan_name]
    os.makedirs(out, exist_ok=True)
    report = {"plan": plan_name, "versions": versions(), "tests": run_tests(out),
              "sanitizer": sanitize(out)}
    m, ts, tl = plan["model"], plan["t_short"], plan["t_long"]
    runs = [(4, ts, ()), (4, tl, ("--profile",)), (4, tl, ("--no-graphs",))]
    runs += [(B, tl, ()) for B in plan["batches"]]
    report["bench"] = {}
    for B, T, extra in runs:  # named e.g. d12_T1024_B4_no_graphs
        name = f"{m}_T{T}_B{B}" + "".join("_" + e[2:].replace("-", "_") for e in extra)
        report["bench"][name] = bench(out, name, "-e", m, "-b", str(B), "-t", str(T), "--steps",
                                      str(plan["steps"]), *extra)
    report["pipeline"] = pipeline(out, plan)
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    md = summary(report)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(md)
    return report, md


def summary(r):
    v, t = r["versions"], r["tests"]
    lines = [f"# GPU check: {v.get('device', '?')} ({v.get('gpus', '?')} GPU)",
             "versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if k != "device"),
             f"tests: {t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped, "
             f"{t['errors']} errors" + (f" ({', '.join(t.get('failures', []))})"
                                       if t.get("failures") else ""),
             "compute-sanitizer: " + json.dumps(r["sanitizer"]),
             "", "| bench | ms/step | tok/s | MFU | host launch | peak GiB |", "|---|---|---|---|---|---|"]
    for name, b in r["bench"].items():
        if "error" in b:
            lines.append(f"| {name} | {b['error'][:60]} | | | | |")
            continue
        mfu = f"{100 * b['mfu']:.1f}%" if b.get("mfu") else "-"
        lines.append(f"| {name} | {b['ms_per_step_median']:.2f} | {b['tok_per_s']:.0f} | {mfu} | "
                     f"{100 * b['host_launch_fraction']:.1f}% | "
                     f"{b['peak_memory_bytes'] / 2**30:.2f} |")
    plan = PLANS[r["plan"]]
    m, ts, tl = plan["model"], plan["t_short"], plan["t_long"]
    prof = r["bench"].get(f"{m}_T{tl}_B4_profile", {}).get("per_op")
    if prof:
        lines += ["", f"| op ({m} B4 T{tl}, eager) | ms/step | share |", "|---|---|---|"]
        lines += [f"| {p['op']} | {p['ms_per_step']:.3f} | {100 * p['share']:.1f}% |" for p in prof]
    lines += ["", f"pipeline ({m}, B=4, T={ts}, 2 PEs over nvshmem): " +
              json.dumps({k: (v if not isinstance(v, dict) else
                              {kk: vv for kk, vv in v.items() if kk != "losses"})
                          for k, v in r["pipeline"].items()})]
    return "\n".join(lines) + "\n"
