"""llm.c's train_gpt2.cu (bf16, -r 1, gelu_fusion 0, eager) on the same H200, priced as
launches: GEMMs from the cuBLAS fit, the kernels with a cupygpt twin at the twin's measured
H200 cost, the rest bottom-up; with cuDNN attention, that attention's time is what the
measured step leaves after the rest."""
from .hw import GEMM, HS, LAT_HBM, LAT_L2, NH, SMS, C, L, P, T, Vp, gemm_cal, issue, mem, wave1
from .launches import Row


def llmc(B=4, cudnn=False, cudnn_att=None, gap=2.3e-6):
    """Rows of llm.c's step on this GPU. GEMMs from the cuBLAS fit; kernels with a cupygpt twin
    at the twin's measured H200 cost (fused residual+LN 10.5 us, gelu 19 us, adamw 0.935 ms);
    the rest bottom-up. gap: eager GPU-side gap per launch (cupygpt eager 16.71 vs graph 16.19
    ms over 353 launches: +1.5 us over the graph's 0.8). cudnn_att: seconds per step."""
    N, BH = B * T, B * NH
    R = []
    add = lambda *a, **k: R.append(Row(*a, **k))  # noqa: E731
    g = gemm_cal
    add("other", "host syncs / loss readback", 1, 60e-6)
    add("other", "memsets (grads, scratch)", 1, mem(P * 2) + 10e-6, launches=3)
    add("forward", "encoder_forward (x128)", 1, wave1(N * C * 6, 2, 0))
    add("forward", "layernorm_forward", 1, 10e-6)
    for oc, k in ((3 * C, C), (C, C), (4 * C, C), (C, 4 * C)):
        add("forward", f"cublasLt fwd +bias {N}x{oc}x{k}", L, g(N, oc, k))
    add("forward", "fused_residual_forward5 (+LN)", 2 * L, 10.5e-6)
    add("forward", "gelu_forward", L, 19e-6)
    add("forward", "cublasLt logits (all rows)", 1, g(N, Vp, C))
    add("loss", "fused_classifier_kernel5", 1, max(mem(3 * N * Vp * 2), 0.2e-3))
    add("backward", "cublasLt head dinp + dW", 2, g(N, C, Vp))
    add("backward", "layernorm_backward_kernel10 (+memset)", 2 * L + 1, 16e-6, launches=2)
    add("backward", "gelu_forward recompute (-r 1)", L, 19e-6)
    add("backward", "gelu_backward_inplace", L, 19e-6)
    for oc, k in ((C, 4 * C), (4 * C, C), (C, C), (3 * C, C)):
        add("backward", f"cublasLt dinp {N}x{k}x{oc}", L, g(N, k, oc))
        add("backward", f"cublasLt dW {oc}x{k}x{N}", L, g(oc, k, N))
        # kernel9: 264 blocks of 1024, ~2 rows/thread, block reduce; reduce_add_sum: OC/1024
        # blocks summing ~22 float4 rows (independent loads): ~3 L2 round-trip groups
        add("backward", f"bias_kernel9 + reduce_add_sum {oc}", L,
            wave1(N * oc * 2, 2, 2) + 3 * LAT_L2 + 1e-6, launches=2)
    if cudnn:
        add("attention", "cuDNN attention fwd + bwd (per layer)", L, cudnn_att / L, launches=4)
    else:
        TT = BH * T * T * 2                     # one (B,NH,T,T) bf16 tensor: 100.7 MB
        qkv = N * 3 * C * 2
        ew = lambda by, ins: max(mem(by), issue(N * C / 32, ins))  # noqa: E731 (1 elem/thread)
        bg = lambda by: max(mem(by), 2.0 * BH * T * T * HS / GEMM["R"]) + GEMM["T0"]  # noqa: E731
        # softmax5: warp per row, lower triangle read twice (2nd from L1/L2), written once;
        # ~28 instr per element (2 IEEE expf); softmax bwd: 4 rows per block of 256, per row 2
        # dependent global loads + a block reduce (~2.2 us), 12288 blocks at 8 per SM.
        smf = max(mem(TT / 2 * 2), issue(BH * T * T / 2 / 32, 28))
        smb = max(mem(TT / 2 * 2 + TT), 12288 / (8 * SMS) * 4 * (2 * LAT_HBM + 0.8e-6))
        att = [("permute_kernel", ew(2 * qkv, 100)), ("GEMM preatt (bf16 TxT out)", bg(TT)),
               ("softmax_forward_kernel5", smf), ("GEMM att@v", bg(TT)),
               ("unpermute_kernel", ew(2 * N * C * 2, 60)),
               ("unpermute_kernel_backward", ew(2 * N * C * 2, 60)),
               ("GEMM datt", bg(TT)), ("GEMM dv", bg(TT)),
               ("softmax_autoregressive_backward_inplace", smb),
               ("GEMM dq", bg(TT)), ("GEMM dk", bg(TT)),
               ("permute_kernel_backward", ew(2 * qkv, 100))]
        for nm, t in att:
            add("attention", nm, L, t)
    add("loss", "global_sum_deterministic loss", 1, 3e-6)
    add("backward", "wpe_backward + wte_backward (bucketed)", 1, 30e-6, launches=3)
    add("optimizer", "global_norm_squared + aggregate", 1, 0.11e-3, launches=2)
    add("optimizer", "adamw_kernel3", 1, 0.935e-3)
    return R, gap


def total(rows_gap):
    rows, gap = rows_gap
    return sum(r.calls * (r.plain + gap * r.launches) for r in rows)


def phase_total(rows_gap, phase):
    rows, gap = rows_gap
    return sum(r.calls * (r.plain + gap * r.launches) for r in rows if r.phase == phase)
