"""The GPU check's parts (check.py runs them): each a generator of results that the check
merges into its report as they come. Every run is a process of its own, started in the
check's temporary work directory with this very cupygpt (`python -m cupygpt`, the packaged
reference files); the tests part runs in the repository (its tests/). Every run is bounded
by what is left of the check's Budget (runs.py); the peers are peers.py."""
import contextlib
import glob
import importlib.util
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

from cupygpt.model.shape import preset
from cupygpt.paths import PACKAGE, REFERENCE

from ..predict_step import predict_from
from .runs import Skip, last_line, launcher, sh

# The repository around the package, when it is a clone (an installed wheel has no tests/).
CLONE = os.path.dirname(PACKAGE)  # the repository of the cupygpt checked
CLI = [sys.executable, "-m", "cupygpt"]


# (mode, its flags): bf16 twice, each attention asked by name so neither hides the other
VERIFY_MODES = (("no_tf32", ["--no-tf32"]), ("tf32", ["--tf32"]),
                ("bf16", ["--dtype", "bf16", "--attention", "own"]),
                ("bf16_cudnn", ["--dtype", "bf16", "--attention", "cudnn"]))


def no_cudnn(line):
    """verify's one line when cuDNN (its frontend or library) is not installed here."""
    return line.startswith("error: --attention cudnn: ") and "is not installed" in line


def verify(out, work, plan, budget):
    """verify --backend cuda on each reference, fp32 with TF32 off and on, and bf16 through
    the own flash kernels and through cuDNN's (where it is installed: else a skip, its
    refusal the reason): the largest differences from PyTorch, checked against (and to set)
    the tolerances (docs/tolerances.md) for each mode."""
    for name in plan["verify"]:
        for mode, flags in VERIFY_MODES:
            fx = os.path.join(REFERENCE, name)
            key = f"{name}_{mode}"  # e.g. tiny_no_tf32
            why = budget.short(plan["need"]["verify"])
            if why:
                yield {key: Skip(why)}
                continue
            log = os.path.join(work, f"verify_{key}.log")
            rc, text = sh(CLI + ["verify", "--backend", "cuda", *flags, "--json", "--model",
                                 fx + "_model.bin", "--state", fx + "_debug_state.bin",
                                 "--expected", fx + "_expected.json"], 300, log, work, budget)
            try:  # its one JSON line (exit 1 when outside the tolerances still prints it)
                r = json.loads(next(x for x in text.splitlines()[::-1] if x.startswith("{")))
            except (ValueError, StopIteration):
                line = last_line(text, rc)
                yield {key: Skip(line) if no_cudnn(line) else {"error": line}}
                continue
            yield {key: {
                "ok": r["ok"], "logits": r["logits"]["max_abs_diff"],
                "loss": r["loss"]["abs_diff"],
                "grad_rel": max(g["max_abs_diff"] / g["max_abs_ref"] for g in r["grads"].values()),
                "grad_abs": max(g["max_abs_diff"] for g in r["grads"].values()),
                "steps": max(st["abs_diff"] for st in r["steps"])}}


# README's two training commands as it writes them (tests/dev/test_gpucheck.py
# checks that it still does): its quick start, and the two-stage pipeline. The first H200
# run found both failing with their defaults (every CUDA graph capture), so the check runs
# them as a user would.
README_COMMANDS = ("python cli.py train", "mpirun -np 2 python cli.py train -b 4 -t 128 -o out/pp2")


def readme(out, work, plan, budget):
    """README's training commands, each in a directory of its own, with the plan's extra
    flags (none in the full plan): whether it trained, its last losses and its time."""
    for i, cmd in enumerate(README_COMMANDS):
        why = budget.short(plan["need"]["readme"])
        if why:
            yield {cmd: Skip(why)}
            continue
        words = shlex.split(cmd)
        at = words.index("python")  # `python cli.py` is this Python running this cupygpt
        pre = [launcher(words[0])] + words[1:at] if at else []
        if at and pre[0] is None:
            yield {cmd: {"error": f"{words[0]} not found (the mpich wheel brings it)"}}
            continue
        run = os.path.join(work, f"readme_{i}")
        os.makedirs(run)
        start = time.monotonic()
        rc, text = sh(pre + CLI + words[at + 2:] + list(plan["train_args"]), 600,
                      run + ".log", run, budget)
        res = {"seconds": round(time.monotonic() - start, 1)}
        if rc != 0:
            res["error"] = last_line(text, rc)
        for path in glob.glob(os.path.join(run, "out", "**", "log.jsonl"), recursive=True):
            lines = [json.loads(x) for x in open(path)]
            res.update({k: [x[k] for x in lines if k in x][-1] for k in ("train_loss", "val_loss")
                        if any(k in x for x in lines)})
        yield {cmd: res}


