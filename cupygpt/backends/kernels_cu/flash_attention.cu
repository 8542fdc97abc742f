// Causal self-attention for training, FlashAttention-2's way: no (T, T) tensor anywhere.
// q, k, v are read straight from qkv (B, T, 3, NH, HS), already biased (qkv's GEMM adds the
// bias in its epilogue), y written straight as (B, T, NH, HS) and dq, dk, dv straight
// into dqkv: no permutes. Forward keeps each query's log-sum-exp
// (lse, (B, NH, T) float); backward makes the probabilities again from it, tile by tile,
// with D = rowsum(dy * y) in place of the sum over keys.
//
// A block owns FR = 16 * FLASH_WARPS rows of one (b, h) (queries; keys in dkdv), a warp 16 of
// them (grid: x the (b, h), y the row tile, longest first, so every head's longest tiles
// start first), and walks tiles of FC = cols() columns (keys; queries in dkdv) through shared
// memory, skipping the tiles the causal mask hides from all its rows. The walked tiles are
// copied with cp.async into stages() buffers each: with two, tile j + 1 is on its way while
// tile j computes, one barrier per tile. The two products per tile run on one warp's 16 rows
// with fp32 accumulators in mma.sync's layout (acc[j][e]: lane 4g + q holds row g (e 0, 1)
// and g + 8 (e 2, 3), column 8j + 2q + e % 2):
//   bf16: tensor cores, m16n8k16 (bf16 in, fp32 sums; the probabilities and their
//         gradients rounded to bf16 on the way in, as the NumPy reference stores them); the
//         warp's own rows (q; dy; k and v up to 64 dimensions) read once into registers as
//         ldmatrix fragments, reused by every tile;
//   fp32 with tf32: tensor cores, m16n8k8 (inputs rounded to TF32, as cuBLAS's TF32 mode);
//   fp32 without: exact FMA dot products (verify's arithmetic).
// The causal mask is applied only on the tiles that cross the diagonal (or T), chosen once
// per tile and warp: the other tiles' softmax is straight-line code.
// Head sizes up to 128, multiples of 8: each kernel is built for HSP in FLASH_HEAD_SIZES,
// the smallest one >= HS taken, dimensions HS..HSP zero in shared memory.
// Backward is two kernels, so every sum has one owner and a fixed order (deterministic, no
// atomics): flash_dq (a block per query tile; also writes D) then flash_dkdv (a block per key
// tile, over the query tiles after it).
#include "common.cuh"

#if !defined(FLASH_WARPS) || !defined(FLASH_COLS) || !defined(FLASH_FP32_DOUBLED)
#error "flash geometry not defined: compile with cupygpt.backends.cuda.kernels.options()"
#endif
constexpr int FR = 16 * FLASH_WARPS, THREADS = FLASH_WARPS * WARP;
static_assert(FR % FLASH_COLS == 0 && FLASH_COLS % 32 == 0, "a block's rows are whole tiles");
constexpr int SKEW = PACK;  // shared rows padded by 16 bytes: fewer bank conflicts
enum Math { FMA, TF32, BF16MMA };

// Where accumulator element e of 8-column tile j sits in a warp's 16 x N block (mma.sync's
// layout above): this lane's row, and its column.
__device__ __forceinline__ int acc_row(int e) { return threadIdx.x % WARP / 4 + 8 * (e / 2); }
__device__ __forceinline__ int acc_col(int j, int e) {
    return 8 * j + 2 * (threadIdx.x % 4) + e % 2;
}

// Columns per walked tile and buffers per walked tile, by head size (kernels.py's flash_cols
// and flash_stages, which size the launch's shared memory): 64-wide tiles where the
// registers hold them (bf16 up to 64 dimensions), two buffers where two blocks per SM fit
// and the device's per-block shared memory holds them (fp32 up to FLASH_FP32_DOUBLED).
template <int HSP>
__device__ constexpr int cols() {
    return sizeof(floatX) == 2 && HSP <= 64 ? FLASH_COLS : FLASH_COLS / 2;
}
template <int HSP>
__device__ constexpr int stages() {
    return sizeof(floatX) == 4 && HSP > FLASH_FP32_DOUBLED ? 1 : 2;
}

__device__ __forceinline__ unsigned bf16_pair(float lo, float hi) {  // rounded, lo low
    return (unsigned)__bfloat16_as_ushort(__float2bfloat16_rn(lo)) |
           ((unsigned)__bfloat16_as_ushort(__float2bfloat16_rn(hi)) << 16);
}

