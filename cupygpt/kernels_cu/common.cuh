// Shared helpers. Every kernel file includes this; all kernels are extern "C" fp32.
#pragma once
#ifndef INFINITY  // NVRTC (CuPy's compiler) has no <math.h>
#define INFINITY __int_as_float(0x7f800000)
#endif
#define WARP 32
#define FULL_MASK 0xffffffffu
// Elementwise kernels: 256 threads per block, one element per thread.
#define EW_THREADS 256
// Row kernels (layernorm, softmax): one warp per row, 8 warps per block.
#define ROW_WARPS 8

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ double warp_sum_d(double v) {
    for (int o = WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// Online softmax state (running max m, sum s of exp(x - m)), merged across lanes.
__device__ __forceinline__ void merge_max_sum(float& m, float& s, float m2, float s2) {
    float mn = fmaxf(m, m2);
    if (mn == -INFINITY) { m = mn; s = 0.f; return; }  // both empty: exp(-inf - -inf) is nan
    s = s * expf(m - mn) + s2 * expf(m2 - mn);
    m = mn;
}

__device__ __forceinline__ void warp_max_sum(float& m, float& s) {
    for (int o = WARP / 2; o > 0; o >>= 1) {
        float m2 = __shfl_xor_sync(FULL_MASK, m, o), s2 = __shfl_xor_sync(FULL_MASK, s, o);
        merge_max_sum(m, s, m2, s2);
    }
}

#define GELU_SCALE 0.7978845608028654f  // sqrt(2/pi)
