"""cupygpt's CPU trainer beside llm.c's (train_gpt2.c) on this machine: the same model file,
B=4 and T=64 (the sizes train_gpt2.c is written for), both with every core; per-step time
(median after the first step) and peak resident memory, and their ratios.

    make train_gpt2                                   # in your llm.c checkout
    python -m dev.vs_llmc PATH/TO/llm.c/train_gpt2 --model d12 --steps 10

train_gpt2.c reads fixed paths (gpt2_124M.bin, dev/data/tinyshakespeare/...), so it runs in
a scratch directory holding the model file and the shipped shards under those names. It
runs 40 steps with validation and sampling between; only its step lines are timed, and it
is stopped after --steps of them.
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "cupygpt", "data")
# Runs argv[3:], echoing its stdout; kills it at the argv[2]-th line holding argv[1] (0:
# never); prints its peak resident set (KiB) as the last line of stderr.
MEASURE = """import resource, subprocess, sys
marker, stop, cmd = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
p, seen = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True), 0
for line in p.stdout:
    sys.stdout.write(line)
    seen += marker in line
    if stop and seen >= stop:
        p.kill()
        break
p.wait()
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)
"""


def measured(cmd, cwd, marker="", stop=0):
    """(stdout, peak KiB) of cmd, killed at the stop-th line holding marker (0: never)."""
    res = subprocess.run([sys.executable, "-c", MEASURE, marker, str(stop), *cmd], cwd=cwd,
                         capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(f"{cmd[0]} failed:\n{res.stderr[-2000:]}")
    return res.stdout, int(res.stderr.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("llmc", help="llm.c's train_gpt2 binary (make train_gpt2)")
    ap.add_argument("--model", default="d12", help="preset for a fresh model (tiny, d12)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps of each")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    a = ap.parse_args()
    if not os.access(a.llmc, os.X_OK):
        sys.exit(f"{a.llmc}: not an executable; build it with `make train_gpt2` in llm.c")
    with tempfile.TemporaryDirectory() as d:
        cli = [sys.executable, os.path.join(ROOT, "cli.py")]
        subprocess.run([*cli, "train", "-e", a.model, "-n", "0", "-v", "0", "-g", "0",
                        "--backend", "numpy", "-o", d], check=True, capture_output=True)
        os.rename(os.path.join(d, "model.bin"), os.path.join(d, "gpt2_124M.bin"))
        shards = os.path.join(d, "dev", "data", "tinyshakespeare")
        os.makedirs(shards)
        for f in ("tiny_shakespeare_train.bin", "tiny_shakespeare_val.bin"):
            shutil.copy(os.path.join(DATA, f), shards)
        shutil.copy(os.path.join(DATA, "gpt2_tokenizer.bin"), d)
        out, llmc_kib = measured([os.path.abspath(a.llmc)], d, "took", a.steps + 1)
        llmc_ms = [float(x) for x in re.findall(r"took ([\d.]+) ms", out)][1:a.steps + 1]
        out, ours_kib = measured([*cli, "train", "-e", os.path.join(d, "gpt2_124M.bin"), "-b",
                                  "4", "-t", "64", "-n", str(a.steps + 1), "-v", "0", "-s", "0",
                                  "--backend", "numpy", "-o", os.path.join(d, "out")], d)
        ours_ms = [float(x) for x in re.findall(r"\(([\d.]+) ms,", out)][1:]
    r = {"model": a.model, "B": 4, "T": 64, "steps": a.steps, "cores": os.cpu_count(),
         "llmc_ms_per_step": statistics.median(llmc_ms),
         "cupygpt_ms_per_step": statistics.median(ours_ms),
         "llmc_peak_MiB": llmc_kib / 1024, "cupygpt_peak_MiB": ours_kib / 1024}
    r["time_ratio"] = r["cupygpt_ms_per_step"] / r["llmc_ms_per_step"]
    r["memory_ratio"] = r["cupygpt_peak_MiB"] / r["llmc_peak_MiB"]
    print(json.dumps(r) if a.json else "\n".join(
        [f"{a.model} B=4 T=64, {r['cores']} cores, median of {a.steps} steps",
         f"  llm.c train_gpt2.c  {r['llmc_ms_per_step']:9.1f} ms/step  "
         f"{r['llmc_peak_MiB']:7.0f} MiB",
         f"  cupygpt (numpy)     {r['cupygpt_ms_per_step']:9.1f} ms/step  "
         f"{r['cupygpt_peak_MiB']:7.0f} MiB",
         f"  ratio               {r['time_ratio']:9.2f}x          {r['memory_ratio']:7.2f}x"]))


if __name__ == "__main__":
    main()
