// Softmax + cross-entropy over the first V of Vp logits, one block per (b, t) row.
#include "common.cuh"
#define CLS_THREADS 1024  // V is ~50k for GPT-2: ~49 logits per thread, two passes

// losses[row] = logsumexp(logits[row, :V]) - logits[row, target]. With write_dlogits the
// row is replaced in place by dloss * (softmax - onehot(target)), and 0 over V..Vp-1.
extern "C" __global__ void fused_classifier(float* logits, float* losses, const int* targets,
                                            float dloss, int write_dlogits, int V, int Vp) {
    __shared__ float sm[CLS_THREADS / WARP], ss[CLS_THREADS / WARP], target_logit;
    long long row = blockIdx.x;
    float* x = logits + row * Vp;
    float m = -INFINITY, s = 0.f;
    for (int i = threadIdx.x; i < V; i += blockDim.x) merge_max_sum(m, s, x[i], 1.f);
    warp_max_sum(m, s);
    int w = threadIdx.x / WARP, lane = threadIdx.x % WARP, nw = blockDim.x / WARP;
    if (lane == 0) { sm[w] = m; ss[w] = s; }
    if (threadIdx.x == 0) target_logit = x[targets[row]];
    __syncthreads();
    m = -INFINITY; s = 0.f;
    for (int k = 0; k < nw; k++) merge_max_sum(m, s, sm[k], ss[k]);  // same order everywhere
    if (threadIdx.x == 0) losses[row] = logf(s) + m - target_logit;
    if (!write_dlogits) return;
    int tgt = targets[row];
    for (int i = threadIdx.x; i < Vp; i += blockDim.x)
        x[i] = i < V ? (expf(x[i] - m) / s - (i == tgt ? 1.f : 0.f)) * dloss : 0.f;
}

// acc[0] += sum of n losses, in double, one block of 1024 threads (deterministic).
extern "C" __global__ void loss_accumulate(double* acc, const float* losses, int n) {
    __shared__ double part[1024 / WARP];
    double s = 0.0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += losses[i];
    s = warp_sum_d(s);
    if (threadIdx.x % WARP == 0) part[threadIdx.x / WARP] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        double t = 0.0;
        for (int k = 0; k < blockDim.x / WARP; k++) t += part[k];
        acc[0] += t;
    }
}
