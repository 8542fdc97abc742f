"""The machine the model prices launches on (an H200 by default, or an H100:
GPUMODEL_HW=h100), and the cost formulas every launch list shares. Environment, each name
prefixed GPUMODEL_ so that no other tool's HW or CLK changes the model: GPUMODEL_HW,
GPUMODEL_BW (bytes/s), GPUMODEL_GEFF, GPUMODEL_CLK, GPUMODEL_LAT_HBM, GPUMODEL_LAT_L2,
GPUMODEL_LAT_L2_IDLE, GPUMODEL_EAGER_GAP, GPUMODEL_GRAPH_GAP."""
import os


def E(name, default):
    """The model's setting name: GPUMODEL_<name> from the environment, else default."""
    return os.environ.get("GPUMODEL_" + name, default)


HWNAME = E("HW", "h200")
# HBM: H200 4.8 TB/s nominal, 4.3 measured (copy); H100 SXM 3.35 nominal, 80% as before.
BW = float(E("BW", 4.3e12 if HWNAME == "h200" else 3.35e12 * 0.80))
GEFF = float(E("GEFF", "0.70"))            # a priori GEMM efficiency of 989 TFLOP/s
PEAK = 989.4e12 * GEFF
CLK = float(E("CLK", "1.98e9"))             # nvidia-smi max SM clock (H200 = H100 SXM)
SMS, SMSP = 132, 528
LAT_HBM = float(E("LAT_HBM", "0.7e-6"))     # loaded DRAM round trip
LAT_L2 = float(E("LAT_L2", "0.3e-6"))       # loaded L2 round trip (~600 cycles)
LAT_L2_IDLE = float(E("LAT_L2_IDLE", "0.15e-6"))  # L2 round trip with the GPU nearly idle
# Measured per-kernel times are CUDA-event brackets around each eager launch: they include
# the GPU-side launch gap (fitted: sum(per-kernel) 17.05 ms against the graph step 16.19 ms).
EAGER_GAP = float(E("EAGER_GAP", "3.4e-6"))
GRAPH_GAP = float(E("GRAPH_GAP", "0.8e-6"))
# GPT-2 124M (d12) at T=1024
L, C, NH, HS, V, Vp, T = 12, 768, 12, 64, 50257, 50304, 1024
P = 124_475_904


def mem(b):
    return b / BW


def issue(warps, cyc, ipc=1.0):
    return warps / SMSP * cyc / CLK / ipc


def fl(f):
    return f / PEAK


def wave1(b, rt_hbm, rt_l2):
    """A one-wave kernel whose warps are coupled by barriers: its serialized round trips, plus
    half its transfer time not hidden behind them."""
    return rt_hbm * LAT_HBM + rt_l2 * LAT_L2 + 0.5 * mem(b)


# Calibrated cuBLAS model, fitted to the 12 measured gemmEx shapes (eager, minus EAGER_GAP):
# t = t0 + FLOP / R (measured.fit_gemm redoes the fit; model_h200 sets these from it).
GEMM = {"R": 729e12, "T0": 3.1e-6}


def gemm_plain(M, N, K, beta=False):
    f = 2.0 * M * N * K
    b = 2 * (M * K + K * N + M * N * (2 if beta else 1))
    return max(fl(f), mem(b)), f, b


def gemm_cal(M, N, K):
    return GEMM["T0"] + 2.0 * M * N * K / GEMM["R"]
