// LayerNorm over C, eps 1e-5. Launch: ROW_WARPS warps per block, one warp per row. A lane
// takes PACK adjacent columns at a time (c = lane * PACK, then + WARP * PACK): one 16-byte
// access per array where the run is whole and aligned, else element by element, the same
// columns and float math either way.
#include "common.cuh"

// V: every row's packs are whole aligned 16-byte runs (C a multiple of PACK and every array
// 16-byte aligned; the host checks once per launch and launches the kernel's _v entry), so
// each pack's loads are straight-line code, issued back to back, and the column loops
// unroll with several packs in flight; else each pack is checked (and, misaligned, read
// element by element). The same columns and float math either way.
template <bool V>
__device__ __forceinline__ bool whole(int c, int C, const void* a, const void* b,
                                      const void* d = nullptr, const void* e = nullptr) {
    return V || (c + PACK <= C && aligned16(a) && aligned16(b) && (!d || aligned16(d)) &&
                 (!e || aligned16(e)));
}

// The warp's row x (C columns) normalized into o; mean and rstd of the row returned.
template <bool V>
__device__ void layernorm_row(floatX* __restrict__ o, float& m, float& r,
                              const floatX* __restrict__ x, const floatX* __restrict__ w,
                              const floatX* __restrict__ b, int C, int lane) {
    float f[PACK], s = 0.f;
    #pragma unroll 4
    for (int c = lane * PACK; c < C; c += WARP * PACK) {
        load_pack(f, x + c, C - c, whole<V>(c, C, x + c, x + c));
        for (int k = 0; k < PACK; k++) s += f[k];
    }
    m = warp_sum(s) / C;
    float v = 0.f;
    #pragma unroll 4
    for (int c = lane * PACK; c < C; c += WARP * PACK) {
        load_pack(f, x + c, C - c, whole<V>(c, C, x + c, x + c));
        for (int k = 0; k < PACK && (V || c + k < C); k++) v += (f[k] - m) * (f[k] - m);
    }
    r = 1.0f / sqrtf(warp_sum(v) / C + 1e-5f);  // not rsqrtf: keep it exact to the ulp
    #pragma unroll 2
    for (int c = lane * PACK; c < C; c += WARP * PACK) {
        bool vec = whole<V>(c, C, x + c, o + c, w + c, b + c);
        float wf[PACK], bf[PACK];
        load_pack(f, x + c, C - c, vec);
        load_pack(wf, w + c, C - c, vec);
        load_pack(bf, b + c, C - c, vec);
        for (int k = 0; k < PACK; k++) f[k] = (f[k] - m) * r * wf[k] + bf[k];
        store_pack(o + c, f, C - c, vec);
    }
}

template <bool V>
__device__ void layernorm_forward_rows(floatX* out, float* mean, float* rstd, const floatX* inp,
                                       const floatX* w, const floatX* b, int N, int C) {
    int row = blockIdx.x * ROW_WARPS + threadIdx.x / WARP, lane = threadIdx.x % WARP;
    if (row >= N) return;
    long long base = (long long)row * C;
    float m, r;
    layernorm_row<V>(out + base, m, r, inp + base, w, b, C, lane);
    if (lane == 0) { mean[row] = m; rstd[row] = r; }
}

extern "C" __global__ void layernorm_forward(floatX* out, float* mean, float* rstd,
                                             const floatX* inp, const floatX* w,
                                             const floatX* b, int N, int C) {
    layernorm_forward_rows<false>(out, mean, rstd, inp, w, b, N, C);
}

extern "C" __global__ void layernorm_forward_v(floatX* out, float* mean, float* rstd,
                                               const floatX* inp, const floatX* w,
                                               const floatX* b, int N, int C) {
    layernorm_forward_rows<true>(out, mean, rstd, inp, w, b, N, C);
}

// The warp's row of res = a + b (a row-parallel projection's output, its bias added by
// its GEMM, onto the residual stream), stored.
template <bool V>
__device__ __forceinline__ void residual_row(floatX* __restrict__ res,
                                             const floatX* __restrict__ a,
                                             const floatX* __restrict__ b, int C, int lane) {
    #pragma unroll 2
    for (int c = lane * PACK; c < C; c += WARP * PACK) {
        bool vec = whole<V>(c, C, res + c, a + c, b + c);
        float x[PACK], y[PACK];
        load_pack(x, a + c, C - c, vec);
        load_pack(y, b + c, C - c, vec);
        for (int k = 0; k < PACK; k++) x[k] += y[k];
        store_pack(res + c, x, C - c, vec);
    }
}

// The residual row, then out = layernorm(res) from the stored values, as layernorm_forward
// computes it (each lane reads back the columns it wrote itself: no barrier needed).
template <bool V>
__device__ void residual_layernorm_rows(floatX* res, const floatX* a, const floatX* b,
                                        floatX* out, float* mean, float* rstd, const floatX* w,
                                        const floatX* lnb, int N, int C) {
    int row = blockIdx.x * ROW_WARPS + threadIdx.x / WARP, lane = threadIdx.x % WARP;
    if (row >= N) return;
    long long base = (long long)row * C;
    residual_row<V>(res + base, a + base, b + base, C, lane);
    float m, r;
    layernorm_row<V>(out + base, m, r, res + base, w, lnb, C, lane);
    if (lane == 0) { mean[row] = m; rstd[row] = r; }
}

