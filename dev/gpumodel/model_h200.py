"""Per-launch model of one d12 (GPT-2 124M) bf16 training step, B=4, T=1024, on an H200
(GPUMODEL_HW=h100 for an H100), calibrated on the H200 run of 2026-11-26 (measured.py), and its
prediction for today's kernels (launches.py, state "now"): with our flash attention and
with cuDNN's (the attention llm.c + cuDNN's measured step implies, llmc.py).

    python -m dev.gpumodel.model_h200            # calibration, scenarios, prediction
    python -m dev.gpumodel.model_h200 --md FILE  # the same, also written to FILE

A launch's calibrated time is its SASS-aware prediction x the correction factor of the
kernel it was measured as (1 for kernels the profile never saw); a graph step adds
GRAPH_GAP per launch. The factors of kernels changed since the profile (the row kernels'
alignment fix, flash attention) are those of their measured versions: a guess, not a
measurement."""
import sys

from . import hw
from .flash import FLASH, flash_time, makespan
from .hw import EAGER_GAP, GRAPH_GAP, HS
from .launches import cupygpt
from .llmc import llmc, phase_total, total
from .measured import GRAPH_STEP_MS, LLMC_CUDNN_MS, LLMC_MS, factors, fit_gemm, measured

TARGET_MS = 0.9 * LLMC_CUDNN_MS      # the goal: 0.9x llm.c + cuDNN's 10.48 ms
FA_FLOP = 12 * 22.5e9                # FlashAttention's accounting: fwd 4, bwd 10 x B NH T^2/2 HS


def launch_counts(rows):
    """{kernel: launches per step} of a launch list's traced rows."""
    out = {}
    for r in rows:
        if r.traced:
            out[r.kernel] = out.get(r.kernel, 0) + r.calls * r.launches
    return out


def graph_ms(rows, fac, flash=None):
    """A graph step of rows, calibrated; flash (seconds) replaces the flash rows if given."""
    tot = 0.0
    for r in rows:
        if flash is not None and r.kernel.startswith("flash_"):
            continue
        tot += r.calls * (r.sass * fac.get(r.measured_as, 1.0) + GRAPH_GAP * r.launches)
    return (tot + (flash or 0.0)) * 1e3


def calibration(say, rows):
    """The per-kernel table of the measured launch list; returns the correction factors."""
    fac = factors(rows)
    say("| kernel | calls/step | plain ms | SASS-aware ms | measured ms | meas/plain | meas/SASS |")
    say("|---|---:|---:|---:|---:|---:|---:|")
    tp = ts = tm = 0.0
    for r in sorted(rows, key=lambda r: -(measured(r.kernel)[0] or 0)):
        m, src = measured(r.kernel)
        if m is None:
            continue
        pp = r.calls * (r.plain + EAGER_GAP * r.launches) * 1e3
        ps = r.calls * (r.sass + EAGER_GAP * r.launches) * 1e3
        tp, ts, tm = tp + pp, ts + ps, tm + m
        star = "" if src == "profile" else " *"
        say(f"| {r.kernel}{star} | {r.calls} | {pp:.3f} | {ps:.3f} | {m:.3f} | {m / pp:.2f} | "
            f"{m / ps:.2f} |")
    say(f"| **sum of traced kernels** | | {tp:.2f} | {ts:.2f} | {tm:.2f} | {tm / tp:.2f} | "
        f"{tm / ts:.2f} |")
    say(f"(* derived from the per-op totals; predictions include the eager gap "
        f"{EAGER_GAP * 1e6:.1f} us per launch, as the measurement does)")
    plain = sum(r.calls * (r.plain + GRAPH_GAP * r.launches) for r in rows) * 1e3
    sass = sum(r.calls * (r.sass + GRAPH_GAP * r.launches) for r in rows) * 1e3
    say(f"\nGraph step as measured ({sum(r.calls * r.launches for r in rows)} launches): plain "
        f"{plain:.2f} ms, SASS-aware {sass:.2f}, calibrated {graph_ms(rows, fac):.2f}; "
        f"measured {GRAPH_STEP_MS}")
    return fac


