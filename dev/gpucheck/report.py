"""report.md's section of each GPU check part, and the peers' ratios (cupygpt's time over
theirs, measured in the same call), which report.json holds too."""
import json


def ratios(report):
    """cupygpt's ms/step over each peer's at the same B, T and dtype (below 1: cupygpt is
    the faster), each side's device named; only when bench and the peers ran in one call,
    as times from different calls or machines do not compare. cupygpt's run is bench's
    with graphs where it worked, else its eager one (the first in bench's order); where
    bench also ran another attention (the own kernels beside cuDNN's), that run's ratio is
    keyed "PEER / ATTENTION"."""
    at = report.get("ran_at", {})
    if "peers" not in at or at["peers"] != at.get("bench"):
        return {}
    ours = [(n, b) for n, b in report.get("bench", {}).items() if "error" not in b]
    out = {}
    for peer, p in report.get("peers", {}).items():
        same = sorted(((n, b) for n, b in ours if "error" not in p and
                       (b["B"], b["T"], b["dtype"]) == (p["B"], p["T"], p["dtype"])),
                      key=lambda nb: not nb[1]["graphs"])
        for i, (name, b) in enumerate(same):
            att = b.get("attention", "")
            if i and (not b["graphs"] or att == same[0][1].get("attention", "")):
                continue
            out[peer + (f" / {att.split()[0]}" if i else "")] = {
                "cupygpt": name, "cupygpt_ms": b["ms_per_step_median"],
                "cupygpt_device": b["device"], "peer_ms": p["ms_per_step"],
                "peer_device": p["device"], "ratio": b["ms_per_step_median"] / p["ms_per_step"]}
    return out


def verify_section(r, plan):
    lines = ["| verify (max abs diff vs PyTorch) | ok | logits | loss | grads (abs / rel to "
             "max) | AdamW step losses |", "|---|---|---|---|---|---|"]
    for name, x in r["verify"].items():
        lines.append(f"| {name} | {x['error'][:60]} | | | | |" if "error" in x else
                     f"| {name} | {x['ok']} | {x['logits']:.2e} | {x['loss']:.2e} | "
                     f"{x['grad_abs']:.2e} / {x['grad_rel']:.2e} | {x['steps']:.2e} |")
    return lines


def readme_section(r, plan):
    extra = " ".join(plan["train_args"])
    return [f"| README command{' (+ ' + extra + ')' if extra else ''} | result | train loss "
            "| val loss | s |", "|---|---|---|---|---|"] + [
        f"| `{cmd}` | {x.get('error', 'ok')[:60]} | " +
        " | ".join(f"{x[k]:.4f}" if k in x else "-" for k in ("train_loss", "val_loss")) +
        f" | {x['seconds']} |" for cmd, x in r["readme"].items()]


def tests_section(r, plan):
    t = r["tests"]
    if "error" in t:  # it is in the result line
        return []
    how = "serial" if t["workers"] == 1 else f"{t['workers']} processes"
    return [f"tests ({how}): {t['passed']} passed, {t['failed']} failed, "
            f"{t['skipped']} skipped, {t['errors']} errors" +
            (f" ({', '.join(t['failures'])})" if t.get("failures") else "")]


def bench_section(r, plan):
    m, tl = plan["model"], plan["t_long"]
    lines = ["| bench | ms/step | tok/s | MFU | host launch | peak GiB |",
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
    return lines


def peers_section(r, plan):
    rat = ratios(r)
    lines = ["| peer (same call as bench) | device | B | T | dtype | ms/step | cupygpt's run "
             "| cupygpt / peer |", "|---|---|---|---|---|---|---|---|"]
    for name, p in r["peers"].items():
        if "error" in p:
            lines.append(f"| {name} | {p['error'][:60]} | | | | | | |")
            continue
        for x in [rat.get(name)] + [v for k, v in rat.items() if k.startswith(name + " / ")]:
            lines.append(f"| {name} | {p['device']} | {p['B']} | {p['T']} | {p['dtype']} | "
                         f"{p['ms_per_step']:.2f} | " +
                         (f"{x['cupygpt']}: {x['cupygpt_ms']:.2f} ms on "
                          f"{x['cupygpt_device']} | {x['ratio']:.2f} |" if x else "- | - |"))
    return lines


def pipeline_section(r, plan):
    return [f"pipeline ({plan['model']}, B=4, T={plan['t_short']}, 2 PEs over nvshmem): " +
            json.dumps({k: (v if not isinstance(v, dict) else
                            {kk: vv for kk, vv in v.items() if kk != "losses"})
                        for k, v in r["pipeline"].items()})]


def comm_section(r, plan):
    """The seeds' figures per transport (us: host alone / device loop / host issue), the
    crossover sizes and the predicted 2-GPU step."""
    c = r["comm"]
    lines = [f"comm ({plan['model']}, 2 PEs on one GPU, MPS: {c.get('mps')}):"]
    for key in ("against_nccl", "nvshmem"):
        rep = c.get(key, {})
        if "error" in rep:
            lines.append(f"- bench --comm ({key}): {rep['error']}")
        for kind, s in rep.get("seeds", {}).items():
            h, g = s["handoff_8B"], s["grad_sync"]
            lines.append(f"- {kind}: handoff of 8 B {h['host_us']:.1f} / {h['loop_us']:.1f} / "
                         f"{h['issue_us']:.1f} us (target {rep['targets']['handoff_us']:g}); "
                         "all-reduce " + ", ".join(f"{size} {x['loop_us']:.1f}"
                                                   for size, x in g.items()) + " us (loop)")
        for op, at in rep.get("crossover_bytes", {}).items():
            lines.append(f"- crossover {op}: {json.dumps(at)}")
    p = c.get("prediction")
    if p:
        lines.append("- predicted 2-GPU step: " + (p["error"] if "error" in p else
                                                   f"{p['step_ms']:.3f} ms ({json.dumps(p)})"))
    return lines


def sanitizer_section(r, plan):
    return ["compute-sanitizer: " + json.dumps(r["sanitizer"])]


SECTIONS = {"verify": verify_section, "readme": readme_section, "tests": tests_section,
            "bench": bench_section, "peers": peers_section, "pipeline": pipeline_section,
            "sanitizer": sanitizer_section, "comm": comm_section}