def run_tests(out, work, plan, budget):
    """The repository's GPU tests (pytest -m gpu): in 6 processes when pytest-xdist is
    there (65 to 100 s on an H200, several minutes serial)."""
    workers = 6 if importlib.util.find_spec("xdist") else 1
    xml = os.path.join(work, "gpu_tests.xml")
    rc, _ = sh([sys.executable, "-m", "pytest", "-q", "-m", "gpu", f"--junitxml={xml}",
                "-p", "no:cacheprovider"] + (["-n", str(workers)] if workers > 1 else []),
               1500, os.path.join(out, "gpu_tests.log"), CLONE, budget)
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0, "workers": workers}
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


def bench(work, name, budget, *args):
    path = os.path.join(work, f"bench_{name}.json")
    rc, log = sh(CLI + ["bench", "--out", path, *args], 400, path + ".log", work, budget)
    return {"error": last_line(log, rc)} if rc != 0 else json.load(open(path))


def cudnn_frontend():
    """cuDNN (its frontend and the library it loads) is installed here: bench's auto then
    runs cuDNN's attention where the shape allows."""
    try:
        import cudnn
        cudnn.backend_version()
    except Exception:  # (ImportError; RuntimeError when the frontend finds no libcudnn)
        return False
    return True


def benches(out, work, plan, budget):
    """bf16 (the GPU's default, llm.c's mainline) at B=4 and the long T first (again with
    the own attention kernels where auto may take cuDNN's), with and without graphs, and
    in fp32: the runs the peers compare with; then its profile, the short T and the larger
    batches."""
    m, ts, tl = plan["model"], plan["t_short"], plan["t_long"]
    own = [(4, tl, ("--attention=own",))] if cudnn_frontend() else []
    runs = [(4, tl, ()), *own, (4, tl, ("--no-graphs",)), (4, tl, ("--dtype=fp32",)),
            (4, tl, ("--profile",)), (4, ts, ())]
    runs += [(B, tl, ()) for B in plan["batches"]]
    for B, T, extra in runs:  # named e.g. d12_T1024_B4_no_graphs, d12_T1024_B4_dtype_fp32
        name = f"{m}_T{T}_B{B}" + "".join("_" + e[2:].replace("-", "_").replace("=", "_")
                                           for e in extra)
        why = budget.short(plan["need"]["bench"])
        yield {name: Skip(why) if why else bench(
            work, name, budget, "-e", m, "-b", str(B), "-t", str(T), "--steps",
            str(plan["steps"]), "--warmup", str(plan["warmup"]), *extra)}




def pipeline(out, work, plan, budget, ranks=2):
    """Per-step time and losses of one run on one GPU, then as a `ranks`-stage nvshmem
    pipeline, and that pipeline again under an MPS server; in fp32, where the pipeline's
    losses are the one GPU's (bf16 stages round the tied wte's two gradients apart before
    summing them)."""
    # what one handoff moves: a (B, T, C) fp32 activation forward or gradient back
    yield {"bytes_per_handoff": 4 * plan["t_short"] * preset(plan["model"]).C * 4}
    mpi = [launcher("mpiexec"), "-n", str(ranks)]
    runs = [("single", [], False), (f"nvshmem_{ranks}", mpi, False),
            (f"nvshmem_{ranks}_mps", mpi, True)]
    done = {}
    for label, pre, mps in runs:
        why = budget.short(plan["need"]["pipeline"])
        if why:
            yield {label: Skip(why)}
            continue
        with mps_server(work) if mps else contextlib.nullcontext() as no_mps:
            res = {"error": no_mps} if no_mps else train_run(work, label, plan, pre, budget)
        single = done.get("single", {})
        if "losses" in single and "losses" in res:
            res["max_rel_loss_diff"] = max(abs(x - y) / abs(x)
                                           for x, y in zip(single["losses"], res["losses"]))
        done[label] = res
        yield {label: res}


def train_run(work, label, plan, pre, budget):
    if pre and pre[0] is None:
        return {"error": "mpiexec not found (the mpich wheel brings it)"}
    log = os.path.join(work, f"pipe_{label}.jsonl")
    rc, text = sh(pre + CLI + ["train", "-e", plan["model"], "--backend", "cuda", "-b", "4",
                               "-t", str(plan["t_short"]), "-n", str(plan["pipe_steps"]),
                               "-v", "0", "-g", "0", "--no-graphs", "--dtype", "fp32",
                               "--log-file", log,
                               "-o", os.path.join(work, "pipe_" + label)]
                  + (["--transport", "nvshmem"] if pre else []), 600, log + ".out", work, budget)
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


