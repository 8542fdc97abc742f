"""The step of README's pipeline on two GPUs (d12, B=4, T=128: 2 stages, 1f1b, one
micro-batch) predicted from one GPU's measurements: each stage's forward and backward from a
--trace of that pipeline run on one GPU (with one micro-batch its stages never compute at
once, so each op ran alone), each rank's close from its step action (the tied wte's sum
through the one GPU's memory, and AdamW), a handoff's fixed cost from bench --comm's 8 B
handoff on the transport (the loop's figure: the device's time per message), and the link's
bandwidth, which one GPU cannot measure: by default an H100 SXM's NVLink, 450 GB/s each way
(NVIDIA's published 900 GB/s in both). The tied wte's gradient crosses the link once more in
the close (counted on top of its copy within the one GPU: an overestimate by that copy).

    python -m dev.predict_step TRACE COMM_JSON [--transport nvshmem] [--link-GBps 450]
"""
import argparse
import json
import sys

from cupygpt.commands.timeline import predict, read_trace
from cupygpt.model.shape import preset
from cupygpt.parallel.pipeline.predict import predict_step

H100_NVLINK_GBPS = 450.0  # one direction of an H100 SXM's 18 NVLink 4 links (900 GB/s both)


def closes(path):
    """Each rank's last step action's seconds (the trace's "step" slices)."""
    events = json.load(open(path))["traceEvents"]
    last = {}
    for e in events:
        if e.get("cat") == "step":
            last[e["tid"]] = max(last.get(e["tid"], (-1, 0)), (e["ts"], e["dur"]))
    return [last[r][1] / 1e6 for r in sorted(last)]


def predict_from(trace, comm, transport="nvshmem", model="d12", B=4, T=128, itemsize=2,
                 link_GBps=H100_NVLINK_GBPS):
    """The prediction (predict_step's fields, in ms) and what it was made from."""
    rows, transfers, pipe = read_trace(trace)
    name, p, m, v, times, _ = predict(rows, transfers, pipe, None)
    shape = preset(model)
    latency_s = comm["seeds"][transport]["handoff_8B"]["loop_us"] / 1e6
    handoff_bytes = B // m * T * shape.C * itemsize
    r = predict_step(p, m, name, times["t_fwd"], times["t_bwd"], t_wgt=times["t_wgt"], v=v,
                     handoff_bytes=handoff_bytes, latency_s=latency_s,
                     bandwidth_Bps=link_GBps * 1e9, t_close=closes(trace) or 0.0,
                     close_bytes=shape.Vp * shape.C * itemsize)
    return {**{k.replace("_s", "_ms"): v * 1e3 for k, v in r.items() if k != "bubble"},
            "bubble": r["bubble"], "schedule": name, "stages": p, "micro_batches": m,
            "handoff_bytes": handoff_bytes, "latency_us": latency_s * 1e6,
            "link_GBps": link_GBps, "comm_device": comm["device"], "transport": transport}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("comm")
    ap.add_argument("--transport", default="nvshmem")
    ap.add_argument("--model", default="d12")
    ap.add_argument("-b", type=int, default=4)
    ap.add_argument("-t", type=int, default=128)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--link-GBps", type=float, default=H100_NVLINK_GBPS)
    a = ap.parse_args()
    comm = json.load(open(a.comm))
    if a.transport not in comm.get("seeds", {}):
        sys.exit(f"error: {a.comm} has no {a.transport} handoff (it timed "
                 f"{', '.join(comm.get('seeds', {})) or 'none'})")
    r = predict_from(a.trace, comm, a.transport, a.model, a.b, a.t,
                     2 if a.dtype == "bf16" else 4, a.link_GBps)
    print(json.dumps(r))
    print(f"predicted {r['stages']}-GPU step: {r['step_ms']:.3f} ms (pipeline "
          f"{r['pipeline_ms']:.3f}, bubble {r['bubble']:.1%}, handoff {r['handoff_ms'] * 1e3:.1f} "
          f"us, close {r['close_ms']:.3f})")


if __name__ == "__main__":
    main()