// A warp's 16 rows of K columns (ld apart in shared memory) as tile_nt's A operand. HOLD
// (bf16): their ldmatrix fragments read once into registers, for every tile walked; else
// each product reads the rows from shared memory.
template <int K, bool H, class X>
struct WarpRows {
    static constexpr bool HOLD = H;
    const X* rows;
    int ld;
    unsigned f[HOLD ? K / 16 : 1][4];
    __device__ WarpRows(const X* r, int ld_) : rows(r), ld(ld_) {
        if constexpr (HOLD) {
            #pragma unroll
            for (int k0 = 0; k0 < K; k0 += 16) fragment(f[k0 / 16], k0);
        }
    }
    // A's m16n8k16 fragment for columns k0..k0+15: its 8x8 quarters (rows +8 for a1,
    // columns +8 for a2)
    __device__ __forceinline__ void fragment(unsigned (&x)[4], int k0) const {
        int l = threadIdx.x % WARP, m = l / 8, r = l % 8;
        ldmatrix_x4(x, rows + (r + 8 * (m % 2)) * ld + k0 + 8 * (m / 2));
    }
};

// acc (16 x N) = A (16 x K) B^T, B (N x K): both row-major in shared memory, ld apart.
template <int M, int K, int N, class Rows, class X>
__device__ __forceinline__ void tile_nt(float (&acc)[N / 8][4], const Rows& A, const X* B,
                                        int ld) {
    int g = threadIdx.x % WARP / 4, q = threadIdx.x % 4;
    #pragma unroll
    for (int j = 0; j < N / 8; j++)
        #pragma unroll
        for (int e = 0; e < 4; e++) acc[j][e] = 0.f;
    if constexpr (M == FMA) {
        #pragma unroll
        for (int j = 0; j < N / 8; j++)
            #pragma unroll
            for (int e = 0; e < 4; e++) {
                const X *a = A.rows + acc_row(e) * ld, *b = B + acc_col(j, e) * ld;
                float s = 0.f;
#pragma unroll 8
                for (int k = 0; k < K; k++) s = fmaf(load(a[k]), load(b[k]), s);
                acc[j][e] = s;
            }
    } else if constexpr (M == TF32) {
        #pragma unroll
        for (int k0 = 0; k0 < K; k0 += 8) {
            const X* a = A.rows + g * ld + k0 + q;
            unsigned x[4] = {to_tf32(a[0]), to_tf32(a[8 * ld]), to_tf32(a[4]),
                             to_tf32(a[8 * ld + 4])};
            #pragma unroll
            for (int j = 0; j < N / 8; j++) {
                const X* b = B + (8 * j + g) * ld + k0 + q;
                unsigned y[2] = {to_tf32(b[0]), to_tf32(b[4])};
                mma_tf32_1688(acc[j], x, y);
            }
        }
    } else {
        // B's fragments for tiles j and j + 1 are rows 8j.. and 8j + 8.., columns k0 and k0 + 8
        int l = threadIdx.x % WARP, m = l / 8, r = l % 8;
        #pragma unroll
        for (int k0 = 0; k0 < K; k0 += 16) {
            unsigned read[4];
            const unsigned* x = read;
            if constexpr (Rows::HOLD) x = A.f[k0 / 16];
            else A.fragment(read, k0);
            #pragma unroll
            for (int j = 0; j < N / 8; j += 2) {
                unsigned y[4];
                ldmatrix_x4(y, B + (8 * (j + m / 2) + r) * ld + k0 + 8 * (m % 2));
                mma_bf16_16816(acc[j], x, y);
                mma_bf16_16816(acc[j + 1], x, y + 2);
            }
        }
    }
}

// acc (16 x N) += a (16 x K, in registers, the accumulators' layout) B, B (K x N) row-major
// in shared memory, ld apart. pw: the warp's 16 rows of K + 4 floats (FMA only: each lane
// needs whole rows of a, which other lanes hold).
template <int M, int K, int N, class X>
__device__ __forceinline__ void tile_nn(float (&acc)[N / 8][4], const float (&a)[K / 8][4],
                                        const X* B, int ld, float* pw) {
    int g = threadIdx.x % WARP / 4, q = threadIdx.x % 4;
    if constexpr (M == FMA) {
        constexpr int LP = K + 4;
        #pragma unroll
        for (int t = 0; t < K / 8; t++)
            #pragma unroll
            for (int e = 0; e < 4; e++)
                pw[acc_row(e) * LP + acc_col(t, e)] = a[t][e];
        __syncwarp();
        #pragma unroll
        for (int j = 0; j < N / 8; j++)
            #pragma unroll
            for (int e = 0; e < 4; e++) {
                const float* x = pw + acc_row(e) * LP;
                const X* b = B + acc_col(j, e);
                float s = acc[j][e];
#pragma unroll 8
                for (int k = 0; k < K; k++) s = fmaf(x[k], load(b[k * ld]), s);
                acc[j][e] = s;
            }
        __syncwarp();  // pw is written again by the next call
    } else if constexpr (M == TF32) {
        // k slots q and q + 4 of a k8 step are this lane's columns 2q and 2q + 1 (any
        // order of k gives the same sum, as long as A and B agree on it)
        #pragma unroll
        for (int t = 0; t < K / 8; t++) {
            unsigned x[4] = {to_tf32(a[t][0]), to_tf32(a[t][2]), to_tf32(a[t][1]),
                             to_tf32(a[t][3])};
            #pragma unroll
            for (int j = 0; j < N / 8; j++) {
                const X* b = B + (8 * t + 2 * q) * ld + 8 * j + g;
                unsigned y[2] = {to_tf32(b[0]), to_tf32(b[ld])};
                mma_tf32_1688(acc[j], x, y);
            }
        }
    } else {
        // the accumulators of two adjacent 8-column tiles are exactly an m16n8k16 A fragment;
        // B's fragments for tiles j and j + 1 are the transposed 8x8 blocks at rows 16t and
        // 16t + 8, columns 8j and 8j + 8 (ldmatrix .trans: a pair is two rows' elements)
        int l = threadIdx.x % WARP, m = l / 8, r = l % 8;
        #pragma unroll
        for (int t = 0; t < K / 16; t++) {
            unsigned x[4] = {bf16_pair(a[2 * t][0], a[2 * t][1]),
                             bf16_pair(a[2 * t][2], a[2 * t][3]),
                             bf16_pair(a[2 * t + 1][0], a[2 * t + 1][1]),
                             bf16_pair(a[2 * t + 1][2], a[2 * t + 1][3])};
            #pragma unroll
            for (int j = 0; j < N / 8; j += 2) {
                unsigned y[4];
                ldmatrix_x4_trans(y, B + (16 * t + 8 * (m % 2) + r) * ld + 8 * (j + m / 2));
                mma_bf16_16816(acc[j], x, y);
                mma_bf16_16816(acc[j + 1], x, y + 2);
            }
        }
    }
}

