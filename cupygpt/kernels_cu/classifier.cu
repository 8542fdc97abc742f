// Softmax + cross-entropy over a vocab-parallel head, one block per (b, t) row: each
// tensor-parallel shard holds Vs columns of the logits (vocab rows [v0, v0 + Vs)), the
// first `valid` of them real tokens, the rest padding.
// Launch: CLS_THREADS per block, one block per row (V is ~50k for GPT-2: a few 16-byte
// packs per thread and pass).
#include "common.cuh"

// The block's (max, sum of exponentials) merged in warp order, as every thread's result.
__device__ void block_max_sum(float& m, float& s) {
    __shared__ float sm[CLS_THREADS / WARP], ss[CLS_THREADS / WARP];
    warp_max_sum(m, s);
    int w = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    if (lane == 0) { sm[w] = m; ss[w] = s; }
    __syncthreads();
    m = -INFINITY; s = 0.f;
    for (int k = 0; k < (int)blockDim.x / WARP; k++) merge_max_sum(m, s, sm[k], ss[k]);
}

// A row's (max m, sum s of exp(x - m)) over its first `valid` logits, as every thread's
// result: PACK at a time (one 16-byte load where whole and aligned; each pack's max, then
// its exponentials' sum, merged into the thread's), then the block's in warp order.
__device__ void row_max_sum(const floatX* x, int valid, float& m, float& s) {
    float f[PACK];
    m = -INFINITY; s = 0.f;
    for (int j = threadIdx.x * PACK; j < valid; j += blockDim.x * PACK) {
        int n = min(PACK, valid - j);
        load_pack(f, x + j, n, n == PACK && aligned16(x + j));
        float pm = -INFINITY, ps = 0.f;
        for (int k = 0; k < n; k++) pm = fmaxf(pm, f[k]);
        if (pm == -INFINITY) continue;  // (adds nothing; exp(-inf - -inf) would be NaN)
        for (int k = 0; k < n; k++) ps += expf(f[k] - pm);
        merge_max_sum(m, s, pm, ps);
    }
    block_max_sum(m, s);
}

// The row x (Vs logits, the first `valid` real) replaced in place by
// dloss * (softmax - onehot(tgt)), 0 over the padding; 16-byte stores likewise.
__device__ void dlogits_in_place(floatX* x, float m, float s, int tgt, float dloss, int valid,
                              int Vs) {
    float f[PACK];
    for (int j = threadIdx.x * PACK; j < Vs; j += blockDim.x * PACK) {
        int n = min(PACK, Vs - j);
        bool vec = n == PACK && aligned16(x + j);
        load_pack(f, x + j, n, vec);
        for (int k = 0; k < PACK; k++)
            f[k] = j + k < valid ? (expf(f[k] - m) / s - (j + k == tgt ? 1.f : 0.f)) * dloss : 0.f;
        store_pack(x + j, f, n, vec);
    }
}

// Vocab-parallel, pass 1: stats[row] = (max, sum of exp(x - max) over the shard's valid
// columns, the target's logit if this shard holds the target else 0).
extern "C" __global__ void classifier_stats(float* stats, const floatX* logits,
                                            const int* targets, int v0, int valid, int Vs) {
    long long row = blockIdx.x;
    const floatX* x = logits + row * Vs;
    float m, s;
    row_max_sum(x, valid, m, s);
    if (threadIdx.x != 0) return;
    int r = targets[row] - v0;
    stats[row * 3] = m;
    stats[row * 3 + 1] = s;
    stats[row * 3 + 2] = (r >= 0 && r < valid) ? load(x[r]) : 0.f;
}

// Vocab-parallel, pass 2: losses[row] = log S + M - target logit, from the tp shards' stats
// (tp, N, 3) combined in shard order. With write_dlogits this shard's row becomes its
// dlogits in place.
extern "C" __global__ void classifier(floatX* logits, float* losses, const float* stats,
                                      const int* targets, float dloss, int write_dlogits,
                                      int v0, int valid, int Vs, int tp, int N) {
    long long row = blockIdx.x;
    float m = -INFINITY, s = 0.f, t = 0.f;
    for (int k = 0; k < tp; k++) {
        const float* st = stats + ((long long)k * N + row) * 3;
        merge_max_sum(m, s, st[0], st[1]);
        t += st[2];
    }
    if (threadIdx.x == 0) losses[row] = logf(s) + m - t;
    if (write_dlogits)
        dlogits_in_place(logits + row * Vs, m, s, targets[row] - v0, dloss, valid, Vs);
}

// Cross-entropy with the whole vocab in one shard (no tensor parallelism): both passes in
// one kernel, so the row is read twice and written once.
extern "C" __global__ void cross_entropy(floatX* logits, float* losses, const int* targets,
                                         float dloss, int write_dlogits, int valid, int Vs) {
    long long row = blockIdx.x;
    floatX* x = logits + row * Vs;
    float m, s;
    row_max_sum(x, valid, m, s);
    int tgt = targets[row];
    bool held = tgt >= 0 && tgt < valid;
    if (threadIdx.x == 0) losses[row] = logf(s) + m - (held ? load(x[tgt]) : 0.f);
    if (!write_dlogits) return;
    __syncthreads();  // (thread 0 has read the target's logit before it is overwritten)
    dlogits_in_place(x, m, s, tgt, dloss, valid, Vs);
}

// acc[0] += sum of n losses, in double, one block of CLS_THREADS threads (deterministic).
extern "C" __global__ void loss_accumulate(double* acc, const float* losses, int n) {
    __shared__ double part[CLS_THREADS / WARP];
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
