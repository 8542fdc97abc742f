"""cupygpt's launch list for one d12 bf16 graph step (model/stage.py, backends/cuda/,
optim.py), each launch priced two ways (per call, seconds, no launch gap): plain (the
first model's physics: max(FLOP at GEFF x 989 TFLOP/s, bytes / BW, issue)) and sass (what
the sm_90 SASS adds: serialized round trips, occupancy, dispatch order; flash_sass.py).
Two states: "measured", the list the H200 profile ran (dfca9c6: bias gradients by column
sums, gelu adding fc's bias, the flash kernels then), kept for the calibration; and "now",
today's kernels by today's names, each with the profile name it was measured as
(measured_as), whose correction factor it takes. tests/dev/test_gpumodel.py checks "now"
against the kernels a cudasim step launches."""
from cupygpt.model.layout import logit_rows

from .flash import flash_flops, flash_time
from .hw import (
    HS,
    LAT_HBM,
    LAT_L2,
    LAT_L2_IDLE,
    NH,
    C,
    L,
    P,
    T,
    Vp,
    fl,
    gemm_cal,
    gemm_plain,
    issue,
    mem,
    wave1,
)

COLUMN_BLOCKS, COL_TILE, ROW_LANES = 528, 32, 8
RENAMED = {"layernorm_forward_v": "layernorm_forward", "layernorm_backward_v": "layernorm_backward",
           "residual_layernorm_forward_v": "residual_layernorm_forward",
           "cross_entropy_v": "cross_entropy", "sum_squares_partial_v": "sum_squares_partial",
           "gelu_forward": "gelu_bias_forward", "column_sum_f32": "column_sum_f32 (LN dw, db)"}


class Row:
    __slots__ = ("phase", "kernel", "calls", "plain", "sass", "flops", "bytes", "traced",
                 "launches", "measured_as")

    def __init__(self, phase, kernel, calls, plain, sass=None, flops=0.0, bytes_=0.0,
                 traced=True, launches=1, measured_as=None):
        self.phase, self.kernel, self.calls, self.launches = phase, kernel, calls, launches
        self.plain, self.sass = plain, plain if sass is None else sass
        self.flops, self.bytes, self.traced = flops, bytes_, traced
        self.measured_as = measured_as or kernel


