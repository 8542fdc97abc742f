"""What the H200 measured (2026-11-26, project at dfca9c6; h200-2026-11-26-profile.txt: an
eager bench --profile, CUDA events around each launch, ms per step of d12 bf16 B=4 T=1024;
the graph step 16.19 ms), and the calibration drawn from it: the cuBLAS fit and each
kernel's correction factor (measured / SASS-aware prediction)."""
from collections import OrderedDict

from .hw import EAGER_GAP

GRAPH_STEP_MS = 16.19                       # bench's graph step, B=4 (H200, 2026-11-26)
LLMC_MS, LLMC_CUDNN_MS = 14.19, 10.48       # llm.c bf16 B4 on the same H200
# Top 20 from the profile; the rest derived from the per-op totals minus the known kernels
# minus 3.5 us per op call (the op-level bracket's own gap, as seen on attention_*,
# cross_entropy, residual_layernorm_forward, adamw).
OP_GAP = 3.5e-3
MEASURED = OrderedDict([
    ("flash_dkdv_64", 2.948), ("flash_dq_64", 2.347), ("flash_forward_64", 1.613),
    ("column_sum_x", 1.387), ("adamw", 0.936), ("cross_entropy", 0.638),
    ("layernorm_backward", 0.606),
    ("gemmEx_TN 50304x768x1024", 0.512), ("gemmEx_NT 1024x50304x768", 0.458),
    ("gemmEx_NN 1024x768x50304", 0.419), ("gemmEx_NT 4096x3072x768", 0.414),
    ("gemmEx_NN 4096x3072x768", 0.404), ("gemmEx_TN 768x3072x4096", 0.397),
    ("gemmEx_TN 3072x768x4096", 0.395), ("gemmEx_NT 4096x768x3072", 0.366),
    ("gemmEx_NN 4096x768x3072", 0.363), ("gemmEx_NT 4096x2304x768", 0.343),
    ("residual_layernorm_forward", 0.333), ("gemmEx_TN 2304x768x4096", 0.321),
    ("gemmEx_NN 4096x768x2304", 0.291),
])
DERIVED = OrderedDict([
    ("gemmEx_NT 4096x768x768", 1.907 - (0.458 + 0.414 + 0.366 + 0.343) - 52 * OP_GAP),
    ("gemmEx_NN 4096x768x768", 1.789 - (0.419 + 0.404 + 0.363 + 0.291) - 52 * OP_GAP),
    ("gemmEx_TN 768x768x4096", 3.419 - (0.512 + 0.397 + 0.395 + 0.321) - 1.387 - 52 * OP_GAP),
    ("column_sum_f32 (LN dw, db)", 0.968 - 0.606 - 25 * OP_GAP),
    ("gelu_bias_forward", 0.305 - 12 * OP_GAP),
    ("gelu_backward", 0.314 - 12 * OP_GAP),
    ("sum_squares_partial", 0.127 - OP_GAP - 0.006),   # finish taken as its model's ~6 us
    ("sum_squares_finish", 0.006),
    ("encoder_backward (4 kernels)", 0.124 - OP_GAP),
    ("encoder_forward", 0.024 - OP_GAP), ("layernorm_forward", 0.019 - OP_GAP),
    ("loss_accumulate", 0.009 - OP_GAP),
])


def measured(key):
    """(ms per step, "profile" or "derived"), or (None, "") for a kernel not measured."""
    if key in MEASURED:
        return MEASURED[key], "profile"
    if key in DERIVED:
        return DERIVED[key], "derived"
    return None, ""


def fit_gemm(rows):
    """Least squares t = t0 + F/R over the profiled gemmEx shapes (eager minus EAGER_GAP):
    (R, t0)."""
    xs, ys = [], []
    for r in rows:
        m, src = measured(r.kernel)
        if r.kernel.startswith("gemmEx") and src == "profile":
            xs.append(r.flops)
            ys.append(m * 1e-3 / r.calls - EAGER_GAP)
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    s = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return 1.0 / s, my - s * mx


def factors(rows):
    """{profile name: measured per-call duration / SASS-aware prediction} over the measured
    launch list's rows."""
    out = {}
    for r in rows:
        m, _ = measured(r.kernel)
        if m is not None:
            out[r.kernel] = (m / r.calls * 1e-3 - EAGER_GAP * r.launches) / r.sass
    return out
