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

// v rounded to floatX for params: as is in fp32; in bf16 up with probability its distance
// above the lower bf16 over the gap: 16 random bits added below the 16 bf16 keeps, then
// cut (precision.stochastic_round).
template <typename T> __device__ __forceinline__ T round_param(float v, unsigned seed,
                                                                unsigned idx);
template <> __device__ __forceinline__ float round_param<float>(float v, unsigned, unsigned) {
    return v;
}
template <> __device__ __forceinline__ __nv_bfloat16 round_param<__nv_bfloat16>(
        float v, unsigned seed, unsigned idx) {
    unsigned bits = __float_as_uint(v);
    unsigned short out = isnan(v) ? (unsigned short)((bits >> 16) | 0x40)
                                  : (unsigned short)((bits + (noise(idx, seed) & 0xFFFFu)) >> 16);
    return __ushort_as_bfloat16(out);
}

// PACK floats of AdamW's state at p: 16-byte accesses where vec, else the first n.
__device__ __forceinline__ void load_state(float* f, const float* p, int n, bool vec) {
    for (int k = 0; k < PACK; k += 4) {
        if (vec) {
            Vec<float> q = *reinterpret_cast<const Vec<float>*>(p + k);
            for (int j = 0; j < 4; j++) f[k + j] = q.v[j];
        } else {
            for (int j = 0; j < 4; j++) f[k + j] = k + j < n ? p[k + j] : 0.f;
        }
    }
}
__device__ __forceinline__ void store_state(float* p, const float* f, int n, bool vec) {
    for (int k = 0; k < PACK; k += 4) {
        if (vec) {
            Vec<float> q;
            for (int j = 0; j < 4; j++) q.v[j] = f[k + j];
            *reinterpret_cast<Vec<float>*>(p + k) = q;
        } else {
            for (int j = 0; j < 4 && k + j < n; j++) p[k + j] = f[k + j];
        }
    }
}

// A thread updates PACK consecutive parameters (16-byte accesses to every array where the
// run is whole and aligned: a ZeRO-1 slice may not be), the clip's scale made once for
// them. Launch: EW_THREADS per block over n / PACK threads.
extern "C" __global__ void adamw(floatX* params, float* master, const floatX* grads, float* m,
                                 float* v, long long n, long long offset, const float* sched,
                                 float beta1, float beta2, float eps, float weight_decay,
                                 const double* norm_sq, float clip, unsigned salt) {
    long long i = (blockIdx.x * (long long)blockDim.x + threadIdx.x) * PACK;
    if (i >= n) return;
    int k = n - i < PACK ? (int)(n - i) : PACK;
    bool vec = k == PACK && aligned16(params + i) && aligned16(grads + i) &&
               aligned16(master + i) && aligned16(m + i) && aligned16(v + i);
    float norm = (float)sqrt(norm_sq[0]);  // (once per thread; the kernel's only double)
    float scale = clip > 0.f && norm > clip ? clip / norm : 1.f;
    float g[PACK], mi[PACK], vi[PACK], w[PACK];
    load_pack(g, grads + i, k, vec);
    load_state(mi, m + i, k, vec);
    load_state(vi, v + i, k, vec);
    load_state(w, master + i, k, vec);
    unsigned seed = noise((unsigned)sched[3], salt);
    Pack out;
    for (int q = 0; q < PACK; q++) {
        float gq = scale == 1.f ? g[q] : g[q] * scale;
        mi[q] = beta1 * mi[q] + (1.f - beta1) * gq;
        vi[q] = beta2 * vi[q] + (1.f - beta2) * gq * gq;
        float mhat = mi[q] / sched[1], vhat = vi[q] / sched[2];
        w[q] -= sched[0] * (mhat / (sqrtf(vhat) + eps) + weight_decay * w[q]);
        out.v[q] = round_param<floatX>(w[q], seed, (unsigned)(offset + i + q));
    }
    store_state(m + i, mi, k, vec);
    store_state(v + i, vi, k, vec);
    store_state(master + i, w, k, vec);
    if (vec) {
        *reinterpret_cast<Pack*>(params + i) = out;
    } else {
        for (int q = 0; q < k; q++) params[i + q] = out.v[q];
    }
}
