// Column sums (layernorm's weight and bias gradients; a matmul's bias gradient where its
// GEMM's epilogue could not make it): out (OC) += sum over N rows of in (N,OC);
// and the gradient norm's sum of squares. Deterministic partial sums finished in a fixed
// order instead of float atomics, so a step's gradients (and its clipping) are reproducible.
#include "common.cuh"

// One launch. Grid (column tiles, R row chunks), block (COL_TILE, ROW_LANES): a thread
// takes VEC(T) adjacent columns (16-byte loads where aligned, else one at a time) and
// every ROW_LANES-th row of its block's chunk; the lanes are summed in lane
// order into partial[chunk, c]. The block of a tile that finishes last (counter
// done[tile], left at 0 for the next launch) sums the tile's R partials in chunk order and
// adds them to out, rounding once: columns [0, split) go to out_a, the rest to out_b (two
// gradients from one pass). in is floatX (a gradient) or float (layernorm's partials).

// 16 bytes at p (16-byte aligned): from L2 when L2 (the finish reads partials other blocks
// wrote: never a stale L1 line).
template <bool L2, class T>
__device__ __forceinline__ Vec<T> load16(const T* p) {
    Vec<T> v;
    if constexpr (L2) *reinterpret_cast<float4*>(&v) = __ldcg(reinterpret_cast<const float4*>(p));
    else v = *reinterpret_cast<const Vec<T>*>(p);
    return v;
}

// A row's P columns (P / VEC(T) aligned 16-byte runs) into v, and v added into s.
template <int P, bool L2, class T>
__device__ __forceinline__ void load_row(Vec<T> (&v)[P / VEC(T)], const T* p) {
    for (int w = 0; w < P / VEC(T); w++) v[w] = load16<L2>(p + w * VEC(T));
}

template <int P, class T>
__device__ __forceinline__ void add_row(float* s, const Vec<T> (&v)[P / VEC(T)]) {
    for (int w = 0; w < P / VEC(T); w++)
        for (int k = 0; k < VEC(T); k++) s[w * VEC(T) + k] += load(v[w].v[k]);
}

// Sums rows r0, r0 + ROW_LANES, ... < r1 of columns [c, c + P) of in (rows ld apart) into
// s, then the block's lanes in lane order into y = 0's s. Whether every row's P columns are
// whole aligned 16-byte runs (P a multiple of VEC(T)) is decided once, before the loop: then
// four rows' loads are in flight at a time, else one element at a time. Each column adds
// the rows in row order either way (the same bits). L2: loads from L2 (the finish).
template <int P, bool L2, class T>
__device__ void lane_sums(float* s, const T* in, long long ld, int OC, int c, int r0, int r1,
                          float (*lanes)[COL_TILE * 8]) {
    static_assert(P % VEC(T) == 0, "a thread's columns are whole 16-byte runs");
    for (int k = 0; k < P; k++) s[k] = 0.f;
    int r = r0 + threadIdx.y;
    if (c + P <= OC && aligned16(in + c) && ld % VEC(T) == 0) {
        const T* col = in + c;
        for (; r + 3 * ROW_LANES < r1; r += 4 * ROW_LANES) {
            Vec<T> a[P / VEC(T)], b[P / VEC(T)], d[P / VEC(T)], e[P / VEC(T)];
            load_row<P, L2>(a, col + r * ld);
            load_row<P, L2>(b, col + (r + ROW_LANES) * ld);
            load_row<P, L2>(d, col + (r + 2 * ROW_LANES) * ld);
            load_row<P, L2>(e, col + (r + 3 * ROW_LANES) * ld);
            add_row<P>(s, a);
            add_row<P>(s, b);
            add_row<P>(s, d);
            add_row<P>(s, e);
        }
        for (; r < r1; r += ROW_LANES) {
            Vec<T> a[P / VEC(T)];
            load_row<P, L2>(a, col + r * ld);
            add_row<P>(s, a);
        }
    } else {
        for (; r < r1; r += ROW_LANES)
            for (int k = 0; k < P && c + k < OC; k++) s[k] += load(__ldcg(in + r * ld + c + k));
    }
    for (int k = 0; k < P; k++) lanes[threadIdx.y][threadIdx.x * P + k] = s[k];
    __syncthreads();
    if (threadIdx.y == 0)
        for (int k = 0; k < P; k++)
            for (int y = 1; y < ROW_LANES; y++) s[k] += lanes[y][threadIdx.x * P + k];
}

template <class T>
__device__ void column_sum(floatX* out_a, floatX* out_b, int split, const T* in, int N, int OC,
                           int rows_per_chunk, float* partial, int* done) {
    constexpr int P = VEC(T);
    __shared__ float lanes[ROW_LANES][COL_TILE * 8];
    __shared__ int last;
    int c = (blockIdx.x * COL_TILE + threadIdx.x) * P, R = gridDim.y;
    int r0 = blockIdx.y * rows_per_chunk, r1 = min(N, r0 + rows_per_chunk);
    float s[P];
    lane_sums<P, false>(s, in, OC, OC, c, r0, r1, lanes);
    if (threadIdx.y == 0)
        for (int k = 0; k < P && c + k < OC; k++) partial[(long long)blockIdx.y * OC + c + k] = s[k];
    __threadfence();  // (the partials visible to every block before the count says so)
    __syncthreads();
    if (threadIdx.x == 0 && threadIdx.y == 0) last = atomicAdd(&done[blockIdx.x], 1) == R - 1;
    __syncthreads();
    if (!last) return;
    lane_sums<P, true>(s, (const float*)partial, OC, OC, c, 0, R, lanes);
    if (threadIdx.y != 0) return;
    for (int k = 0; k < P && c + k < OC; k++) {
        floatX* o = c + k < split ? &out_a[c + k] : &out_b[c + k - split];
        store(o, load(*o) + s[k]);
    }
    if (threadIdx.x == 0) done[blockIdx.x] = 0;
}

