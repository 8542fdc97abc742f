// Elementwise ops. Launch: EW_THREADS per block, PACK elements per thread (common.cuh).
#include "common.cuh"

__device__ __forceinline__ float gelu(float x) {
    return 0.5f * x * (1.f + tanhf(GELU_SCALE * (x + 0.044715f * x * x * x)));
}

__device__ __forceinline__ float gelu_grad(float x, float dout) {
    float th = tanhf(GELU_SCALE * (x + 0.044715f * x * x * x));
    float local = 0.5f * (1.f + th) +
                  0.5f * x * (1.f - th * th) * GELU_SCALE * (1.f + 3.f * 0.044715f * x * x);
    return local * dout;
}

// out[i] = f(a[i], b[i]) for this thread's PACK elements: 128-bit loads and store where it can
template <class F>
__device__ __forceinline__ void map2(floatX* out, const floatX* a, const floatX* b, long long n,
                                     F f) {
    long long i = (blockIdx.x * (long long)blockDim.x + threadIdx.x) * PACK;
    if (i >= n) return;
    if (i + PACK <= n && aligned16(out + i) && aligned16(a + i) && aligned16(b + i)) {
        Pack x = *reinterpret_cast<const Pack*>(a + i), y = *reinterpret_cast<const Pack*>(b + i);
        Pack o;
        for (int k = 0; k < PACK; k++) store(&o.v[k], f(load(x.v[k]), load(y.v[k])));
        *reinterpret_cast<Pack*>(out + i) = o;
        return;
    }
    for (long long j = i; j < i + PACK && j < n; j++) store(&out[j], f(load(a[j]), load(b[j])));
}

extern "C" __global__ void gelu_forward(floatX* out, const floatX* inp, long long n) {
    map2(out, inp, inp, n, [](float x, float) { return gelu(x); });
}

extern "C" __global__ void gelu_backward(floatX* dinp, const floatX* inp, const floatX* dout,
                                         long long n) {
    map2(dinp, inp, dout, n, [](float x, float g) { return gelu_grad(x, g); });
}

extern "C" __global__ void residual_forward(floatX* out, const floatX* a, const floatX* b,
                                            long long n) {
    map2(out, a, b, n, [](float x, float y) { return x + y; });
}

// The bias of a matmul whose GEMM could not add it in its epilogue (cuda/cublaslt.py says
// when): out (N,OC) += bias (OC), rounded once. PACK elements per thread, 16-byte accesses
// where the pack is whole, in one row and aligned.
extern "C" __global__ void bias_forward(floatX* out, const floatX* bias, long long n, int OC) {
    long long i = (blockIdx.x * (long long)blockDim.x + threadIdx.x) * PACK;
    if (i >= n) return;
    int c = i % OC;
    if (i + PACK <= n && c + PACK <= OC && aligned16(out + i) && aligned16(bias + c)) {
        float x[PACK], b[PACK];
        load_pack(x, out + i, PACK, true);
        load_pack(b, bias + c, PACK, true);
        for (int k = 0; k < PACK; k++) x[k] += b[k];
        store_pack(out + i, x, PACK, true);
        return;
    }
    for (long long j = i; j < i + PACK && j < n; j++)
        store(&out[j], load(out[j]) + load(bias[j % OC]));
}

// db (n) += g (n): a bias gradient the weight-gradient GEMM's epilogue wrote (it
// overwrites; in the product's type, the only bias type cuBLASLt takes for it), added
// into the gradient buffer as micro-batches add.
extern "C" __global__ void bias_grad_add(floatX* db, const floatX* g, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) store(&db[i], load(db[i]) + load(g[i]));
}
