// Token + position embedding. A thread takes PACK columns of a row (16-byte accesses
// where C is a multiple of PACK and the arrays aligned, else one element at a time).
#include "common.cuh"

// out (B,T,C) = wte[inp[b,t]] + wpe[t]. wte holds vocab rows [v0, v0 + rows) (a
// tensor-parallel shard): a token it does not hold gives 0; add_wpe 0: no positions.
// Launch: EW_THREADS per block over B*T*ceil(C/PACK) threads.
extern "C" __global__ void encoder_forward(floatX* out, const int* inp, const floatX* wte,
                                           const floatX* wpe, int B, int T, int C, int v0,
                                           int rows, int add_wpe) {
    int packs = (C + PACK - 1) / PACK;
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= (long long)B * T * packs) return;
    int c = (int)(i % packs) * PACK, bt = (int)(i / packs), t = bt % T, r = inp[bt] - v0;
    bool vec = C % PACK == 0 && aligned16(out) && aligned16(wte) && aligned16(wpe);
    float x[PACK], p[PACK];
    if (r >= 0 && r < rows) {
        load_pack(x, wte + (long long)r * C + c, C - c, vec);
    } else {
        for (int k = 0; k < PACK; k++) x[k] = 0.f;
    }
    if (add_wpe) {
        load_pack(p, wpe + (long long)t * C + c, C - c, vec);
        for (int k = 0; k < PACK; k++) x[k] += p[k];
    }
    store_pack(out + (long long)bt * C + c, x, C - c, vec);
}

// The token embedding's gradient, deterministically and touching only the rows of the
// tokens present: the n = B*T positions are ordered by (token, position), then
// encoder_backward_wte gives each token present one thread per PACK columns, which adds its
// positions' rows to the token's row in position order (NumPy's np.add.at order, rounded
// once). Nothing depends on the vocabulary's size, and nothing waits on the host.
//
// The order, in O(n log n) without atomics: encoder_sort_blocks sorts each run of SORT_KEYS
// positions by key = token << 32 | position (unique keys) in shared memory (bitonic), and
// encoder_rank finds each position's place among all by a binary search in every sorted run.

#define KEY_PAD 0x7fffffffffffffffLL  // after every real key (a run's unused slots)

// keys[run * SORT_KEYS + k]: run's keys, sorted. Launch: a block of SORT_KEYS / 2 threads
// per run of SORT_KEYS positions.
extern "C" __global__ void encoder_sort_blocks(long long* keys, const int* inp, int n) {
    __shared__ long long s[SORT_KEYS];
    int base = blockIdx.x * SORT_KEYS;
    for (int k = threadIdx.x; k < SORT_KEYS; k += blockDim.x)
        s[k] = base + k < n ? ((long long)inp[base + k] << 32) | (base + k) : KEY_PAD;
    __syncthreads();
    for (int size = 2; size <= SORT_KEYS; size <<= 1) {
        for (int stride = size / 2; stride > 0; stride >>= 1) {
            for (int t = threadIdx.x; t < SORT_KEYS / 2; t += blockDim.x) {
                int i = 2 * t - (t & (stride - 1)), j = i + stride;
                long long a = s[i], b = s[j];
                if ((a > b) == ((i & size) == 0)) {
                    s[i] = b;
                    s[j] = a;
                }
            }
            __syncthreads();
        }
    }
    for (int k = threadIdx.x; k < SORT_KEYS; k += blockDim.x) keys[base + k] = s[k];
}

// How many of a sorted run's SORT_KEYS keys are below key.
__device__ __forceinline__ int keys_below(const long long* run, long long key) {
    int lo = 0, hi = SORT_KEYS;
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (run[mid] < key) lo = mid + 1; else hi = mid;
    }
    return lo;
}

// sorted[k]: the position k-th in (token, position) order; for the first position i of
// each token first[i] = how many positions hold it and start[i] = where they begin in
// sorted (0 for the others): over every run, the keys below i's, below its token's first
// and below the next token's, each run searched in shared memory by the whole block.
// Launch: EW_THREADS per block over n positions.
extern "C" __global__ void encoder_rank(int* sorted, int* first, int* start,
                                        const long long* keys, const int* inp, int n) {
    __shared__ long long run[SORT_KEYS];
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    long long t = i < n ? inp[i] : 0, key = (t << 32) | i;
    int rank = 0, less = 0, upto = 0;
    for (long long r0 = 0; r0 < n; r0 += SORT_KEYS) {
        __syncthreads();  // (the last run read by all)
        for (int k = threadIdx.x; k < SORT_KEYS; k += blockDim.x) run[k] = keys[r0 + k];
        __syncthreads();
        rank += keys_below(run, key);
        less += keys_below(run, t << 32);
        upto += keys_below(run, (t + 1) << 32);
    }
    if (i >= n) return;
    sorted[rank] = i;
    first[i] = rank == less ? upto - less : 0;
    start[i] = less;
}

// dwte[token] += its positions' dout rows, for the tokens this shard holds (rows
// [v0, v0 + rows)). Launch: grid (n, column blocks), WARP threads of PACK columns each;
// a block whose position is not its token's first returns at once.
extern "C" __global__ void encoder_backward_wte(floatX* dwte, const floatX* dout, const int* inp,
                                                const int* sorted, const int* first,
                                                const int* start, int C, int v0, int rows) {
    int i = blockIdx.x, count = first[i], r = inp[i] - v0;
    int c = (blockIdx.y * blockDim.x + threadIdx.x) * PACK;
    if (count == 0 || r < 0 || r >= rows || c >= C) return;
    floatX* o = dwte + (long long)r * C + c;
    bool vec = c + PACK <= C && C % PACK == 0 && aligned16(dwte) && aligned16(dout);
    float s[PACK], f[PACK];
    load_pack(s, o, C - c, vec);
    const int* pos = sorted + start[i];
    for (int k = 0; k < count; k++) {
        load_pack(f, dout + (long long)pos[k] * C + c, C - c, vec);
        for (int q = 0; q < PACK; q++) s[q] += f[q];
    }
    store_pack(o, s, C - c, vec);
}

// dwpe[t] += sum over b of dout[b,t], in b order: deterministic. Launch: EW_THREADS per
// block over T*ceil(C/PACK) threads, each PACK columns of a position.
extern "C" __global__ void encoder_backward_wpe(floatX* dwpe, const floatX* dout, int B, int T,
                                                int C) {
    int packs = (C + PACK - 1) / PACK;
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= T * packs) return;
    int t = i / packs, c = i % packs * PACK;
    bool vec = C % PACK == 0 && aligned16(dwpe) && aligned16(dout);
    float s[PACK] = {}, f[PACK];
    for (int b = 0; b < B; b++) {
        load_pack(f, dout + ((long long)b * T + t) * C + c, C - c, vec);
        for (int k = 0; k < PACK; k++) s[k] += f[k];
    }
    load_pack(f, dwpe + (long long)t * C + c, C - c, vec);
    for (int k = 0; k < PACK; k++) f[k] += s[k];
    store_pack(dwpe + (long long)t * C + c, f, C - c, vec);
}
