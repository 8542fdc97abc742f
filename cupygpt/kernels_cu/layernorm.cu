// LayerNorm over C, eps 1e-5. Launch: ROW_WARPS warps per block, one warp per row.
#include "common.cuh"

extern "C" __global__ void layernorm_forward(floatX* out, float* mean, float* rstd,
                                             const floatX* inp, const floatX* w,
                                             const floatX* b, int N, int C) {
    int row = blockIdx.x * ROW_WARPS + threadIdx.x / WARP, lane = threadIdx.x % WARP;
    if (row >= N) return;
    const floatX* x = inp + (long long)row * C;
    float s = 0.f;
    for (int i = lane; i < C; i += WARP) s += load(x[i]);
    float m = warp_sum(s) / C;
    float v = 0.f;
    for (int i = lane; i < C; i += WARP) { float d = load(x[i]) - m; v += d * d; }
    float r = 1.0f / sqrtf(warp_sum(v) / C + 1e-5f);  // not rsqrtf: keep it exact to the ulp
    floatX* o = out + (long long)row * C;
    for (int i = lane; i < C; i += WARP)
        store(&o[i], (load(x[i]) - m) * r * load(w[i]) + load(b[i]));
    if (lane == 0) { mean[row] = m; rstd[row] = r; }
}

// dinp += d(layernorm)/dinp; dnorm_out (float) = dout * norm, which the column sum turns
// into dw.
extern "C" __global__ void layernorm_backward(floatX* dinp, float* dnorm_out,
                                              const floatX* dout, const floatX* inp,
                                              const floatX* w, const float* mean,
                                              const float* rstd, int N, int C) {
    int row = blockIdx.x * ROW_WARPS + threadIdx.x / WARP, lane = threadIdx.x % WARP;
    if (row >= N) return;
    long long base = (long long)row * C;
    float m = mean[row], r = rstd[row], a = 0.f, bsum = 0.f;
    for (int i = lane; i < C; i += WARP) {
        float dn = load(w[i]) * load(dout[base + i]), n = (load(inp[base + i]) - m) * r;
        a += dn;
        bsum += dn * n;
    }
    float dnorm_mean = warp_sum(a) / C, dnorm_norm_mean = warp_sum(bsum) / C;
    for (int i = lane; i < C; i += WARP) {
        float n = (load(inp[base + i]) - m) * r, g = load(dout[base + i]);
        store(&dinp[base + i],
              load(dinp[base + i]) + (load(w[i]) * g - dnorm_mean - n * dnorm_norm_mean) * r);
        dnorm_out[base + i] = g * n;
    }
}
