// LayerNorm over C, eps 1e-5. Launch: ROW_WARPS warps per block, one warp per row.
#include "common.cuh"

extern "C" __global__ void layernorm_forward(float* out, float* mean, float* rstd,
                                             const float* inp, const float* w, const float* b,
                                             int N, int C) {
    int row = blockIdx.x * ROW_WARPS + threadIdx.x / WARP, lane = threadIdx.x % WARP;
    if (row >= N) return;
    const float* x = inp + (long long)row * C;
    float s = 0.f;
    for (int i = lane; i < C; i += WARP) s += x[i];
    float m = warp_sum(s) / C;
    float v = 0.f;
    for (int i = lane; i < C; i += WARP) { float d = x[i] - m; v += d * d; }
    float r = 1.0f / sqrtf(warp_sum(v) / C + 1e-5f);  // not rsqrtf: keep it exact to the ulp
    float* o = out + (long long)row * C;
    for (int i = lane; i < C; i += WARP) o[i] = (x[i] - m) * r * w[i] + b[i];
    if (lane == 0) { mean[row] = m; rstd[row] = r; }
}

// dinp += d(layernorm)/dinp; dnorm_out = dout * norm, which the column sum turns into dw.
extern "C" __global__ void layernorm_backward(float* dinp, float* dnorm_out, const float* dout,
                                              const float* inp, const float* w,
                                              const float* mean, const float* rstd, int N,
                                              int C) {
    int row = blockIdx.x * ROW_WARPS + threadIdx.x / WARP, lane = threadIdx.x % WARP;
    if (row >= N) return;
    long long base = (long long)row * C;
    float m = mean[row], r = rstd[row], a = 0.f, bsum = 0.f;
    for (int i = lane; i < C; i += WARP) {
        float dn = w[i] * dout[base + i], n = (inp[base + i] - m) * r;
        a += dn;
        bsum += dn * n;
    }
    float dnorm_mean = warp_sum(a) / C, dnorm_norm_mean = warp_sum(bsum) / C;
    for (int i = lane; i < C; i += WARP) {
        float n = (inp[base + i] - m) * r, g = dout[base + i];
        dinp[base + i] += (w[i] * g - dnorm_mean - n * dnorm_norm_mean) * r;
        dnorm_out[base + i] = g * n;
    }
}
