// Generation's attention (attention_decode): one new query per head against the KV cache,
// around cuBLAS's batched matmuls (done in Python): qkv (1,n,3,NH,HS) -> q,k,v (NH,n,HS),
// the scores' softmax, then att v. Training's attention is flash_attention.cu.
#include "common.cuh"

// For i indexing (B,NH,T,HS): where that (b, h, t, d) sits in qkv (B,T,3,NH,HS), as q
// (k is +C, v is +2C).
__device__ __forceinline__ long long qkv_offset(long long i, int T, int NH, int HS) {
    int d = i % HS, t = (i / HS) % T, h = (i / ((long long)HS * T)) % NH;
    long long b = i / ((long long)HS * T * NH), C = (long long)NH * HS;
    return b * T * 3 * C + (long long)t * 3 * C + h * HS + d;
}

// q, k, v (NH, n, HS each) from qkv (its GEMM added the bias).
extern "C" __global__ void permute_qkv(floatX* q, floatX* k, floatX* v, const floatX* qkv,
                                       int B, int T, int NH, int HS) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= (long long)B * NH * T * HS) return;
    long long src = qkv_offset(i, T, NH, HS), C = (long long)NH * HS;
    q[i] = qkv[src];
    k[i] = qkv[src + C];
    v[i] = qkv[src + 2 * C];
}

// Generation's one new query per head (the KV cache holds every earlier key): att[row, j] =
// softmax_j(scores[row, j]) over all n columns, no mask; rows = NH. scores are the GEMM's
// float output; att feeds the next GEMM, so it is stored (floatX).
extern "C" __global__ void softmax_decode(floatX* att, const float* scores, int rows, int n) {
    int row = blockIdx.x * ROW_WARPS + threadIdx.x / WARP, lane = threadIdx.x % WARP;
    if (row >= rows) return;
    const float* x = scores + (long long)row * n;
    float m = -INFINITY, s = 0.f;
    for (int j = lane; j < n; j += WARP) merge_max_sum(m, s, x[j], 1.f);
    warp_max_sum(m, s);
    floatX* o = att + (long long)row * n;
    for (int j = lane; j < n; j += WARP) store(&o[j], expf(x[j] - m) / s);
}

