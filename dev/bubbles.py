"""The pipeline schedules' bubbles on this machine, measured against the simulator's
prediction: for each schedule, `train --trace` under mpiexec on an 8-layer model (the
shipped text folded into a 512-token vocabulary, so the head weighs less than a block), then
`timeline` on the trace (its last step), --repeat times (the figures are medians; the
pictures are the last run's). Writes the pictures and one JSON.

    python -m dev.bubbles [--ranks 4] [--micro-batches 8] [--repeat 3] [--out docs/timelines]
"""
import argparse
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEDULES = {"1f1b": [], "interleaved": ["--virtual-stages", "2"], "zb1p": [], "zbv": []}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "timelines"))
    a = ap.parse_args()
    sys.path.insert(0, ROOT)
    from cupygpt.formats.llmc import read_shard, write_model, write_shard
    from cupygpt.model.initialize import init_params
    from cupygpt.model.shape import GPT2Config
    os.makedirs(a.out, exist_ok=True)
    tmp = tempfile.mkdtemp()
    cfg = GPT2Config(maxT=64, V=512, Vp=512, L=8, NH=8, C=256)
    write_model(os.path.join(tmp, "model.bin"), cfg, init_params(cfg, 1))
    toks = read_shard(os.path.join(ROOT, "cupygpt", "data", "tiny_shakespeare_val.bin"))
    write_shard(os.path.join(tmp, "tokens.bin"), toks % cfg.V)
    runs = {name: [] for name in SCHEDULES}
    for _, (name, extra) in itertools.product(range(a.repeat), SCHEDULES.items()):
        trace = os.path.join(tmp, f"{name}.json")
        cmd = ["mpiexec", "-n", str(a.ranks), sys.executable, os.path.join(ROOT, "cli.py"),
               "train", "-e", os.path.join(tmp, "model.bin"), "-i",
               os.path.join(tmp, "tokens.bin"), "-j", os.path.join(tmp, "tokens.bin"),
               "-b", str(2 * a.micro_batches), "-t", "64", "-n", "4", "-v", "0", "-g", "0",
               "-o", os.path.join(tmp, name), "--schedule", name, "--micro-batches",
               str(a.micro_batches), "--trace", trace, *extra]
        subprocess.run(cmd, check=True, capture_output=True, cwd=tmp)
        png = os.path.join(a.out, f"{name}_p{a.ranks}_m{a.micro_batches}.png")
        res = subprocess.run([sys.executable, os.path.join(ROOT, "cli.py"), "timeline", trace,
                              "--out", png], check=True, capture_output=True, text=True)
        runs[name].append(tuple(map(float, re.findall(r"(?:bubble|times) (\d\.\d+)",
                                                      res.stdout))))
    results = {}
    for name, got in runs.items():
        measured, predicted = (statistics.median(x) for x in zip(*got))
        results[name] = {"measured_bubble": measured, "predicted_bubble": predicted,
                         "runs": got, "picture": f"{name}_p{a.ranks}_m{a.micro_batches}.png"}
        print(f"{name:12s} measured {measured:.3f}  predicted {predicted:.3f}  (medians of "
              f"{len(got)})")
    with open(os.path.join(a.out, f"bubbles_p{a.ranks}_m{a.micro_batches}.json"), "w") as f:
        json.dump({"ranks": a.ranks, "micro_batches": a.micro_batches, "cpus": os.cpu_count(),
                   "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
