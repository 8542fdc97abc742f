// Elementwise ops. Launch: EW_THREADS per block, one element per thread.
#include "common.cuh"

extern "C" __global__ void gelu_forward(floatX* out, const floatX* inp, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    float x = load(inp[i]);
    store(&out[i], 0.5f * x * (1.f + tanhf(GELU_SCALE * (x + 0.044715f * x * x * x))));
}

extern "C" __global__ void gelu_backward(floatX* dinp, const floatX* inp, const floatX* dout,
                                         long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    float x = load(inp[i]), th = tanhf(GELU_SCALE * (x + 0.044715f * x * x * x));
    float local = 0.5f * (1.f + th) +
                  0.5f * x * (1.f - th * th) * GELU_SCALE * (1.f + 3.f * 0.044715f * x * x);
    store(&dinp[i], local * load(dout[i]));
}

extern "C" __global__ void residual_forward(floatX* out, const floatX* a, const floatX* b,
                                            long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) store(&out[i], load(a[i]) + load(b[i]));
}

// out (N,OC) = bias (OC) in every row, before cuBLAS adds inp @ w^T to it (beta 1): the sum
// is rounded once, in the GEMM's epilogue.
extern "C" __global__ void broadcast_bias(floatX* out, const floatX* bias, long long n, int OC) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) out[i] = bias[i % OC];
}