// The quad of lanes holding one row (4g .. 4g + 3) combines its values.
__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, 1));
    return fmaxf(v, __shfl_xor_sync(FULL_MASK, v, 2));
}

__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(FULL_MASK, v, 1);
    return v + __shfl_xor_sync(FULL_MASK, v, 2);
}

// One pack (16 bytes) of a tile: cp.async when WIDE (zero-filled unless in; src then
// points anywhere valid), else element by element, synchronously.
template <bool WIDE>
__device__ __forceinline__ void copy_pack(floatX* d, const floatX* s, bool in, const floatX* any) {
    if constexpr (WIDE) {
        cp_async16(d, in ? s : any, in ? 16 : 0);
    } else {
        for (int e = 0; e < PACK; e++) d[e] = in ? s[e] : floatX(0.f);
    }
}

// dst (ROWS x HSP, ld HSP + SKEW) = rows r0.. of src (stride apart), columns 0..HS-1;
// zeros past T and HS. WIDE (src 16-byte aligned; HS and C are multiples of 8, so then
// every row is): cp.async, 16 bytes a copy, issued back to back and not waited for here (a
// copy out of range reads nothing and zero-fills); else element by element, synchronously
// (misaligned views: the same bytes). Where the block's threads are whole rows of packs,
// each thread keeps its column and steps down the rows (a few instructions a copy, every
// copy unrolled); else (96 dimensions) a thread walks the packs by their index.
template <int HSP, int ROWS, bool WIDE>
__device__ __forceinline__ void copy_rows(floatX* dst, const floatX* src, long long stride,
                                          int r0, int T, int HS) {
    constexpr int LD = HSP + SKEW, PER = HSP / PACK;
    if constexpr (THREADS % PER == 0) {
        constexpr int RS = THREADS / PER;  // the rows one pass of the block covers
        int r = threadIdx.x / PER, c = threadIdx.x % PER * PACK;
        const floatX* s = src + (long long)(r0 + r) * stride + c;
        #pragma unroll
        for (int k = 0; k < (ROWS + RS - 1) / RS; k++, r += RS, s += RS * stride) {
            if (ROWS % RS && r >= ROWS) break;
            copy_pack<WIDE>(dst + r * LD + c, s, r0 + r < T && c < HS, src);
        }
    } else {
        #pragma unroll 1
        for (int i = threadIdx.x; i < ROWS * PER; i += THREADS) {
            int r = i / PER, c = i % PER * PACK;
            copy_pack<WIDE>(dst + r * LD + c, src + (long long)(r0 + r) * stride + c,
                            r0 + r < T && c < HS, src);
        }
    }
}

// copy_rows with its alignment decided by the caller once per launch (wide).
template <int HSP, int ROWS>
__device__ __forceinline__ void load_rows(floatX* dst, const floatX* src, long long stride,
                                          int r0, int T, int HS, bool wide) {
    if (wide) copy_rows<HSP, ROWS, true>(dst, src, stride, r0, T, HS);
    else copy_rows<HSP, ROWS, false>(dst, src, stride, r0, T, HS);
}

// dst[i] = src[t0 + i] below T, else 0, for i < N: cp.async of 4 bytes by each of the
// first N threads (a row of lse or D starts anywhere: T is any length).
template <int N>
__device__ __forceinline__ void load_floats(float* dst, const float* src, int t0, int T) {
    static_assert(N <= THREADS, "a float per thread");
    int i = threadIdx.x;
    bool in = t0 + i < T;
    if (i < N) cp_async4(dst + i, in ? src + t0 + i : src, in ? 4 : 0);
}