extern "C" __global__ void column_sum_x(floatX* out_a, floatX* out_b, int split,
                                        const floatX* in, int N, int OC, int rows_per_chunk,
                                        float* partial, int* done) {
    column_sum(out_a, out_b, split, in, N, OC, rows_per_chunk, partial, done);
}

extern "C" __global__ void column_sum_f32(floatX* out_a, floatX* out_b, int split,
                                          const float* in, int N, int OC, int rows_per_chunk,
                                          float* partial, int* done) {
    column_sum(out_a, out_b, split, in, N, OC, rows_per_chunk, partial, done);
}

// A whole group's squares from one aligned 16-byte load (the norm's, below).
__device__ __forceinline__ float pack_squares(const floatX* p) {
    Pack v = *reinterpret_cast<const Pack*>(p);
    float s = 0.f;
    for (int k = 0; k < PACK; k++) s += __fmul_rn(load(v.v[k]), load(v.v[k]));
    return s;
}

// The gradient norm's sum of squares: acc[0] += sum of x[i]^2, deterministically. The
// squares are summed in float only within a group, the PACK elements of one 16-byte run
// of the stage's flat buffer (x[0] is its element `offset`): every way of splitting the
// buffer over ranks (ZeRO-1's slices, the norm's ranges) keeps the groups whole except
// where a cut falls, so the groups' float sums are the same numbers whatever the split.
// Across groups the sums are float64 (a thread's, then the block's, then the blocks'), whose
// order changes the float norm only on a tie within 1e-16 of it. Stage 1. Launch: R blocks
// of EW_THREADS; block b writes the sum of its grid-strided groups to partial[b].
// (__fmul_rn: a square rounded before it is added, never fused into an FMA, as NumPy's.)
__device__ __forceinline__ float group_squares(const floatX* x, long long n, long long i) {
    if (i >= 0 && i + PACK <= n && aligned16(x + i)) return pack_squares(x + i);
    float s = 0.f;
    for (long long j = max(i, 0LL); j < i + PACK && j < n; j++) s += __fmul_rn(load(x[j]), load(x[j]));
    return s;
}

// The block's threads' values summed in thread order, in double; thread 0 holds the sum.
__device__ __forceinline__ double block_sum_d(double s) {
    __shared__ double part[EW_THREADS / WARP];
    s = warp_sum_d(s);
    if (threadIdx.x % WARP == 0) part[threadIdx.x / WARP] = s;
    __syncthreads();
    s = threadIdx.x < EW_THREADS / WARP ? part[threadIdx.x] : 0.0;
    if (threadIdx.x < WARP) s = warp_sum_d(s);
    return s;
}

// V: the groups are 16-byte aligned (x's flat buffer is; the host checks once per launch
// and launches the _v entry): four whole groups at a time are straight-line loads, all in
// flight before their sums, and only the partial groups at the two ends take the checked
// path. Either way each thread adds its groups in the same order: the same bits.
template <bool V>
__device__ void sum_squares_groups(double* partial, const floatX* x, long long n,
                                   long long offset) {
    long long lead = offset % PACK, groups = (lead + n + PACK - 1) / PACK;
    long long whole0 = lead > 0, whole1 = (lead + n) / PACK;  // the whole groups' range
    long long stride = (long long)gridDim.x * blockDim.x;
    double s = 0.0;
    long long g = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    while (g < groups) {
        if (V && g >= whole0 && g + 3 * stride < whole1) {
            const floatX* p = x + g * PACK - lead;
            float a = pack_squares(p), b = pack_squares(p + stride * PACK);
            float c = pack_squares(p + 2 * stride * PACK), d = pack_squares(p + 3 * stride * PACK);
            s += a; s += b; s += c; s += d;
            g += 4 * stride;
        } else {
            s += group_squares(x, n, g * PACK - lead);
            g += stride;
        }
    }
    s = block_sum_d(s);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

extern "C" __global__ void sum_squares_partial(double* partial, const floatX* x, long long n,
                                               long long offset) {
    sum_squares_groups<false>(partial, x, n, offset);
}

extern "C" __global__ void sum_squares_partial_v(double* partial, const floatX* x, long long n,
                                                 long long offset) {
    sum_squares_groups<true>(partial, x, n, offset);
}

// Stage 2. Launch: one block of EW_THREADS; sums the R partials (thread t takes t, t + 256,
// ..., then the block in thread order) and adds them to acc[0].
extern "C" __global__ void sum_squares_finish(double* acc, const double* partial, int R) {
    double t = 0.0;
    for (int r = threadIdx.x; r < R; r += blockDim.x) t += partial[r];
    t = block_sum_d(t);
    if (threadIdx.x == 0) acc[0] += t;
}
