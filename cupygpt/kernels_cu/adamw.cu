// llm.c's AdamW over a whole flat buffer. Launch: EW_THREADS per block over n parameters.
// sched = {lr, 1 - beta1^t, 1 - beta2^t} lives on the device so a captured CUDA graph
// replays with each step's learning rate and bias corrections. The gradient is clipped at
// the global norm clip (0: never): norm_sq, the norm squared, is on the device too (double).
#include "common.cuh"

extern "C" __global__ void adamw(float* params, const float* grads, float* m, float* v,
                                 long long n, const float* sched, float beta1, float beta2,
                                 float eps, float weight_decay, const double* norm_sq,
                                 float clip) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    float g = grads[i];
    float norm = (float)sqrt(norm_sq[0]);
    if (clip > 0.f && norm > clip) g *= clip / norm;
    float mi = beta1 * m[i] + (1.f - beta1) * g;
    float vi = beta2 * v[i] + (1.f - beta2) * g * g;
    m[i] = mi;
    v[i] = vi;
    float mhat = mi / sched[1], vhat = vi / sched[2];
    params[i] -= sched[0] * (mhat / (sqrtf(vhat) + eps) + weight_decay * params[i]);
}