// rows r0.. of dst (stride apart), columns 0..HS-1, below T = src (rows x HSP in shared
// memory), 16 bytes at a time where aligned.
template <int HSP>
__device__ void store_rows(floatX* dst, long long stride, const floatX* src, int r0, int rows,
                           int T, int HS) {
    constexpr int LD = HSP + SKEW, PER = HSP / PACK;
    bool wide = aligned16(dst);
    for (int i = threadIdx.x; i < rows * PER; i += blockDim.x) {
        int r = i / PER, c = i % PER * PACK;
        if (r0 + r >= T || c >= HS) continue;
        const Pack* s = reinterpret_cast<const Pack*>(src + r * LD + c);
        floatX* d = dst + (r0 + r) * stride + c;
        if (wide) {
            *reinterpret_cast<Pack*>(d) = *s;
        } else {
            for (int e = 0; e < PACK; e++) d[e] = s->v[e];
        }
    }
}

// A warp's 16 x HSP accumulators, rounded, into its rows of a shared tile.
template <int HSP>
__device__ void stage(floatX* tile, const float (&acc)[HSP / 8][4]) {
    constexpr int LD = HSP + SKEW;
    int w = threadIdx.x / WARP;
    #pragma unroll
    for (int j = 0; j < HSP / 8; j++)
        #pragma unroll
        for (int e = 0; e < 4; e++)
            store(&tile[(16 * w + acc_row(e)) * LD + acc_col(j, e)], acc[j][e]);
}

// Shared memory: the block's own rows (own tiles of FR rows), the walked tiles (2 of FC
// rows, stages() buffers each, and walked_floats more floats per buffer), and the FMA path's
// per-warp operand rows; flash_smem_bytes in kernels.py computes the same, and each kernel
// checks it was given that much, and FLASH_WARPS warps.
template <int HSP, int M>
__device__ __forceinline__ void check_launch(int own, int walked_floats) {
    constexpr int FC = cols<HSP>(), S = stages<HSP>();
    unsigned need = (own * FR + 2 * S * FC) * (HSP + SKEW) * sizeof(floatX) +
                    4 * (S * walked_floats + (M == FMA ? FLASH_WARPS * 16 * (FC + 4) : 0));
    if (dynamic_smem_bytes() < need || blockDim.x != THREADS) __trap();
}

// One key tile of the forward for a warp's 16 queries: the scores s (in log2 units) into
// probabilities, the running max m and sum l, the output o rescaled. MASK: the tile crosses
// the diagonal (keys after a query are -inf).
template <bool MASK, int FC, int HSP>
__device__ __forceinline__ void online_softmax(float (&s)[FC / 8][4], float (&m)[2],
                                               float (&l)[2], float (&o)[HSP / 8][4], int k0,
                                               const int (&row)[2], float sl) {
    float mx[2] = {m[0], m[1]}, sum[2] = {0.f, 0.f}, alpha[2];
    #pragma unroll
    for (int j = 0; j < FC / 8; j++)
        #pragma unroll
        for (int e = 0; e < 4; e++) {
            s[j][e] *= sl;
            if (MASK && k0 + acc_col(j, e) > row[e / 2]) s[j][e] = -INFINITY;
            mx[e / 2] = fmaxf(mx[e / 2], s[j][e]);
        }
    #pragma unroll
    for (int i = 0; i < 2; i++) {  // key 0 is in every row's first tile: mx is finite
        mx[i] = quad_max(mx[i]);
        alpha[i] = exp2_ftz(m[i] - mx[i]);
        m[i] = mx[i];
    }
    #pragma unroll
    for (int j = 0; j < FC / 8; j++)
        #pragma unroll
        for (int e = 0; e < 4; e++) {
            s[j][e] = exp2_ftz(s[j][e] - m[e / 2]);
            sum[e / 2] += s[j][e];
        }
    #pragma unroll
    for (int i = 0; i < 2; i++) l[i] = l[i] * alpha[i] + quad_sum(sum[i]);
    #pragma unroll
    for (int j = 0; j < HSP / 8; j++)
        #pragma unroll
        for (int e = 0; e < 4; e++) o[j][e] *= alpha[e / 2];
}

// Before tile j of a walk: its copies are in, and every warp is past tile j - 1, whose
// buffer is free (one barrier a tile).
__device__ __forceinline__ void tile_arrived(int j) {
    if (j > 0) {
        cp_async_wait<0>();
        __syncthreads();
    }
}

// After tile j of a walk with one buffer (S = 1): refilled once every warp is done with it.
// (With two, tile j + 1's copies were issued before tile j computed.)
template <int S, class Walk>
__device__ __forceinline__ void refill_single(int j, int n, Walk& walk) {
    if (S == 1 && j + 1 < n) {
        __syncthreads();
        walk(j + 1);
    }
}

