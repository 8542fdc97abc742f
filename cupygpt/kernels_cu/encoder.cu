// Token + position embedding. Launch: EW_THREADS per block over B*T*C (or T*C) elements.
#include "common.cuh"

// out (B,T,C) = wte[inp[b,t]] + wpe[t]. wte holds vocab rows [v0, v0 + rows) (a
// tensor-parallel shard): a token it does not hold gives 0; add_wpe 0: no positions.
extern "C" __global__ void encoder_forward(float* out, const int* inp, const float* wte,
                                           const float* wpe, int B, int T, int C, int v0,
                                           int rows, int add_wpe) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= (long long)B * T * C) return;
    int c = i % C, bt = i / C, t = bt % T, r = inp[bt] - v0;
    float x = (r >= 0 && r < rows) ? wte[(long long)r * C + c] : 0.f;
    out[i] = add_wpe ? x + wpe[(long long)t * C + c] : x;
}

// dwte[inp[b,t]] += dout[b,t] for the tokens this shard holds: a repeated token makes
// several threads add to one row, so this is the one atomic (and so order-nondeterministic)
// gradient in the model.
extern "C" __global__ void encoder_backward_wte(float* dwte, const float* dout, const int* inp,
                                                int B, int T, int C, int v0, int rows) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= (long long)B * T * C) return;
    int c = i % C, bt = i / C, r = inp[bt] - v0;
    if (r >= 0 && r < rows) atomicAdd(&dwte[(long long)r * C + c], dout[i]);
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
