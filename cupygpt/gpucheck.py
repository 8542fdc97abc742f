"""The GPU check: every GPU test, verify against llm.c's references, compute-sanitizer over
our kernels, the benchmarks and a pipeline run, into one report (report.json + report.md).
Each piece runs in its own process, so one failure is reported and the rest still runs.

The report is rewritten after each result, and a run of some parts (--part) merges into
the report already in the directory: a machine that allows ten minutes per command runs
the check in pieces, and a run cut short keeps what it finished. The directory holds five
files (report.json, report.md, the test and the two sanitizer logs); the runs' own outputs
go to a temporary one."""
import contextlib
import glob
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLI = [sys.executable, os.path.join(ROOT, "cli.py")]


def sh(cmd, timeout, log):
    """Runs cmd with its output going to the file log as it comes (a run killed from outside
    keeps what it printed); returns (exit status, output)."""
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                                cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    text = open(log, errors="replace").read()
    return rc, text + (f"\ntimed out after {timeout}s" if rc == 124 else "")


def last_line(text, rc):
    return text.strip().splitlines()[-1] if text.strip() else f"exit {rc}"


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


def run_tests(out, work, plan):
    xml = os.path.join(work, "gpu_tests.xml")
    rc, _ = sh([sys.executable, "-m", "pytest", "-q", "-m", "gpu", f"--junitxml={xml}",
                "-p", "no:cacheprovider"], 1500, os.path.join(out, "gpu_tests.log"))
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
    yield counts


# verify on llm.c's tiny reference with CuPy's memory pool off, so that every array is its
# own cudaMalloc and memcheck sees an access past any of them.
SANITIZED = ("import sys, runpy, cupy; cupy.cuda.set_allocator(None); "
             "sys.argv = ['cli.py', 'verify', '--backend', 'cuda', '--steps', '1', '--model', "
             "'tests/fixtures/tiny_model.bin', '--state', 'tests/fixtures/tiny_debug_state.bin']; "
             "runpy.run_path('cli.py', run_name='__main__')")


def sanitize(out, work, plan):
    """compute-sanitizer's memcheck (out-of-bounds and misaligned accesses) and racecheck
    (shared-memory hazards) over every kernel a verify step launches."""
    exe = shutil.which("compute-sanitizer") or next(
        iter(sorted(glob.glob("/usr/local/cuda*/bin/compute-sanitizer"))), None)
    if exe is None:
        yield {"error": "compute-sanitizer not found"}
        return
    for tool in ("memcheck", "racecheck"):
        rc, log = sh([exe, "--tool", tool, "--error-exitcode", "97", sys.executable, "-c",
                      SANITIZED], 1200, os.path.join(out, f"sanitize_{tool}.log"))
        said = [x.strip("= ") for x in log.splitlines() if "SUMMARY" in x]
        yield {tool: {"rc": rc, "clean": rc == 0,
                      "summary": said[-1] if said else log.strip()[-200:]}}


def bench(work, name, *args, timeout=400):
    path = os.path.join(work, f"bench_{name}.json")
    rc, log = sh(CLI + ["bench", "--out", path, *args], timeout, path + ".log")
    return {"error": last_line(log, rc)} if rc != 0 else json.load(open(path))


def verify(out, work, plan):
    """verify --backend cuda on each reference, TF32 off and on: the largest differences
    from PyTorch, checked against (and to set) README's tolerances for each mode."""
    for name in plan["verify"]:
        for tf32 in ("--no-tf32", "--tf32"):
            fx = os.path.join(ROOT, "tests", "fixtures", name)
            key = name + tf32[1:].replace("-", "_")  # e.g. tiny_no_tf32
            log = os.path.join(work, f"verify_{key}.log")
            rc, text = sh(CLI + ["verify", "--backend", "cuda", tf32, "--json", "--model",
                                 fx + "_model.bin", "--state", fx + "_debug_state.bin",
                                 "--expected", fx + "_expected.json"], 300, log)
            try:  # its one JSON line (exit 1 when outside the tolerances still prints it)
                r = json.loads(next(x for x in text.splitlines()[::-1] if x.startswith("{")))
            except (ValueError, StopIteration):
                yield {key: {"error": last_line(text, rc)}}
                continue
            yield {key: {
                "ok": r["ok"], "logits": r["logits"]["max_abs_diff"],
                "loss": r["loss"]["abs_diff"],
                "grad_rel": max(g["max_abs_diff"] / g["max_abs_ref"] for g in r["grads"].values()),
                "grad_abs": max(g["max_abs_diff"] for g in r["grads"].values()),
                "steps": max(st["abs_diff"] for st in r["steps"])}}