// A forward or dq block's query tile: rows r0.. of head h of batch row b (the longest
// rows first), their q issued into Qs as it is made (cp.async, committed with tile 0), and
// the key tiles it walks: tile j's K and V into buffer j % S, one cp.async group. w and g:
// this thread's warp and its row group in the warp's 16 rows.
template <int HSP>
struct QueryTile {
    static constexpr int LD = HSP + SKEW, FC = cols<HSP>(), S = stages<HSP>();
    int w, g, r0, b, h, n;
    long long C;
    const floatX* base;
    bool wide;
    __device__ QueryTile(floatX* Qs, const floatX* qkv, int T, int NH, int HS)
        : w(threadIdx.x / WARP), g(threadIdx.x % WARP / 4),
          r0(((T + FR - 1) / FR - 1 - blockIdx.y) * FR), b(blockIdx.x / NH),
          h(blockIdx.x % NH), n((min(T, r0 + FR) + FC - 1) / FC), C((long long)NH * HS),
          base(qkv + (long long)b * T * 3 * C + h * HS), wide(aligned16(qkv)) {
        load_rows<HSP, FR>(Qs, base, 3 * C, r0, T, HS, wide);
    }
    __device__ void walk(floatX* Ks, floatX* Vs, int j, int T, int HS) const {
        load_rows<HSP, FC>(Ks + j % S * FC * LD, base + C, 3 * C, j * FC, T, HS, wide);
        load_rows<HSP, FC>(Vs + j % S * FC * LD, base + 2 * C, 3 * C, j * FC, T, HS, wide);
        cp_async_commit();
    }
};

template <int HSP, int M>
__device__ void flash_forward(floatX* out, float* lse, const floatX* qkv,
                              float scale, int T, int NH, int HS) {
    constexpr int LD = HSP + SKEW, FC = cols<HSP>(), S = stages<HSP>();
    DYNAMIC_SHARED(smem);
    check_launch<HSP, M>(1, 0);
    floatX *Qs = reinterpret_cast<floatX*>(smem), *Ks = Qs + FR * LD, *Vs = Ks + S * FC * LD;
    float* pw = reinterpret_cast<float*>(Vs + S * FC * LD) + threadIdx.x / WARP * 16 * (FC + 4);
    const QueryTile<HSP> t(Qs, qkv, T, NH, HS);
    const int w = t.w, g = t.g, r0 = t.r0, b = t.b, h = t.h, n = t.n;
    const long long C = t.C;
    auto walk = [&](int j) { t.walk(Ks, Vs, j, T, HS); };
    walk(0);
    cp_async_wait<0>();
    __syncthreads();
    WarpRows<HSP, M == BF16MMA, floatX> Q(Qs + 16 * w * LD, LD);
    int row[2] = {r0 + 16 * w + g, r0 + 16 * w + g + 8};
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, o[HSP / 8][4] = {};
    float sl = scale * LOG2E;  // scores in log2 units: each exponential one exp2_ftz
    for (int j = 0; j < n; j++) {
        tile_arrived(j);
        if (S == 2 && j + 1 < n) walk(j + 1);  // in flight while this tile computes
        int k0 = j * FC;
        const floatX *Kt = Ks + j % S * FC * LD, *Vt = Vs + j % S * FC * LD;
        if (k0 <= r0 + 16 * w + 15) {  // (else every key is after this warp's queries)
            float s[FC / 8][4];
            tile_nt<M, HSP, FC>(s, Q, Kt, LD);
            if (k0 + FC - 1 > r0 + 16 * w) online_softmax<true, FC, HSP>(s, m, l, o, k0, row, sl);
            else online_softmax<false, FC, HSP>(s, m, l, o, k0, row, sl);
            tile_nn<M, FC, HSP>(o, s, Vt, LD, pw);
        }
        refill_single<S>(j, n, walk);
    }
    #pragma unroll
    for (int i = 0; i < 2; i++)
        if (threadIdx.x % 4 == 0 && row[i] < T)  // (natural log: m is in log2 units)
            lse[(long long)blockIdx.x * T + row[i]] = (m[i] + log2f(l[i])) * LN2;
    __syncthreads();  // Qs is the output's staging now
    #pragma unroll
    for (int j = 0; j < HSP / 8; j++)
        #pragma unroll
        for (int e = 0; e < 4; e++) o[j][e] /= l[e / 2];
    stage<HSP>(Qs, o);
    __syncthreads();
    store_rows<HSP>(out + (long long)b * T * C + h * HS, C, Qs, r0, FR, T, HS);
}