def cudnn_attention(say):
    """Seconds of cuDNN's attention per step (llm.c + cuDNN's measured step minus the rest)."""
    rest = total(llmc(4, cudnn=True, cudnn_att=0.0))
    naive = llmc(4)
    cud = LLMC_CUDNN_MS * 1e-3 - rest
    say(f"\nllm.c (model): no cuDNN {total(naive) * 1e3:.2f} ms (measured {LLMC_MS}), naive "
        f"attention {phase_total(naive, 'attention') * 1e3:.2f} ms, rest {rest * 1e3:.2f} ms; "
        f"cuDNN attention = {LLMC_CUDNN_MS} - rest = {cud * 1e3:.2f} ms per step "
        f"({FA_FLOP / cud / 1e12:.0f} TFLOP/s FA-accounting, +-0.5 ms)")
    return cud


def flash_states(say, fac):
    """Each state's flash kernels, calibrated by the measured kernels' factors; returns
    {state: seconds per step}."""
    say("\n| flash state | forward us | dq us | dkdv us | ms/step | TFLOP/s (FA) | blocks/SM |")
    say("|---|---:|---:|---:|---:|---:|---|")
    out = {}
    for state in FLASH:
        t = {k: flash_time(k, state) * fac[f"flash_{k}_{HS}"] for k in ("forward", "dq", "dkdv")}
        out[state] = 12 * sum(t.values())
        occ = "/".join(str(FLASH[state][k]["occ"]) for k in t)
        say(f"| {state} | {t['forward'] * 1e6:.1f} | {t['dq'] * 1e6:.1f} | {t['dkdv'] * 1e6:.1f} | "
            f"{out[state] * 1e3:.2f} | {FA_FLOP / out[state] / 1e12:.0f} | {occ} |")
    k = FLASH["now"]["dkdv"]
    say(f"(now: dkdv's critical path {makespan(k['occ'], cols=k['cols']):.0f} tiles of "
        f"{k['cols']} columns, {k['occ']} blocks per SM)")
    return out


def prediction(say, fac, flash, cud):
    """Today's graph step: our flash attention (head and now), and cuDNN's."""
    now = cupygpt(4, "now")
    launches = sum(r.calls * r.launches for r in now)
    say(f"\nToday's graph step, d12 B=4 T=1024 bf16 ({launches} launches; target "
        f"{TARGET_MS:.2f} ms = 0.9 x llm.c + cuDNN's {LLMC_CUDNN_MS}):")
    for what, secs in (("--attention own, flash as at this branch's start", flash["head"]),
                       ("--attention own, flash now", flash["now"]),
                       ("cuDNN attention (llm.c's, 4 launches a layer)", cud + 48 * GRAPH_GAP)):
        ms = graph_ms(now, fac, secs)
        say(f"  {what:50s} attention {secs * 1e3:5.2f} ms -> step {ms:5.2f} ms "
            f"({ms - TARGET_MS:+.2f} against the target)")
    rest = graph_ms(now, fac, 0.0)
    say(f"  the rest (everything but attention): {rest:.2f} ms; at the target attention may "
        f"take {TARGET_MS - rest:.2f} ms")


def main():
    """The report, priced with the cuBLAS fit redone from the measured launches; hw.GEMM
    (shared by every module's gemm_cal) holds the fit only while main runs, so a caller
    that goes on pricing (a test) gets the a priori values back."""
    saved = dict(hw.GEMM)
    try:
        hw.GEMM["R"], hw.GEMM["T0"] = fit_gemm(cupygpt(4, "measured"))
        report(sys.argv[sys.argv.index("--md") + 1] if "--md" in sys.argv else None)
    finally:
        hw.GEMM.update(saved)


def report(md):
    """Prints the calibration, the scenarios and today's prediction (also into md, a file)."""
    lines = []

    def say(s=""):
        print(s)
        lines.append(s)
    say(f"# d12 bf16 B=4 T=1024 on {hw.HWNAME.upper()}: BW {hw.BW / 1e12:.2f} TB/s, cuBLAS fit "
        f"t = {hw.GEMM['T0'] * 1e6:.1f} us + FLOP / {hw.GEMM['R'] / 1e12:.0f} TFLOP/s\n")
    fac = calibration(say, cupygpt(4, "measured"))
    cud = cudnn_attention(say)
    flash = flash_states(say, fac)
    prediction(say, fac, flash, cud)
    if md:
        open(md, "w").write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
