"""The GPU check's parts (cupygpt.gpucheck runs them): each a generator of results that
the check merges into its report as they come. Every run is a process of its own, started
in the check's temporary work directory with this very cupygpt (`python -m cupygpt`, the
packaged reference files), so it works the same from a clone and from an installed wheel;
only the tests part needs a clone (its tests/) and runs there."""
import contextlib
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import xml.etree.ElementTree as ET

from .shape import preset

PKG = os.path.dirname(os.path.abspath(__file__))
REFERENCE = os.path.join(PKG, "reference")  # llm.c's reference files, package data
# The repository around the package, when it is a clone (an installed wheel has no tests/).
CLONE = os.path.dirname(PKG)
CLI = [sys.executable, "-m", "cupygpt"]


def sh(cmd, timeout, log, cwd):
    """Runs cmd in cwd with its output going to the file log as it comes (a run killed from
    outside keeps what it printed); returns (exit status, output)."""
    # PKG's parent goes last on PYTHONPATH (after cudasim's stand-in cupy, in the dry run):
    # the run imports this cupygpt, also from a clone that is not pip-installed (the lent
    # GPU machine runs `python cli.py gpucheck` there)
    path = [p for p in (os.environ.get("PYTHONPATH"), os.path.dirname(PKG)) if p]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(path)}
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                                cwd=cwd, env=env).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    text = open(log, errors="replace").read()
    return rc, text + (f"\ntimed out after {timeout}s" if rc == 124 else "")


def last_line(text, rc):
    return text.strip().splitlines()[-1] if text.strip() else f"exit {rc}"


def run_tests(out, work, plan):
    """The repository's GPU tests (pytest -m gpu), which only a clone has."""
    if not os.path.isfile(os.path.join(CLONE, "tests", "conftest.py")):
        yield {"error": "needs the repository's tests/ (run gpucheck from a clone)"}
        return
    xml = os.path.join(work, "gpu_tests.xml")
    rc, _ = sh([sys.executable, "-m", "pytest", "-q", "-m", "gpu", f"--junitxml={xml}",
                "-p", "no:cacheprovider"], 1500, os.path.join(out, "gpu_tests.log"), CLONE)
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
SANITIZED = ("import sys, cupy; cupy.cuda.set_allocator(None); "
             "from cupygpt.cli import main; "
             "sys.argv = ['cupygpt', 'verify', '--backend', 'cuda', '--steps', '1', '--model', "
             f"{os.path.join(REFERENCE, 'tiny_model.bin')!r}, '--state', "
             f"{os.path.join(REFERENCE, 'tiny_debug_state.bin')!r}]; main()")


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
                      SANITIZED], 1200, os.path.join(out, f"sanitize_{tool}.log"), work)
        said = [x.strip("= ") for x in log.splitlines() if "SUMMARY" in x]
        yield {tool: {"rc": rc, "clean": rc == 0,
                      "summary": said[-1] if said else log.strip()[-200:]}}


def bench(work, name, *args, timeout=400):
    path = os.path.join(work, f"bench_{name}.json")
    rc, log = sh(CLI + ["bench", "--out", path, *args], timeout, path + ".log", work)
    return {"error": last_line(log, rc)} if rc != 0 else json.load(open(path))


def verify(out, work, plan):
    """verify --backend cuda on each reference, fp32 with TF32 off and on, and bf16: the
    largest differences from PyTorch, checked against (and to set) README's tolerances for
    each mode."""
    for name in plan["verify"]:
        for mode, flags in (("no_tf32", ["--no-tf32"]), ("tf32", ["--tf32"]),
                            ("bf16", ["--dtype", "bf16"])):
            fx = os.path.join(REFERENCE, name)
            key = f"{name}_{mode}"  # e.g. tiny_no_tf32
            log = os.path.join(work, f"verify_{key}.log")
            rc, text = sh(CLI + ["verify", "--backend", "cuda", *flags, "--json", "--model",
                                 fx + "_model.bin", "--state", fx + "_debug_state.bin",
                                 "--expected", fx + "_expected.json"], 300, log, work)
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


def benches(out, work, plan):
    m, ts, tl = plan["model"], plan["t_short"], plan["t_long"]
    # bf16 (the GPU's default, llm.c's mainline), and fp32 beside it
    runs = [(4, ts, ()), (4, tl, ("--profile",)), (4, tl, ("--no-graphs",)),
            (4, tl, ("--dtype=fp32",))]
    runs += [(B, tl, ()) for B in plan["batches"]]
    for B, T, extra in runs:  # named e.g. d12_T1024_B4_no_graphs, d12_T1024_B4_dtype_fp32
        name = f"{m}_T{T}_B{B}" + "".join("_" + e[2:].replace("-", "_").replace("=", "_")
                                           for e in extra)
        yield {name: bench(work, name, "-e", m, "-b", str(B), "-t", str(T), "--steps",
                           str(plan["steps"]), "--warmup", str(plan["warmup"]), *extra)}


def pipeline(out, work, plan, ranks=2):
    """Per-step time and losses of one run on one GPU, then as a `ranks`-stage nvshmem
    pipeline, and with plan["mps"] that pipeline again under an MPS server; in fp32, where
    the pipeline's losses are the one GPU's (bf16 stages round the tied wte's two
    gradients apart before summing them)."""
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
                               "-v", "0", "-g", "0", "--no-graphs", "--dtype", "fp32",
                               "--log-file", log,
                               "-o", os.path.join(work, "pipe_" + label)]
                  + (["--transport", "nvshmem"] if pre else []), 600, log + ".out", work)
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