// D = rowsum(dy * y) of a warp's two rows of this lane (dy from shared, y from global),
// its quad's lanes summing packs q, q + 4, ..; written to Dbuf for flash_dkdv.
template <int HSP>
__device__ void rowsum_dy_y(float (&D)[2], const floatX* dYs, const floatX* y, float* Dbuf,
                            const int (&row)[2], long long C, int T, int HS) {
    constexpr int LD = HSP + SKEW;
    int w = threadIdx.x / WARP, g = threadIdx.x % WARP / 4, q = threadIdx.x % 4;
    #pragma unroll
    for (int i = 0; i < 2; i++) {
        bool in = row[i] < T;
        const floatX* dyr = dYs + (16 * w + g + 8 * i) * LD;
        const floatX* yr = y + (long long)row[i] * C;
        float s = 0.f, fd[PACK], fy[PACK];
        for (int c = q * PACK; c < HS && in; c += 4 * PACK) {  // (HS: a multiple of PACK)
            load_pack(fd, dyr + c, PACK, true);
            load_pack(fy, yr + c, HS - c, aligned16(yr));  // (as load_rows)
            for (int e = 0; e < PACK; e++) s += fd[e] * fy[e];
        }
        D[i] = quad_sum(s);
        if (q == 0 && in) Dbuf[row[i]] = D[i];
    }
}

// dS = P (dP - D) * scale in place of dp, P from the scores s and the rows' lse L (log2
// units). MASK: the tile crosses the diagonal (keys after a query have P = 0).
template <bool MASK, int FC>
__device__ __forceinline__ void query_ds(float (&dp)[FC / 8][4], const float (&s)[FC / 8][4],
                                         int k0, const int (&row)[2], const float (&L)[2],
                                         const float (&D)[2], float sl, float scale) {
    #pragma unroll
    for (int j = 0; j < FC / 8; j++)
        #pragma unroll
        for (int e = 0; e < 4; e++) {
            int i = e / 2;
            float p = exp2_ftz(fmaf(s[j][e], sl, -L[i]));
            if (MASK && k0 + acc_col(j, e) > row[i]) p = 0.f;
            dp[j][e] = (dp[j][e] - D[i]) * p * scale;
        }
}

// dq for a query tile: dS = P (dP - D) * scale, dq = dS k over the keys up to the tile's end;
// first D = rowsum(dy * y) of its rows, written for flash_dkdv.
template <int HSP, int M>
__device__ void flash_dq(floatX* dqkv, float* Dbuf, const floatX* dy, const floatX* qkv,
                         const floatX* y, const float* lse, float scale,
                         int T, int NH, int HS) {
    constexpr int LD = HSP + SKEW, FC = cols<HSP>(), S = stages<HSP>();
    DYNAMIC_SHARED(smem);
    check_launch<HSP, M>(2, 0);
    floatX *Qs = reinterpret_cast<floatX*>(smem), *dYs = Qs + FR * LD, *Ks = dYs + FR * LD,
           *Vs = Ks + S * FC * LD;
    float* pw = reinterpret_cast<float*>(Vs + S * FC * LD) + threadIdx.x / WARP * 16 * (FC + 4);
    const QueryTile<HSP> t(Qs, qkv, T, NH, HS);
    const int w = t.w, g = t.g, r0 = t.r0, b = t.b, h = t.h, n = t.n;
    const long long C = t.C;
    auto walk = [&](int j) { t.walk(Ks, Vs, j, T, HS); };
    load_rows<HSP, FR>(dYs, dy + (long long)b * T * C + h * HS, C, r0, T, HS, aligned16(dy));
    walk(0);
    cp_async_wait<0>();
    __syncthreads();
    int row[2] = {r0 + 16 * w + g, r0 + 16 * w + g + 8};
    float D[2], L[2], dq[HSP / 8][4] = {}, sl = scale * LOG2E;
    rowsum_dy_y<HSP>(D, dYs, y + (long long)b * T * C + h * HS, Dbuf + (long long)blockIdx.x * T,
                     row, C, T, HS);
    #pragma unroll
    for (int i = 0; i < 2; i++)  // (log2 units)
        L[i] = row[i] < T ? lse[(long long)blockIdx.x * T + row[i]] * LOG2E : 0.f;
    WarpRows<HSP, M == BF16MMA, floatX> Q(Qs + 16 * w * LD, LD), dY(dYs + 16 * w * LD, LD);
    for (int j = 0; j < n; j++) {
        tile_arrived(j);
        if (S == 2 && j + 1 < n) walk(j + 1);
        int k0 = j * FC;
        const floatX *Kt = Ks + j % S * FC * LD, *Vt = Vs + j % S * FC * LD;
        if (k0 <= r0 + 16 * w + 15) {  // (else every key is after this warp's queries)
            float s[FC / 8][4], dp[FC / 8][4];
            tile_nt<M, HSP, FC>(s, Q, Kt, LD);
            tile_nt<M, HSP, FC>(dp, dY, Vt, LD);
            if (k0 + FC - 1 > r0 + 16 * w) query_ds<true, FC>(dp, s, k0, row, L, D, sl, scale);
            else query_ds<false, FC>(dp, s, k0, row, L, D, sl, scale);
            tile_nn<M, FC, HSP>(dq, dp, Kt, LD, pw);
        }
        refill_single<S>(j, n, walk);
    }
    __syncthreads();
    stage<HSP>(Qs, dq);
    __syncthreads();
    store_rows<HSP>(dqkv + (long long)b * T * 3 * C + h * HS, 3 * C, Qs, r0, FR, T, HS);
}

