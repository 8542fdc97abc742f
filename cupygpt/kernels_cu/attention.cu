// Causal self-attention pieces around cuBLAS's batched matmuls (done in Python):
// qkv (B,T,3,NH,HS) -> q,k,v (B,NH,T,HS); preatt = scale * q k^T (the GEMM's alpha);
// att = softmax(preatt); y = att v; y (B,NH,T,HS) -> out (B,T,NH,HS). preatt, att and their
// gradients are stored (floatX); the GEMMs' outputs y, dq, dk, dv are float, rounded once
// where the permutes store them. Elementwise kernels: EW_THREADS per block over B*NH*T*HS;
// softmax kernels: one warp per (b, h, t) row, ROW_WARPS per block.
#include "common.cuh"

// For i indexing (B,NH,T,HS): where that (b, h, t, d) sits in qkv (B,T,3,NH,HS), as q
// (k is +C, v is +2C), and in (B,T,NH,HS).
__device__ __forceinline__ long long qkv_offset(long long i, int T, int NH, int HS) {
    int d = i % HS, t = (i / HS) % T, h = (i / ((long long)HS * T)) % NH;
    long long b = i / ((long long)HS * T * NH), C = (long long)NH * HS;
    return b * T * 3 * C + (long long)t * 3 * C + h * HS + d;
}

__device__ __forceinline__ long long bthd_offset(long long i, int T, int NH, int HS) {
    int d = i % HS, t = (i / HS) % T, h = (i / ((long long)HS * T)) % NH;
    long long b = i / ((long long)HS * T * NH);
    return ((b * T + t) * NH + h) * HS + d;
}

extern "C" __global__ void permute_qkv(floatX* q, floatX* k, floatX* v, const floatX* qkv,
                                       int B, int T, int NH, int HS) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= (long long)B * NH * T * HS) return;
    long long src = qkv_offset(i, T, NH, HS), C = (long long)NH * HS;
    q[i] = qkv[src];
    k[i] = qkv[src + C];
    v[i] = qkv[src + 2 * C];
}

extern "C" __global__ void permute_qkv_backward(floatX* dqkv, const float* dq, const float* dk,
                                                const float* dv, int B, int T, int NH, int HS) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= (long long)B * NH * T * HS) return;
    long long dst = qkv_offset(i, T, NH, HS), C = (long long)NH * HS;
    store(&dqkv[dst], dq[i]);
    store(&dqkv[dst + C], dk[i]);
    store(&dqkv[dst + 2 * C], dv[i]);
}

// y (B,NH,T,HS) -> out (B,T,NH,HS); backward is the same index map read the other way.
extern "C" __global__ void unpermute(floatX* out, const float* y, int B, int T, int NH,
                                     int HS) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < (long long)B * NH * T * HS) store(&out[bthd_offset(i, T, NH, HS)], y[i]);
}

extern "C" __global__ void unpermute_backward(floatX* dy, const floatX* dout, int B, int T,
                                              int NH, int HS) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < (long long)B * NH * T * HS) dy[i] = dout[bthd_offset(i, T, NH, HS)];
}

// att[row, j] = softmax_j(preatt[row, j]) for j <= t, 0 after (the causal mask).
extern "C" __global__ void softmax_forward(floatX* att, const floatX* preatt, int rows, int T) {
    int row = blockIdx.x * ROW_WARPS + threadIdx.x / WARP, lane = threadIdx.x % WARP;
    if (row >= rows) return;
    int t = row % T;
    const floatX* x = preatt + (long long)row * T;
    float m = -INFINITY, s = 0.f;
    for (int j = lane; j <= t; j += WARP) merge_max_sum(m, s, load(x[j]), 1.f);
    warp_max_sum(m, s);
    floatX* o = att + (long long)row * T;
    for (int j = lane; j < T; j += WARP) store(&o[j], j <= t ? expf(load(x[j]) - m) / s : 0.f);
}

// Generation's one new query per head (the KV cache holds every earlier key): att[row, j] =
// softmax_j(scores[row, j]) over all n columns, no mask; rows = NH. scores are the GEMM's
// float output; att feeds the next GEMM, so it is stored (floatX).
extern "C" __global__ void softmax_decode(floatX* att, const float* scores, int rows, int n) {
    int row = blockIdx.x * ROW_WARPS + threadIdx.x / WARP, lane = threadIdx.x % WARP;
    if (row >= rows) return;
    const float* x = scores + (long long)row * n;
    float m = -INFINITY, s = 0.f;
    for (int j = lane; j < n; j += WARP) merge_max_sum(m, s, x[j], 1.f);
    warp_max_sum(m, s);
    floatX* o = att + (long long)row * n;
    for (int j = lane; j < n; j += WARP) store(&o[j], expf(x[j] - m) / s);
}

// dpreatt = att * (datt - sum(att * datt)) * scale over j <= t, 0 after.
extern "C" __global__ void softmax_backward(floatX* dpreatt, const floatX* datt,
                                            const floatX* att, float scale, int rows, int T) {
    int row = blockIdx.x * ROW_WARPS + threadIdx.x / WARP, lane = threadIdx.x % WARP;
    if (row >= rows) return;
    int t = row % T;
    long long base = (long long)row * T;
    float s = 0.f;
    for (int j = lane; j <= t; j += WARP) s += load(att[base + j]) * load(datt[base + j]);
    s = warp_sum(s);
    for (int j = lane; j < T; j += WARP)
        store(&dpreatt[base + j],
              j <= t ? load(att[base + j]) * (load(datt[base + j]) - s) * scale : 0.f);
}
