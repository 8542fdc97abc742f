"""A 2-stage pipeline's speed-up on the CPU, measured and predicted: for each model and
sequence length, `bench` in one process pinned to one core, then `bench --pp 2` under
mpiexec with each rank pinned to a core of its own (one BLAS thread everywhere, the same
model, batch and micro-batches), every schedule. The prediction is the schedule
simulator's step from the pipelined run's measured op and transfer times (`timeline`'s)
plus what no schedule hides: each rank's closing sums and the update between steps, as
measured in the same trace. Beside them, what a speed-up short of 2 loses to: the work both
ranks do against one rank's (`split_cost`) and how evenly the stages split (`balance`).
Writes one JSON and prints a Markdown table.

    python -m dev.pipeline_speedup [--models d6,d12] [--seqs 128,512] [--batch 8]
        [--micro-batches 8] [--schedules 1f1b,interleaved,zb1p,zbv] [--steps 2] [--out F]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEDULES = ("1f1b", "interleaved", "zb1p", "zbv")
# one BLAS thread per rank: two ranks on two cores compute side by side, not on four threads
ONE_THREAD = {k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}


def bench(args, out, ranks=1):
    """`bench --backend numpy` with args; under mpiexec when ranks > 1, each rank pinned to
    core (its rank), else pinned to core 0. Returns bench's JSON."""
    cmd = [sys.executable, os.path.join(ROOT, "cli.py"), "bench", "--backend", "numpy",
           "--out", out, "--overwrite", *args]
    if ranks > 1:  # (hydra sets PMI_RANK in each rank's environment)
        cmd = ["mpiexec", "-n", str(ranks), "sh", "-c",
               'exec taskset -c "$PMI_RANK" "$@"', "pin", *cmd]
    else:
        cmd = ["taskset", "-c", "0", *cmd]
    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, **ONE_THREAD})
    with open(out) as f:
        return json.load(f)


def closing_and_between(trace):
    """Per rank, the seconds of its last step that no schedule overlaps: the closing step
    action (the tied and replicas' sums) plus the gap before the step's first action (the
    previous step's update, the batch's upload, the loss to the host)."""
    with open(trace) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    out = {}
    for rank in sorted({e["tid"] for e in events}):
        mine = sorted((e for e in events if e["tid"] == rank), key=lambda e: e["ts"])
        steps = [i for i, e in enumerate(mine) if e["cat"] == "step"]
        last, prev = steps[-1], steps[-2]
        gap = mine[prev + 1]["ts"] - (mine[prev]["ts"] + mine[prev]["dur"])
        out[rank] = (mine[last]["dur"] + gap) / 1e6
    return out


def predicted_step(trace, schedule):
    """(predicted seconds per step, the simulator's result, measured bubble, handoff
    seconds, the op times the simulator took): the simulated schedule from the trace's own
    op and transfer times, each rank's end followed by its closing and between-step time,
    the latest rank's end."""
    sys.path.insert(0, ROOT)
    from cupygpt.commands.timeline import bubble, predict, read_trace
    rows, transfers, pipe = read_trace(trace)
    *_, times, sim = predict(rows, transfers, pipe, schedule)
    rest = closing_and_between(trace)
    ends = [max((e[2] for e in evs), default=0.0) for evs in sim["events"]]
    handoff = [s + r for s, r in zip(times["t_send"], times["t_recv"])]
    return (max(end + rest[r] for r, end in enumerate(ends)), sim, bubble(rows),
            sum(handoff) / len(handoff), times)


def rank_work(times, closing, micro):
    """Per rank, the seconds it computes in a step: its micro-batches' forward and backward
    (and weight-gradient) ops plus its closing and between-step time. Their sum against one
    rank's step is what splitting costs (work done twice, two cores sharing caches and
    memory); their mean against their largest is how evenly the stages split."""
    per_mb = [f + b + (w[r] if (w := times["t_wgt"]) else 0.0)
              for r, (f, b) in enumerate(zip(times["t_fwd"], times["t_bwd"]))]
    return [micro * t + closing[r] for r, t in enumerate(per_mb)]


def measure(model, seq, batch, micro, schedules, steps, tmp):
    common = ["-e", model, "-b", str(batch), "-t", str(seq), "--steps", str(steps),
              "--warmup", "1", "--micro-batches", str(micro)]
    one = bench(common, os.path.join(tmp, "one.json"))
    single = one["ms_per_step_median"] / 1e3
    rows = []
    for name in schedules:
        trace = os.path.join(tmp, f"{name}.json")
        extra = ["--virtual-stages", "2"] if name == "interleaved" else []
        r = bench([*common, "--pp", "2", "--schedule", name, "--trace", trace, *extra],
                  os.path.join(tmp, f"{name}_bench.json"), ranks=2)
        measured = r["ms_per_step_median"] / 1e3
        predicted, sim, measured_bubble, handoff, times = predicted_step(trace, name)
        closing = closing_and_between(trace)
        work = rank_work(times, closing, micro)
        rows.append({"model": model, "T": seq, "B": batch, "micro_batches": micro,
                     "schedule": name, "single_s": single, "pipelined_s": measured,
                     "speedup": single / measured, "predicted_s": predicted,
                     "predicted_speedup": single / predicted,
                     "prediction_error": predicted / measured - 1,
                     "bubble": measured_bubble, "predicted_bubble": sim["bubble"],
                     "handoff_s": handoff, "op_s": times, "closing_s": closing,
                     "rank_work_s": work, "split_cost": sum(work) / single,
                     "balance": sum(work) / len(work) / max(work)})
    return rows


def table(rows):
    lines = ["| model | T | schedule | one rank (s) | 2 stages (s) | speed-up | predicted | "
             "error | bubble (measured / simulated) | handoff (ms) | work on 2 cores / one "
             "rank's | balance |", "|" + "---|" * 12]
    for r in rows:
        lines.append(f"| {r['model']} | {r['T']} | {r['schedule']} | {r['single_s']:.2f} | "
                     f"{r['pipelined_s']:.2f} | {r['speedup']:.2f}x | "
                     f"{r['predicted_speedup']:.2f}x | {r['prediction_error']:+.0%} | "
                     f"{r['bubble']:.0%} / {r['predicted_bubble']:.0%} | "
                     f"{1e3 * r['handoff_s']:.2f} | {r['split_cost']:.2f} | "
                     f"{r['balance']:.2f} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="d6,d12")
    ap.add_argument("--seqs", default="128,512")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", default="pipeline_speedup.json")
    a = ap.parse_args()
    schedules = a.schedules.split(",")
    unknown = sorted(set(schedules) - set(SCHEDULES))
    if unknown or (os.cpu_count() or 1) < 2:
        sys.exit(f"error: --schedules: unknown {', '.join(unknown)}" if unknown else
                 "error: two stages need two cores to compare against one")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in a.models.split(","):
            for seq in map(int, a.seqs.split(",")):
                rows += measure(model, seq, a.batch, a.micro_batches, schedules, a.steps, tmp)
                print(table(rows[-len(schedules):]).split("\n", 2)[-1], flush=True)
    with open(a.out, "w") as f:
        json.dump({"cpus": os.cpu_count(), "rows": rows}, f, indent=1)
    print(table(rows))


if __name__ == "__main__":
    main()