// The scalar entry and the 16-byte one (_v), chosen once per launch by alignment.
#define RESIDUAL_LAYERNORM(NAME, VEC)                                                     \
    extern "C" __global__ void NAME(floatX* res, const floatX* a, const floatX* b,       \
                                    floatX* out, float* mean, float* rstd,               \
                                    const floatX* w, const floatX* lnb, int N, int C) {  \
        residual_layernorm_rows<VEC>(res, a, b, out, mean, rstd, w, lnb, N, C);          \
    }
RESIDUAL_LAYERNORM(residual_layernorm_forward, false)
RESIDUAL_LAYERNORM(residual_layernorm_forward_v, true)

// dinp += d(layernorm)/dinp for the block's ROW_WARPS rows, and the block's partial
// weight and bias gradients: partial[block, c] = sum over its rows of dout * norm,
// partial[block, C + c] of dout, the rows added in row order (column_sum_f32 then sums the
// blocks' partials in block order: deterministic). Columns go WARP * PACK at a time
// through shared memory, where the warps' rows meet.
template <bool V>
__device__ void layernorm_backward_rows(floatX* __restrict__ dinp, float* __restrict__ partial,
                                        const floatX* __restrict__ dout,
                                        const floatX* __restrict__ inp,
                                        const floatX* __restrict__ w, const float* mean,
                                        const float* rstd, int N, int C) {
    __shared__ float rows[ROW_WARPS][2][WARP * PACK];
    int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP, row = blockIdx.x * ROW_WARPS + warp;
    bool live = row < N;
    long long base = (long long)(live ? row : 0) * C;
    const floatX *g = dout + base, *x = inp + base;
    float m = mean[live ? row : 0], r = rstd[live ? row : 0], a = 0.f, bsum = 0.f;
    float gf[PACK], xf[PACK], wf[PACK], df[PACK];
    #pragma unroll 2
    for (int c = lane * PACK; c < C; c += WARP * PACK) {
        bool vec = whole<V>(c, C, g + c, x + c, w + c);
        load_pack(gf, g + c, C - c, vec);
        load_pack(xf, x + c, C - c, vec);
        load_pack(wf, w + c, C - c, vec);
        for (int k = 0; k < PACK; k++) {
            float dn = wf[k] * gf[k];
            a += dn;
            bsum += dn * ((xf[k] - m) * r);
        }
    }
    float dnorm_mean = warp_sum(a) / C, dnorm_norm_mean = warp_sum(bsum) / C;
    for (int c0 = 0; c0 < C; c0 += WARP * PACK) {
        int c = c0 + lane * PACK;
        for (int k = 0; k < PACK; k++) rows[warp][0][lane * PACK + k] = rows[warp][1][lane * PACK + k] = 0.f;
        if (live && c < C) {
            bool vec = whole<V>(c, C, g + c, x + c, w + c, dinp + base + c);
            load_pack(gf, g + c, C - c, vec);
            load_pack(xf, x + c, C - c, vec);
            load_pack(wf, w + c, C - c, vec);
            load_pack(df, dinp + base + c, C - c, vec);
            for (int k = 0; k < PACK; k++) {
                float n = (xf[k] - m) * r;
                df[k] += (wf[k] * gf[k] - dnorm_mean - n * dnorm_norm_mean) * r;
                rows[warp][0][lane * PACK + k] = gf[k] * n;
                rows[warp][1][lane * PACK + k] = gf[k];
            }
            store_pack(dinp + base + c, df, C - c, vec);
        }
        __syncthreads();
        for (int j = threadIdx.x; j < 2 * WARP * PACK; j += blockDim.x) {
            int q = j / (WARP * PACK), k = j % (WARP * PACK);
            float s = 0.f;
            for (int v = 0; v < ROW_WARPS; v++) s += rows[v][q][k];
            if (c0 + k < C) partial[(long long)blockIdx.x * 2 * C + q * C + c0 + k] = s;
        }
        __syncthreads();
    }
}

extern "C" __global__ void layernorm_backward(floatX* dinp, float* partial, const floatX* dout,
                                              const floatX* inp, const floatX* w,
                                              const float* mean, const float* rstd, int N,
                                              int C) {
    layernorm_backward_rows<false>(dinp, partial, dout, inp, w, mean, rstd, N, C);
}

extern "C" __global__ void layernorm_backward_v(floatX* dinp, float* partial, const floatX* dout,
                                                const floatX* inp, const floatX* w,
                                                const float* mean, const float* rstd, int N,
                                                int C) {
    layernorm_backward_rows<true>(dinp, partial, dout, inp, w, mean, rstd, N, C);
}
