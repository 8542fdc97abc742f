// llm.c's AdamW over a whole flat buffer. Launch: EW_THREADS per block over n parameters.
// sched = {lr, 1 - beta1^t, 1 - beta2^t, t} lives on the device so a captured CUDA graph
// replays with each step's learning rate, bias corrections and rounding seed. The gradient
// is clipped at the global norm clip (0: never): norm_sq, the norm squared, is on the
// device too (in double). The update is made in master (float): a bf16 run's fp32 master
// weights, or in an fp32 run params itself; params[i] becomes it rounded (stochastically in
// bf16).
#include "common.cuh"

// A 32-bit hash of (index, seed): precision.noise, bit for bit.
__device__ __forceinline__ unsigned noise(unsigned idx, unsigned seed) {
    unsigned h = (idx * 0x9E3779B1u) ^ seed;
    h ^= h >> 16;
    h *= 0x21F0AAADu;
    h ^= h >> 15;
    h *= 0x735A2D97u;
    h ^= h >> 15;
    return h;
}

__device__ __forceinline__ void store_rounded(float* p, float v, unsigned, unsigned) { *p = v; }

// v rounded up with probability its distance above the lower bf16 over the gap: 16 random
// bits added below the 16 bf16 keeps, then cut (precision.stochastic_round).
__device__ __forceinline__ void store_rounded(__nv_bfloat16* p, float v, unsigned seed,
                                              unsigned idx) {
    unsigned bits = __float_as_uint(v);
    unsigned short out = isnan(v) ? (unsigned short)((bits >> 16) | 0x40)
                                  : (unsigned short)((bits + (noise(idx, seed) & 0xFFFFu)) >> 16);
    *p = __ushort_as_bfloat16(out);
}

extern "C" __global__ void adamw(floatX* params, float* master, const floatX* grads, float* m,
                                 float* v, long long n, long long offset, const float* sched,
                                 float beta1, float beta2, float eps, float weight_decay,
                                 const double* norm_sq, float clip, unsigned salt) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    float g = load(grads[i]);
    float norm = (float)sqrt(norm_sq[0]);
    if (clip > 0.f && norm > clip) g *= clip / norm;
    float mi = beta1 * m[i] + (1.f - beta1) * g;
    float vi = beta2 * v[i] + (1.f - beta2) * g * g;
    m[i] = mi;
    v[i] = vi;
    float mhat = mi / sched[1], vhat = vi / sched[2], w = master[i];
    w -= sched[0] * (mhat / (sqrtf(vhat) + eps) + weight_decay * w);
    master[i] = w;
    store_rounded(&params[i], w, noise((unsigned)sched[3], salt), (unsigned)(offset + i));
}
