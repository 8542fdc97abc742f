"""The GPU check's parts (cupygpt.gpucheck runs them): each a generator of results that
the check merges into its report as they come. Every run is a process of its own, started
in the check's temporary work directory with this very cupygpt (`python -m cupygpt`, the
packaged reference files), so it works the same from a clone and from an installed wheel;
only the tests part needs a clone (its tests/) and runs there. Every run is bounded by
what is left of the check's Budget: a run that cannot fit is skipped (its result a Skip),
and one that the budget's end cuts raises BudgetSpent."""
import contextlib
import glob
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

from .shape import preset

PKG = os.path.dirname(os.path.abspath(__file__))
REFERENCE = os.path.join(PKG, "reference")  # llm.c's reference files, package data
DATA = os.path.join(PKG, "data")  # the tokenizer and tinyshakespeare shards the peers read
# The repository around the package, when it is a clone (an installed wheel has no tests/).
CLONE = os.path.dirname(PKG)
CLI = [sys.executable, "-m", "cupygpt"]


class Skip(str):
    """Why a run did not start: a part yields {name: Skip(why)} for one of its runs, or
    Skip(why) for all of them, and the report lists it apart from the results."""


class BudgetSpent(Exception):
    """A run was stopped at the budget's end: the part ends there, and so does the check."""


class Budget:
    """The seconds the whole check may take, counted from its start."""

    def __init__(self, seconds, clock=time.monotonic):
        self.clock, self.end = clock, clock() + seconds

    def left(self):
        return max(0.0, self.end - self.clock())

    def short(self, need):
        """Why a run that takes about `need` seconds cannot start now, or None."""
        left = self.left()
        return f"needs about {need:g} s, {left:.0f} s of the budget left" if left < need else None


def sh(cmd, cap, log, cwd, budget, env=None):
    """Runs cmd in cwd, in a process group of its own, for at most `cap` seconds or what is
    left of the budget, with its output going to the file log as it comes (a run killed
    from outside keeps what it printed); returns (exit status, output). At the limit the
    whole group is killed (mpiexec's ranks and pytest's workers too, which would otherwise
    hold the GPU); at the budget's end that raises BudgetSpent."""
    # PKG's parent goes last on PYTHONPATH (after cudasim's stand-in cupy, in the dry run):
    # the run imports this cupygpt, also from a clone that is not pip-installed (the lent
    # GPU machine runs `python cli.py gpucheck` there)
    path = [p for p in (os.environ.get("PYTHONPATH"), os.path.dirname(PKG)) if p]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(path),
           **(env or {})}
    timeout = min(cap, budget.left())
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd, env=env,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = 124
        finally:
            kill_group(proc)
    text = open(log, errors="replace").read()
    if rc == 124 and timeout < cap:
        # named as its log is (e.g. verify_tiny_tf32): the log itself goes with the work dir
        raise BudgetSpent(f"cut at the budget's end after {timeout:.0f} s, in "
                          + os.path.basename(log).split(".")[0])
    return rc, text + (f"\ntimed out after {timeout:.0f}s" if rc == 124 else "")


