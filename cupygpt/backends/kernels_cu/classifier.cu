// Softmax + cross-entropy over a vocab-parallel head, one block per (b, t) row: each
// tensor-parallel shard holds Vs columns of the logits (vocab rows [v0, v0 + Vs)), the
// first `valid` of them real tokens, the rest padding.
// Launch: CLS_THREADS per block, one block per row (V is ~50k for GPT-2: a few 16-byte
// packs per thread and pass).
#include "common.cuh"

// The block's (max, sum of exponentials) as every thread's result: each warp's merged
// across its lanes, then the warps' by warp 0 alone (the same butterfly), broadcast.
__device__ void block_max_sum(float& m, float& s) {
    __shared__ float sm[WARP], ss[WARP];
    warp_max_sum(m, s);
    int w = threadIdx.x / WARP, lane = threadIdx.x % WARP, warps = blockDim.x / WARP;
    if (lane == 0) { sm[w] = m; ss[w] = s; }
    __syncthreads();
    if (w == 0) {
        m = lane < warps ? sm[lane] : -INFINITY;
        s = lane < warps ? ss[lane] : 0.f;
        warp_max_sum(m, s);
        if (lane == 0) { sm[0] = m; ss[0] = s; }
    }
    __syncthreads();
    m = sm[0];
    s = ss[0];
}

// One pack of logits (n of them real) into a thread's online (max m, sum s of exp(x - m)):
// the sum rescaled once to the new max, then the pack's exponentials (exp2, log2(e) folded).
__device__ __forceinline__ void add_pack(float& m, float& s, const float* f, int n) {
    float mn = m;
    for (int k = 0; k < n; k++) mn = fmaxf(mn, f[k]);
    if (mn == -INFINITY) return;  // (adds nothing; exp(-inf - -inf) would be NaN)
    float ml = mn * LOG2E;
    s *= exp_from(m, ml);
    for (int k = 0; k < n; k++) s += exp_from(f[k], ml);
    m = mn;
}

// A row's (max m, sum s of exp(x - m)) over its first `valid` logits, as every thread's
// result: PACK at a time, then the block's. V: the row is 16-byte aligned (the host checks
// once per launch: Vs a multiple of PACK, the logits aligned), so its whole packs are
// straight-line 16-byte loads, two in flight, and only the last, short one is checked.
template <bool V>
__device__ void row_max_sum(const floatX* __restrict__ x, int valid, float& m, float& s) {
    float f[PACK], h[PACK];
    m = -INFINITY; s = 0.f;
    int j = threadIdx.x * PACK;
    if (V) {
        for (; j + blockDim.x * PACK + PACK <= valid; j += 2 * blockDim.x * PACK) {
            load_pack(f, x + j, PACK, true);
            load_pack(h, x + j + blockDim.x * PACK, PACK, true);
            add_pack(m, s, f, PACK);
            add_pack(m, s, h, PACK);
        }
    }
    for (; j < valid; j += blockDim.x * PACK) {
        int n = min(PACK, valid - j);
        load_pack(f, x + j, n, n == PACK && (V || aligned16(x + j)));
        add_pack(m, s, f, n);
    }
    block_max_sum(m, s);
}

// The row x (Vs logits, the first `valid` real) replaced in place by
// dloss * (softmax - onehot(tgt)), 0 over the padding; 16-byte stores likewise (V: as above).
__device__ __forceinline__ void dlogits_pack(float* f, int j, float ml, float scale, int tgt,
                                             float dloss, int valid) {
    for (int k = 0; k < PACK; k++)
        f[k] = j + k < valid ? exp_from(f[k], ml) * scale - (j + k == tgt ? dloss : 0.f) : 0.f;
}

template <bool V>
__device__ void dlogits_in_place(floatX* __restrict__ x, float m, float s, int tgt, float dloss,
                                 int valid, int Vs) {
    float f[PACK], h[PACK], ml = m * LOG2E, scale = dloss / s;  // (one division a row)
    int j = threadIdx.x * PACK, step = blockDim.x * PACK;
    if (V) {  // two whole packs loaded before either is computed and stored
        for (; j + step + PACK <= Vs; j += 2 * step) {
            load_pack(f, x + j, PACK, true);
            load_pack(h, x + j + step, PACK, true);
            dlogits_pack(f, j, ml, scale, tgt, dloss, valid);
            dlogits_pack(h, j + step, ml, scale, tgt, dloss, valid);
            store_pack(x + j, f, PACK, true);
            store_pack(x + j + step, h, PACK, true);
        }
    }
    for (; j < Vs; j += step) {
        int n = min(PACK, Vs - j);
        bool vec = n == PACK && (V || aligned16(x + j));
        load_pack(f, x + j, n, vec);
        dlogits_pack(f, j, ml, scale, tgt, dloss, valid);
        store_pack(x + j, f, n, vec);
    }
}