def colsum_sass(N, OC, itemsize):
    """Phase 1: rows/ROW_LANES serialized 16-byte loads per thread; MEMBAR.SC.GPU +
    CCTL.IVALL + ATOMG ~1.5 us; the tile's last block finishes: ceil(R/8) partial rows x
    VEC(T) scalar loads, each behind a branch (serialized L2 round trips, the GPU idle)."""
    per_thread = 16 // itemsize
    tiles = -(-OC // (COL_TILE * per_thread))
    R = max(1, min(-(-COLUMN_BLOCKS // tiles), N // ROW_LANES))
    per = -(-N // R)
    R = -(-N // per)
    p1 = max(-(-per // ROW_LANES) * LAT_L2, mem(N * OC * itemsize))
    return p1 + 1.5e-6 + -(-R // ROW_LANES) * per_thread * LAT_L2_IDLE + 2 * LAT_L2_IDLE


def gemm(add, phase, op, calls, M, N, K, state, scale=1.0):
    """A cuBLAS(Lt) matmul row, named as the profile names it (gemmEx_ then, gemm_ now)."""
    t, f, by = gemm_plain(M, N, K, beta=op == "TN")
    name = f"{op} {M}x{N}x{K}"
    add(phase, ("gemmEx_" if state == "measured" else "gemm_") + name, calls, t,
        gemm_cal(M, N, K) * scale, f, by, measured_as="gemmEx_" + name)


def forward_rows(add, B, state, L):
    N = B * T
    b = N * C * 2 * 2 + T * C * 2 + N * 4
    add("forward", "encoder_forward", 1, max(mem(b), issue(N * C / 8 / 32, 272)),
        max(mem(b), 3 * LAT_HBM * 1.5), bytes_=b)
    b = N * C * 2 * 2 + N * 8
    add("forward", "layernorm_forward", 1, max(mem(b), issue(N, 686)), wave1(b, 3, 6), bytes_=b)
    for M, Nn, K in ((N, 3 * C, C), (N, C, C), (N, 4 * C, C), (N, C, 4 * C)):
        gemm(add, "forward", "NT", L, M, Nn, K, state)
    f = flash_flops("forward", B)
    by = N * 3 * C * 2 + N * C * 2 + B * NH * T * 4
    add("forward", f"flash_forward_{HS}", L, max(fl(f), mem(by)), flash_time("forward", state, B),
        f, by)
    b = 4 * N * C * 2 + N * 8
    add("forward", "residual_layernorm_forward", 2 * L, max(mem(b), issue(N, 985)),
        wave1(b, 6, 12), bytes_=b)
    b = 3 * N * 4 * C * 2
    add("forward", "gelu_bias_forward", L, max(mem(b), issue(N * 4 * C / 8 / 32, 393)), bytes_=b)


def head_rows(add, B, state):
    N = B * T
    rows = logit_rows(N, Vp)  # the head's chunk of positions (1024 at d12, B=4)
    chunks = -(-N // rows)
    gemm(add, "loss", "NT", chunks, rows, Vp, C, state)
    gemm(add, "loss", "TN", chunks, Vp, C, rows, state)
    gemm(add, "loss", "NN", chunks, rows, C, Vp, state)
    b, warps = 2 * rows * Vp * 2, rows * 32
    t = max(mem(b), issue(warps, 6.14 * 310 + 870))  # ~2800 instructions a warp
    add("loss", "cross_entropy", chunks, t, t, bytes_=b)
    add("loss", "loss_accumulate", 1, 3e-6, 4 * LAT_L2 + 2e-6)


def backward_rows(add, B, state, L):
    N = B * T
    b = N * C * 2 * 4 + (N // 8) * 2 * C * 4
    add("backward", "layernorm_backward", 2 * L + 1, max(mem(b), issue(N, 731)), wave1(b, 6, 12),
        bytes_=b)
    add("backward", "column_sum_f32 (LN dw, db)", 2 * L + 1, mem((N // 8) * 2 * C * 4) + 4e-6,
        colsum_sass(N // 8, 2 * C, 4), bytes_=(N // 8) * 2 * C * 4)
    for M, Nn, K in ((N, 4 * C, C), (N, C, 4 * C), (N, C, C), (N, C, 3 * C)):
        gemm(add, "backward", "NN", L, M, Nn, K, state)
    # dW: now with cuBLASLt's BGRADB epilogue summing the bias gradient (+3%, assumed)
    for M, Nn, K in ((C, 4 * C, N), (4 * C, C, N), (C, C, N), (3 * C, C, N)):
        gemm(add, "backward", "TN", L, M, Nn, K, state, 1.0 if state == "measured" else 1.03)
    if state == "measured":
        cs = [(oc, colsum_sass(N, oc, 2)) for oc in (C, 4 * C, C, 3 * C)]
        add("backward", "column_sum_x", 4 * L, sum(mem(N * oc * 2) + 4e-6 for oc, _ in cs) / 4,
            sum(t for _, t in cs) / 4, bytes_=sum(N * oc * 2 for oc, _ in cs) / 4)
    else:  # db += the epilogue's float sum, rounded: OC elements, latency alone
        add("backward", "bias_grad_add", 4 * L, 2e-6, 3 * LAT_L2 + 1e-6, measured_as="")
    b = 3 * N * 4 * C * 2
    add("backward", "gelu_backward", L, max(mem(b), issue(N * 4 * C / 8 / 32, 376)), bytes_=b)
    for kind in ("dq", "dkdv"):
        f = flash_flops(kind, B)
        by = N * 3 * C * 2 + N * C * 2 * (3 if kind == "dq" else 2) + 2 * B * NH * T * 4
        add("backward", f"flash_{kind}_{HS}", L, max(fl(f), mem(by)), flash_time(kind, state, B),
            f, by)
    if state == "measured":
        add("backward", "encoder_backward (4 kernels)", 1, 16e-6, 19e-6, launches=4)
    else:  # sort (bitonic, 1024 a block), rank, wte, wpe: latency-bound
        for k in ("encoder_sort_blocks", "encoder_rank", "encoder_backward_wte",
                  "encoder_backward_wpe"):
            add("backward", k, 1, 4e-6, 19e-6 / 4, measured_as="encoder_backward (4 kernels)")


def optimizer_rows(add):
    it = -(-P // 8) / (COLUMN_BLOCKS * 256)
    add("optimizer", "sum_squares_partial", 1, max(mem(P * 2), it * (LAT_HBM + 30e-9) / 4),
        max(mem(P * 2), it * LAT_HBM), bytes_=P * 2)
    add("optimizer", "sum_squares_finish", 1, 4e-6, 3 * LAT_L2 + 2e-6)
    b = P * 30
    add("optimizer", "adamw", 1, max(mem(b), issue(P / 8 / 32, 1018)), bytes_=b)


def cupygpt(B=4, state="now", layers=L):
    """Rows of one graph step of `layers` layers; "now" names today's kernels."""
    rows = []

    def add(phase, kernel, calls, plain, sass=None, flops=0.0, bytes_=0.0, **kw):
        name = kernel
        if state == "now":
            name = {v: k for k, v in RENAMED.items()}.get(kernel, kernel)
            kw.setdefault("measured_as", kernel)
        rows.append(Row(phase, name, calls, plain, sass, flops, bytes_, **kw))
    add("other", "memset grads (zero_grad, P bf16)", 1, mem(P * 2), bytes_=P * 2, traced=False)
    add("other", "memset dres + 2 scalar fills", 3, 1.5e-6, traced=False)
    forward_rows(add, B, state, layers)
    head_rows(add, B, state)
    backward_rows(add, B, state, layers)
    optimizer_rows(add)
    return rows
