// Token + position embedding. Launch: EW_THREADS per block over B*T*C (or T*C) elements.
#include "common.cuh"

// out (B,T,C) = wte[inp[b,t]] + wpe[t]
extern "C" __global__ void encoder_forward(float* out, const int* inp, const float* wte,
                                           const float* wpe, int B, int T, int C) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= (long long)B * T * C) return;
    int c = i % C, bt = i / C, t = bt % T;
    out[i] = wte[(long long)inp[bt] * C + c] + wpe[(long long)t * C + c];
}

// dwte[inp[b,t]] += dout[b,t]: a repeated token makes several threads add to one row,
// so this is the one atomic (and so order-nondeterministic) gradient in the model.
extern "C" __global__ void encoder_backward_wte(float* dwte, const float* dout, const int* inp,
                                                int B, int T, int C) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= (long long)B * T * C) return;
    int c = i % C, bt = i / C;
    atomicAdd(&dwte[(long long)inp[bt] * C + c], dout[i]);
}

// dwpe[t] += sum over b of dout[b,t]; one thread per (t, c), deterministic.
extern "C" __global__ void encoder_backward_wpe(float* dwpe, const float* dout, int B, int T,
                                                int C) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= T * C) return;
    float s = 0.f;
    for (int b = 0; b < B; b++) s += dout[(long long)b * T * C + i];
    dwpe[i] += s;
}