# What the check benchmarks: the full plan is the (d12, T 128 and 1024); the quick
# one runs in minutes anywhere, cudasim included (a dry run of the check itself).
# verify: llm.c's reference files (tests/fixtures), whose shapes differ (odd T, 16 heads).
PLANS = {"full": {"model": "d12", "t_short": 128, "t_long": 1024, "batches": (8, 16, 32),
                  "steps": 10, "pipe_steps": 20, "verify": ("tiny", "odd", "gpt2v")},
         "quick": {"model": "tiny", "t_short": 32, "t_long": 64, "batches": (8,),
                   "steps": 3, "pipe_steps": 5, "verify": ("tiny",)}}


def benches(out, work, plan):
    m, ts, tl = plan["model"], plan["t_short"], plan["t_long"]
    runs = [(4, ts, ()), (4, tl, ("--profile",)), (4, tl, ("--no-graphs",))]
    runs += [(B, tl, ()) for B in plan["batches"]]
    for B, T, extra in runs:  # named e.g. d12_T1024_B4_no_graphs
        name = f"{m}_T{T}_B{B}" + "".join("_" + e[2:].replace("-", "_") for e in extra)
        yield {name: bench(work, name, "-e", m, "-b", str(B), "-t", str(T), "--steps",
                           str(plan["steps"]), *extra)}


def pipeline(out, work, plan, ranks=2):
    """Per-step time and losses of one run on one GPU, then as a `ranks`-stage nvshmem
    pipeline, and with plan["mps"] that pipeline again under an MPS server."""
    from .config import preset
    # what one handoff moves: a (B, T, C) fp32 activation forward or gradient back
    yield {"bytes_per_handoff": 4 * plan["t_short"] * preset(plan["model"]).C * 4}
    mpi = ["mpiexec", "-n", str(ranks)]
    runs = [("single", [], False), (f"nvshmem_{ranks}", mpi, False)]
    runs += [(f"nvshmem_{ranks}_mps", mpi, True)] if plan.get("mps") else []
    done = {}
    for label, pre, mps in runs:
        with mps_server(work) if mps else contextlib.nullcontext() as no_mps:
            res = {"error": no_mps} if no_mps else train_run(work, label, plan, pre)
        single = done.get("single", {})
        if "losses" in single and "losses" in res:
            res["max_rel_loss_diff"] = max(abs(x - y) / abs(x)
                                           for x, y in zip(single["losses"], res["losses"]))
        done[label] = res
        yield {label: res}


def train_run(work, label, plan, pre):
    log = os.path.join(work, f"pipe_{label}.jsonl")
    rc, text = sh(pre + CLI + ["train", "-e", plan["model"], "--backend", "cuda", "-b", "4",
                               "-t", str(plan["t_short"]), "-n", str(plan["pipe_steps"]),
                               "-v", "0", "-g", "0", "--no-graphs", "--log-file", log,
                               "-o", os.path.join(work, "pipe_" + label)]
                  + (["--transport", "nvshmem"] if pre else []), 600, log + ".out")
    if rc != 0:
        return {"error": last_line(text, rc)}
    steps = [s for s in map(json.loads, open(log)) if "train_loss" in s]
    return {"ms_per_step_median": statistics.median(s["ms"] for s in steps[2:]),
            "losses": [s["train_loss"] for s in steps]}


@contextlib.contextmanager
def mps_server(work):
    """Yields None with a CUDA MPS daemon running for the runs inside (stopped after), or
    why it did not start. Its pipe and log directories are the check's own, so a server
    already running elsewhere is untouched."""
    dirs = {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(work, "mps_pipe"),
            "CUDA_MPS_LOG_DIRECTORY": os.path.join(work, "mps_log")}
    for d in dirs.values():
        os.makedirs(d, exist_ok=True)
    saved = {k: os.environ.get(k) for k in dirs}
    os.environ.update(dirs)
    started = False
    try:
        try:
            r = subprocess.run(["nvidia-cuda-mps-control", "-d"], capture_output=True,
                               text=True, timeout=30)
            started, why = r.returncode == 0, last_line(r.stdout + r.stderr, r.returncode)
        except (OSError, subprocess.TimeoutExpired) as e:
            why = str(e)
        yield None if started else f"MPS did not start: {why}"
    finally:
        if started:
            subprocess.run(["nvidia-cuda-mps-control"], input=b"quit\n", timeout=30)
        for k, v in saved.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


PARTS = {"tests": run_tests, "verify": verify, "sanitizer": sanitize, "bench": benches,
         "pipeline": pipeline}


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
    if t and t["rc"] != 0:  # pytest's 5 (no GPU test collected) fails too
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
    if "tests" in r:
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
