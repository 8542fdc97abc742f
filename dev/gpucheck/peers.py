"""The GPU check's peers (a directory holding run-peers.sh): llm.c's trainers built in the
background from the check's start, then run with PyTorch's GPT-2 at bench's B and T, their output
parsed into one entry a peer, for ratios measured in the same call."""
import json
import os
import re
import shutil
import subprocess

from cupygpt.paths import DATA

from .runs import BudgetSpent, Skip, kill_group, last_line, sh


class PeersBuild:
    """llm.c's trainers built in the background from the check's start (nvcc works on the
    CPU while the GPU runs the parts before bench), so that the peers part only runs them.
    run-peers.sh has no build step of its own: its lines before its first run (FIRST_RUN)
    are it, run here with the same arguments and work directory as the whole script later,
    which then finds each binary built and skips its build."""
    FIRST_RUN = "tok=$((B * T))"

    def __init__(self, peers, work, B, T):
        # (absolute: the script runs in the check's work directory, and finds its folder
        # by its own path, while --peers may be relative)
        self.script = os.path.join(os.path.abspath(peers), "run-peers.sh")
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
