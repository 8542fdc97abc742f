// Elementwise ops. Launch: EW_THREADS per block, one element per thread.
#include "common.cuh"

extern "C" __global__ void gelu_forward(float* out, const float* inp, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    float x = inp[i];
    out[i] = 0.5f * x * (1.f + tanhf(GELU_SCALE * (x + 0.044715f * x * x * x)));
}

extern "C" __global__ void gelu_backward(float* dinp, const float* inp, const float* dout,
                                         long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    float x = inp[i], th = tanhf(GELU_SCALE * (x + 0.044715f * x * x * x));
    float local = 0.5f * (1.f + th) +
                  0.5f * x * (1.f - th * th) * GELU_SCALE * (1.f + 3.f * 0.044715f * x * x);
    dinp[i] = local * dout[i];
}

extern "C" __global__ void residual_forward(float* out, const float* a, const float* b,
                                            long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] + b[i];
}

// out (N,OC) += bias (OC), after cuBLAS wrote out = inp @ w^T.
extern "C" __global__ void add_bias(float* out, const float* bias, long long n, int OC) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) out[i] += bias[i % OC];
}