// Vocab-parallel, pass 1: stats[row] = (max, sum of exp(x - max) over the shard's valid
// columns, the target's logit if this shard holds the target else 0).
template <bool V>
__device__ void stats_row(float* stats, const floatX* logits, const int* targets, int v0,
                          int valid, int Vs) {
    long long row = blockIdx.x;
    const floatX* x = logits + row * Vs;
    float m, s;
    row_max_sum<V>(x, valid, m, s);
    if (threadIdx.x != 0) return;
    int r = targets[row] - v0;
    stats[row * 3] = m;
    stats[row * 3 + 1] = s;
    stats[row * 3 + 2] = (r >= 0 && r < valid) ? load(x[r]) : 0.f;
}

extern "C" __global__ void classifier_stats(float* stats, const floatX* logits,
                                            const int* targets, int v0, int valid, int Vs) {
    stats_row<false>(stats, logits, targets, v0, valid, Vs);
}

extern "C" __global__ void classifier_stats_v(float* stats, const floatX* logits,
                                              const int* targets, int v0, int valid, int Vs) {
    stats_row<true>(stats, logits, targets, v0, valid, Vs);
}

// Vocab-parallel, pass 2: losses[row] = log S + M - target logit, from the tp shards' stats
// (tp, N, 3) combined in shard order. With write_dlogits this shard's row becomes its
// dlogits in place.
template <bool V>
__device__ void loss_row(floatX* logits, float* losses, const float* stats, const int* targets,
                         float dloss, int write_dlogits, int v0, int valid, int Vs, int tp,
                         int N) {
    long long row = blockIdx.x;
    float m = -INFINITY, s = 0.f, t = 0.f;
    for (int k = 0; k < tp; k++) {
        const float* st = stats + ((long long)k * N + row) * 3;
        merge_max_sum(m, s, st[0], st[1]);
        t += st[2];
    }
    if (threadIdx.x == 0) losses[row] = logf(s) + m - t;
    if (write_dlogits)
        dlogits_in_place<V>(logits + row * Vs, m, s, targets[row] - v0, dloss, valid, Vs);
}

extern "C" __global__ void classifier(floatX* logits, float* losses, const float* stats,
                                      const int* targets, float dloss, int write_dlogits,
                                      int v0, int valid, int Vs, int tp, int N) {
    loss_row<false>(logits, losses, stats, targets, dloss, write_dlogits, v0, valid, Vs, tp, N);
}

extern "C" __global__ void classifier_v(floatX* logits, float* losses, const float* stats,
                                        const int* targets, float dloss, int write_dlogits,
                                        int v0, int valid, int Vs, int tp, int N) {
    loss_row<true>(logits, losses, stats, targets, dloss, write_dlogits, v0, valid, Vs, tp, N);
}

// Cross-entropy with the whole vocab in one shard (no tensor parallelism): both passes in
// one kernel, so the row is read twice and written once.
template <bool V>
__device__ void cross_entropy_row(floatX* logits, float* losses, const int* targets, float dloss,
                                  int write_dlogits, int valid, int Vs) {
    long long row = blockIdx.x;
    floatX* x = logits + row * Vs;
    float m, s;
    row_max_sum<V>(x, valid, m, s);
    int tgt = targets[row];
    bool held = tgt >= 0 && tgt < valid;
    if (threadIdx.x == 0) losses[row] = logf(s) + m - (held ? load(x[tgt]) : 0.f);
    if (!write_dlogits) return;
    __syncthreads();  // (thread 0 has read the target's logit before it is overwritten)
    dlogits_in_place<V>(x, m, s, tgt, dloss, valid, Vs);
}

extern "C" __global__ void cross_entropy(floatX* logits, float* losses, const int* targets,
                                         float dloss, int write_dlogits, int valid, int Vs) {
    cross_entropy_row<false>(logits, losses, targets, dloss, write_dlogits, valid, Vs);
}

extern "C" __global__ void cross_entropy_v(floatX* logits, float* losses, const int* targets,
                                           float dloss, int write_dlogits, int valid, int Vs) {
    cross_entropy_row<true>(logits, losses, targets, dloss, write_dlogits, valid, Vs);
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