def kill_group(proc):
    """Kills what is left of a run's process group (a rank or worker it started) and reaps
    the run."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def launcher(name):
    """An MPI launcher: the one beside this Python (the mpich wheel's, as README says),
    else PATH's."""
    here = os.path.join(os.path.dirname(sys.executable), name)
    return here if os.path.exists(here) else shutil.which(name)


def last_line(text, rc):
    return text.strip().splitlines()[-1] if text.strip() else f"exit {rc}"


def verify(out, work, plan, budget):
    """verify --backend cuda on each reference, fp32 with TF32 off and on, and bf16: the
    largest differences from PyTorch, checked against (and to set) README's tolerances for
    each mode."""
    for name in plan["verify"]:
        for mode, flags in (("no_tf32", ["--no-tf32"]), ("tf32", ["--tf32"]),
                            ("bf16", ["--dtype", "bf16"])):
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
                yield {key: {"error": last_line(text, rc)}}
                continue
            yield {key: {
                "ok": r["ok"], "logits": r["logits"]["max_abs_diff"],
                "loss": r["loss"]["abs_diff"],
                "grad_rel": max(g["max_abs_diff"] / g["max_abs_ref"] for g in r["grads"].values()),
                "grad_abs": max(g["max_abs_diff"] for g in r["grads"].values()),
                "steps": max(st["abs_diff"] for st in r["steps"])}}


# README's two training commands as it writes them (tests/test_gpucheck.py checks that it
# still does): its quick start, and the two-stage pipeline. The first H200 run found both
# failing with their defaults (every CUDA graph capture), so the check runs them as a user
# would.
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
    """The repository's GPU tests (pytest -m gpu), which only a clone has: in 6 processes
    when pytest-xdist is there (65 to 100 s on an H200, several minutes serial)."""
    if not os.path.isfile(os.path.join(CLONE, "tests", "conftest.py")):
        yield {"error": "needs the repository's tests/ (run gpucheck from a clone)"}
        return
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


def benches(out, work, plan, budget):
    """bf16 (the GPU's default, llm.c's mainline) at B=4 and the long T first, with and
    without graphs, and in fp32: the runs the peers compare with; then its profile, the
    short T and the larger batches."""
    m, ts, tl = plan["model"], plan["t_short"], plan["t_long"]
    runs = [(4, tl, ()), (4, tl, ("--no-graphs",)), (4, tl, ("--dtype=fp32",)),
            (4, tl, ("--profile",)), (4, ts, ())]
    runs += [(B, tl, ()) for B in plan["batches"]]
    for B, T, extra in runs:  # named e.g. d12_T1024_B4_no_graphs, d12_T1024_B4_dtype_fp32
        name = f"{m}_T{T}_B{B}" + "".join("_" + e[2:].replace("-", "_").replace("=", "_")
                                           for e in extra)
        why = budget.short(plan["need"]["bench"])
        yield {name: Skip(why) if why else bench(
            work, name, budget, "-e", m, "-b", str(B), "-t", str(T), "--steps",
            str(plan["steps"]), "--warmup", str(plan["warmup"]), *extra)}


class PeersBuild:
    """llm.c's trainers built in the background from the check's start (nvcc works on the
    CPU while the GPU runs the parts before bench), so that the peers part only runs them.
    run-peers.sh has no build step of its own: its lines before its first run (FIRST_RUN)
    are it, run here with the same arguments and work directory as the whole script later,
    which then finds each binary built and skips its build."""
    FIRST_RUN = "tok=$((B * T))"

    def __init__(self, peers, work, B, T):
        self.script = os.path.join(peers, "run-peers.sh")
        self.args, self.proc = [str(B), str(T), DATA], None
        # PEERS_WORK: the builds and the peers' logs; OUT: where the script also writes its
        # lines (else the caller's $OUT, which may be the report's directory)
        self.work = os.path.join(work, "peers")
        self.env = {"PEERS_WORK": self.work, "OUT": self.work}
        os.makedirs(self.work)
        self.why, self.device = self.gpu()
        if self.why:
            return
        head, found, _ = open(self.script).read().partition(self.FIRST_RUN)
        if found:  # else the script builds as it runs, later
            with open(os.path.join(self.work, "build.log"), "w") as log:
                self.proc = subprocess.Popen(  # $0 is the script: it finds its folder by it
                    ["bash", "-c", head, self.script, *self.args], cwd=self.work,
                    env={**os.environ, **self.env}, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True)

    @staticmethod
    def gpu():
        """(why llm.c cannot be built here or None, the GPU's name): the build needs nvcc
        and asks nvidia-smi for the GPU's architecture."""
        for tool in ("nvcc", "nvidia-smi"):
            if shutil.which(tool) is None:
                return f"{tool} not found: llm.c cannot be built here", None
        try:
            r = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"nvidia-smi found no GPU to build llm.c for: {e}", None
        if r.returncode != 0:
            return ("nvidia-smi found no GPU to build llm.c for: " +
                    last_line(r.stdout + r.stderr, r.returncode)), None
        return None, r.stdout.strip().splitlines()[0]

    def wait(self, budget, cap=300):
        """Waits for the build (at most cap seconds: on an H200's 16 cores it took about
        120) within the budget; raises BudgetSpent at the budget's end."""
        if self.proc is None:
            return
        timeout = min(cap, budget.left())
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            if timeout < cap:
                raise BudgetSpent(f"cut at the budget's end after {timeout:.0f} s, in "
                                  "llm.c's build")
            # past its cap: run-peers.sh builds what is missing itself, and says so

    def stop(self):
        if self.proc is not None:
            kill_group(self.proc)


def peers(out, work, plan, budget):
    """The peers (llm.c fp32, bf16, bf16 with cuDNN attention; PyTorch eager, compiled, and
    compiled bf16) at bench's B=4 and long T, after bench in the same call, so that the
    report's ratios compare runs on one machine at one time; each peer's result or failure."""
    build = plan["peers"]
    if build.why:
        yield Skip(build.why)
        return
    build.wait(budget)
    log = os.path.join(work, "peers.log")
    try:
        rc, text = sh(["bash", build.script, *build.args], 900, log, build.work, budget,
                      env=build.env)
    except BudgetSpent:  # the peers that finished before the cut (llm.c's run first)
        yield parse_peers(open(log, errors="replace").read(), build.device)
        raise
    found = parse_peers(text, build.device)
    if rc != 0 or not found:  # e.g. past its own cap, which is the peers' all together
        found["run-peers.sh"] = {"error": last_line(text, rc)}
    yield found


FAILED = re.compile(r"^(.+?) (?:build )?failed: ?(.*)$")


def parse_peers(text, device):
    """run-peers.sh's output, one entry a peer: its JSON line (llm.c's flat, PyTorch's
    result nested) as ms_per_step, tok_s, B, T, dtype and device (llm.c's is the GPU
    nvidia-smi named), or its failure line (with any lines it spans) as an error. Other
    lines (a tool's complaints on stderr) are passed over."""
    found, last = {}, None
    for line in text.splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            r = None
        if isinstance(r, dict) and "peer" in r:
            res = r.get("result", r)
            name = r["peer"]
            last = None
            found[name] = {"error": "no step times in its output"} \
                if res.get("ms_per_step") is None else {
                    "ms_per_step": res["ms_per_step"], "B": res.get("B"), "T": res.get("T"),
                    "tok_s": res.get("tok_s", res.get("tok_per_s")),
                    "dtype": "bf16" if res.get("bf16", "bf16" in name) else "fp32",
                    "device": res.get("device", device)}
        elif FAILED.match(line):
            last, error = FAILED.match(line).groups()
            # PyTorch eager's says "pytorch  failed" (its mode is ""), its JSON "pytorch eager"
            last = "pytorch eager" if last.strip() == "pytorch" else last
            found[last] = {"error": error}
        elif last is not None and line.strip():  # the failure's next line (tail -2)
            found[last]["error"] = (found[last]["error"] + " / " + line.strip())[:400]
    return found


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
             "from cupygpt.cli import main; "
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