// P^T of a key tile's warp rows against query tile t0, in place of the scores s: lse Ls
// (natural log) of the tile's queries. MASK: the tile has a query before one of the warp's
// keys, or past T (P = 0 there).
template <bool MASK, int FC>
__device__ __forceinline__ void key_probs(float (&s)[FC / 8][4], const float* Ls, int t0,
                                          const int (&key)[2], int T, float sl) {
    #pragma unroll
    for (int j = 0; j < FC / 8; j++)
        #pragma unroll
        for (int e = 0; e < 4; e++) {
            int c = acc_col(j, e);
            s[j][e] = exp2_ftz(fmaf(s[j][e], sl, -Ls[c] * LOG2E));
            if (MASK && (t0 + c < key[e / 2] || t0 + c >= T)) s[j][e] = 0.f;
        }
}

// dk, dv for a key tile, over the query tiles from its own on: P^T and dS^T are this tile's
// rows (keys) against a query tile's columns; dv = P^T dy, dk = dS^T q.
template <int HSP, int M>
__device__ void flash_dkdv(floatX* dqkv, const float* Dbuf, const floatX* dy, const floatX* qkv,
                           const float* lse, float scale, int T, int NH,
                           int HS) {
    constexpr int LD = HSP + SKEW, FC = cols<HSP>(), S = stages<HSP>(), SUB = 32;
    static_assert(FC % SUB == 0, "whole chunks of 32 queries");
    DYNAMIC_SHARED(smem);
    check_launch<HSP, M>(2, 2 * FC);
    floatX *Ks = reinterpret_cast<floatX*>(smem), *Vs = Ks + FR * LD, *Qs = Vs + FR * LD,
           *dYs = Qs + S * FC * LD;
    float *Ls = reinterpret_cast<float*>(dYs + S * FC * LD), *Ds = Ls + S * FC,
          *pw = Ds + S * FC + threadIdx.x / WARP * 16 * (FC + 4);
    int w = threadIdx.x / WARP, g = threadIdx.x % WARP / 4;
    int k0 = blockIdx.y * FR;  // the first key tiles see the most queries: launched first
    int b = blockIdx.x / NH, h = blockIdx.x % NH, n = (T - k0 + FC - 1) / FC;
    long long C = (long long)NH * HS;
    const floatX *base = qkv + (long long)b * T * 3 * C + h * HS,
                 *dyb = dy + (long long)b * T * C + h * HS;
    bool wide = aligned16(qkv), wide_dy = aligned16(dy);
    auto walk = [&](int j) {  // query tile j (from k0) into buffer j % S: q, dy, lse, D
        int t0 = k0 + j * FC, u = j % S;
        load_rows<HSP, FC>(Qs + u * FC * LD, base, 3 * C, t0, T, HS, wide);
        load_rows<HSP, FC>(dYs + u * FC * LD, dyb, C, t0, T, HS, wide_dy);
        load_floats<FC>(Ls + u * FC, lse + (long long)blockIdx.x * T, t0, T);
        load_floats<FC>(Ds + u * FC, Dbuf + (long long)blockIdx.x * T, t0, T);
        cp_async_commit();
    };
    load_rows<HSP, FR>(Ks, base + C, 3 * C, k0, T, HS, wide);
    load_rows<HSP, FR>(Vs, base + 2 * C, 3 * C, k0, T, HS, wide);
    walk(0);
    cp_async_wait<0>();
    __syncthreads();
    // k and v held as fragments up to 64 dimensions: above, dk and dv leave no registers
    constexpr bool HOLD = M == BF16MMA && HSP <= 64;
    WarpRows<HSP, HOLD, floatX> Kr(Ks + 16 * w * LD, LD), Vr(Vs + 16 * w * LD, LD);
    int key[2] = {k0 + 16 * w + g, k0 + 16 * w + g + 8};
    float dk[HSP / 8][4] = {}, dv[HSP / 8][4] = {}, sl = scale * LOG2E;
    for (int j = 0; j < n; j++) {
        tile_arrived(j);
        if (S == 2 && j + 1 < n) walk(j + 1);
        int t0 = k0 + j * FC, u = j % S;
        const floatX *Qt = Qs + u * FC * LD, *dYt = dYs + u * FC * LD;
        // 32 queries at a time (one after the other: a 64-wide tile's P and dS at once would
        // leave dk and dv too few registers for three blocks per SM)
        #pragma unroll
        for (int c0 = 0; c0 < FC; c0 += SUB) {
            int tc = t0 + c0;
            if (tc + SUB - 1 < k0 + 16 * w) continue;  // every query is before this warp's keys
            float s[SUB / 8][4], dp[SUB / 8][4];
            const floatX *Qc = Qt + c0 * LD, *dYc = dYt + c0 * LD;
            const float *Lc = Ls + u * FC + c0, *Dc = Ds + u * FC + c0;
            tile_nt<M, HSP, SUB>(s, Kr, Qc, LD);
            if (tc < k0 + 16 * w + 15 || tc + SUB > T) key_probs<true, SUB>(s, Lc, tc, key, T, sl);
            else key_probs<false, SUB>(s, Lc, tc, key, T, sl);
            tile_nn<M, SUB, HSP>(dv, s, dYc, LD, pw);
            tile_nt<M, HSP, SUB>(dp, Vr, dYc, LD);
            #pragma unroll
            for (int jj = 0; jj < SUB / 8; jj++)
                #pragma unroll
                for (int e = 0; e < 4; e++)
                    dp[jj][e] = (dp[jj][e] - Dc[acc_col(jj, e)]) * s[jj][e] * scale;
            tile_nn<M, SUB, HSP>(dk, dp, Qc, LD, pw);
        }
        refill_single<S>(j, n, walk);
    }
    __syncthreads();
    stage<HSP>(Ks, dk);
    stage<HSP>(Vs, dv);
    __syncthreads();
    floatX* d = dqkv + (long long)b * T * 3 * C + h * HS;
    store_rows<HSP>(d + C, 3 * C, Ks, k0, FR, T, HS);
    store_rows<HSP>(d + 2 * C, 3 * C, Vs, k0, FR, T, HS);
}

