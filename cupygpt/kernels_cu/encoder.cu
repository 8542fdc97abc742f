// Token + position embedding. Launch: EW_THREADS per block over B*T*C (or T*C) elements.
#include "common.cuh"

// out (B,T,C) = wte[inp[b,t]] + wpe[t]. wte holds vocab rows [v0, v0 + rows) (a
// tensor-parallel shard): a token it does not hold gives 0; add_wpe 0: no positions.
extern "C" __global__ void encoder_forward(floatX* out, const int* inp, const floatX* wte,
                                           const floatX* wpe, int B, int T, int C, int v0,
                                           int rows, int add_wpe) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= (long long)B * T * C) return;
    int c = i % C, bt = i / C, t = bt % T, r = inp[bt] - v0;
    float x = (r >= 0 && r < rows) ? load(wte[(long long)r * C + c]) : 0.f;
    store(&out[i], add_wpe ? x + load(wpe[(long long)t * C + c]) : x);
}

// acc[inp[b,t]] += dout[b,t] for the tokens this shard holds: a repeated token makes several
// threads add to one row, so this is the one atomic (and so order-nondeterministic) gradient
// in the model. acc is float: dwte itself in an fp32 run; in a bf16 run a float buffer that
// add_into then adds to dwte, rounding once.
extern "C" __global__ void encoder_backward_wte(float* acc, const floatX* dout, const int* inp,
                                                int B, int T, int C, int v0, int rows) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= (long long)B * T * C) return;
    int c = i % C, bt = i / C, r = inp[bt] - v0;
    if (r >= 0 && r < rows) atomicAdd(&acc[(long long)r * C + c], load(dout[i]));
}

// dst += acc, rounded once; acc is zeroed for its next use.
extern "C" __global__ void add_into(floatX* dst, float* acc, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    store(&dst[i], load(dst[i]) + acc[i]);
    acc[i] = 0.f;
}

// dwpe[t] += sum over b of dout[b,t]; one thread per (t, c), deterministic.
extern "C" __global__ void encoder_backward_wpe(floatX* dwpe, const floatX* dout, int B, int T,
                                                int C) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= T * C) return;
    float s = 0.f;
    for (int b = 0; b < B; b++) s += load(dout[(long long)b * T * C + i]);
    store(&dwpe[i], load(dwpe[i]) + s);
}