# verify on llm.c's tiny reference with CuPy's memory pool off, so that every array is its
# own cudaMalloc and memcheck sees an access past any of them.
SANITIZED = ("import sys, cupy; cupy.cuda.set_allocator(None); "
             "from cupygpt.cli.main import main; "
             "sys.argv = ['cupygpt', 'verify', '--backend', 'cuda', '--steps', '1', '--model', "
             f"{os.path.join(REFERENCE, 'tiny_model.bin')!r}, '--state', "
             f"{os.path.join(REFERENCE, 'tiny_debug_state.bin')!r}]; main()")


def sanitize(out, work, plan, budget):
    """compute-sanitizer's memcheck (out-of-bounds and misaligned accesses) and racecheck
    (shared-memory hazards) over every kernel a verify step launches."""
    exe = shutil.which("compute-sanitizer") or next(
        iter(sorted(glob.glob("/usr/local/cuda*/bin/compute-sanitizer"))), None)
    if exe is None:
        yield {"error": "compute-sanitizer not found"}
        return
    for tool in ("memcheck", "racecheck"):
        why = budget.short(plan["need"]["sanitizer"])
        if why:
            yield {tool: Skip(why)}
            continue
        rc, log = sh([exe, "--tool", tool, "--error-exitcode", "97", sys.executable, "-c",
                      SANITIZED], 1200, os.path.join(out, f"sanitize_{tool}.log"), work, budget)
        said = [x.strip("= ") for x in log.splitlines() if "SUMMARY" in x]
        yield {tool: {"rc": rc, "clean": rc == 0,
                      "summary": said[-1] if said else log.strip()[-200:]}}


def comm(out, work, plan, budget, ranks=2):
    """The seeds' questions on one GPU: bench --comm with `ranks` PEs sharing it under an
    MPS server (one process per PE, as on several GPUs; without MPS they take turns, which
    the report says): nvshmem against NCCL in the same run (NCCL 2.30's experimental ranks
    sharing a GPU; where NCCL refuses them, nvshmem alone), then README's 2-stage pipeline
    traced (one micro-batch: its stages never compute at once) and its step on two GPUs
    predicted from both (dev.predict_step, NVLink's published bandwidth)."""
    mpi = [launcher("mpiexec"), "-n", str(ranks)]
    if mpi[0] is None:
        yield {"mpiexec": {"error": "mpiexec not found (the mpich wheel brings it)"}}
        return
    model, t = plan["model"], str(plan["t_short"])
    with mps_server(work) as no_mps:
        yield {"mps": "running" if no_mps is None else no_mps}
        report = None
        for key, extra in (("against_nccl", ["--against", "nccl"]), ("nvshmem", [])):
            why = budget.short(plan["need"]["comm"])
            if why:
                yield {key: Skip(why)}
                return
            path = os.path.join(work, f"comm_{key}.json")
            rc, log = sh(mpi + CLI + ["bench", "--comm", "--backend", "cuda", "-e", model,
                                      "-b", "4", "-t", t, "--steps", str(plan["comm_steps"]),
                                      "--warmup", "2", "--out", path, *extra], 600,
                         path + ".log", work, budget, env={"NCCL_MULTI_RANK_GPU_ENABLE": "1"})
            if rc == 0:
                report = json.load(open(path))
                yield {key: report}
                break
            yield {key: {"error": last_line(log, rc)}}
        why = budget.short(plan["need"]["comm"])
        if report is None or why:
            if why:
                yield {"prediction": Skip(why)}
            return
        trace = os.path.join(work, "comm_trace.json")
        rc, log = sh(mpi + CLI + ["train", "-e", model, "--backend", "cuda", "-b", "4", "-t", t,
                                  "-n", "3", "-v", "0", "-g", "0", "--trace", trace, "-o",
                                  os.path.join(work, "comm_pipe")], 600, trace + ".log",
                     work, budget)
    if rc != 0:
        yield {"prediction": {"error": last_line(log, rc)}}
        return
    try:
        yield {"prediction": predict_from(trace, report, "nvshmem", model, 4, int(t))}
    except Exception as e:  # (a trace or report the prediction cannot read: its error)
        yield {"prediction": {"error": f"{type(e).__name__}: {e}"}}