// The math each build runs: bf16 on tensor cores; fp32 on TF32 tensor cores or exact FMA
// (if constexpr in a template: a build instantiates only its own).
#define FLASH_BY_MATH(fn)                                                   \
    template <int HSP, class... A>                                         \
    __device__ void fn##_by_math(int tf32, A... a) {                       \
        if constexpr (sizeof(floatX) == 2) fn<HSP, BF16MMA>(a...);         \
        else if (tf32) fn<HSP, TF32>(a...);                                \
        else fn<HSP, FMA>(a...);                                           \
    }
FLASH_BY_MATH(flash_forward)
FLASH_BY_MATH(flash_dq)
FLASH_BY_MATH(flash_dkdv)

// Entry points: each kernel per head size of FLASH_HEAD_SIZES (kernels.py). bf16's dkdv up
// to 64 dimensions bounded to DKDV_BLOCKS blocks per SM: three on sm_90 (168 registers, no
// spills: it works 32 queries at a time), the occupancy its critical path wants
// (dev/gpumodel); two on sm_80, whose compiler spills at 168; above 64 dimensions its dk
// and dv alone would not fit three. fp32 asks for one block (no cap on its
// registers): the three were chosen for bf16's critical path, and in fp32's FMA and TF32
// paths a cap would only risk spills.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define DKDV_BF16_BLOCKS 2
#else
#define DKDV_BF16_BLOCKS 3
#endif
#define DKDV_BLOCKS (sizeof(floatX) == 2 ? DKDV_BF16_BLOCKS : 1)
// One head size's three kernels (kernels.py's kernels_in writes each invocation out, as the
// preprocessor does, to read their names and parameters).
#define FLASH_KERNELS(HEAD, DKDV_BOUNDS)                                                   \
    extern "C" __global__ void flash_forward_##HEAD(floatX* out, float* lse,              \
                                                   const floatX* qkv, float scale, int T, \
                                                   int NH, int HS, int tf32) {            \
        flash_forward_by_math<HEAD>(tf32, out, lse, qkv, scale, T, NH, HS);               \
    }                                                                                      \
    extern "C" __global__ void flash_dq_##HEAD(floatX* dqkv, float* D, const floatX* dy,  \
                                              const floatX* qkv, const floatX* y,         \
                                              const float* lse, float scale, int T,       \
                                              int NH, int HS, int tf32) {                 \
        flash_dq_by_math<HEAD>(tf32, dqkv, D, dy, qkv, y, lse, scale, T, NH, HS);         \
    }                                                                                      \
    extern "C" __global__ void DKDV_BOUNDS flash_dkdv_##HEAD(                             \
            floatX* dqkv, const float* D, const floatX* dy, const floatX* qkv,            \
            const float* lse, float scale, int T, int NH, int HS, int tf32) {             \
        flash_dkdv_by_math<HEAD>(tf32, dqkv, D, dy, qkv, lse, scale, T, NH, HS);          \
    }
#define DKDV_BOUNDED __launch_bounds__(THREADS, DKDV_BLOCKS)
#define DKDV_UNBOUNDED
FLASH_KERNELS(16, DKDV_BOUNDED)
FLASH_KERNELS(32, DKDV_BOUNDED)
FLASH_KERNELS(64, DKDV_BOUNDED)
FLASH_KERNELS(96, DKDV_UNBOUNDED)
FLASH_KERNELS(128, DKDV_UNBOUNDED)
