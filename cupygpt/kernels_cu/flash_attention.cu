// Causal self-attention for training, FlashAttention-2's way: no (T, T) tensor anywhere.
// q, k, v are read straight from qkv (B, T, 3, NH, HS), already biased (qkv's GEMM adds the
// bias in its epilogue), y written straight as (B, T, NH, HS) and dq, dk, dv straight
// into dqkv: no permutes. Forward keeps each query's log-sum-exp
// (lse, (B, NH, T) float); backward makes the probabilities again from it, tile by tile,
// with D = rowsum(dy * y) in place of the sum over keys.
//
// A block owns FR = 16 * FLASH_WARPS rows of one (b, h) (queries; keys in dkdv), a warp 16 of
// them (grid: x the (b, h), y the row tile, longest first, so every head's longest tiles
// start first), and walks tiles of FC = FLASH_COLS columns (keys; queries in dkdv) through shared
// memory, skipping the tiles the causal mask hides from all its rows. The two products per
// tile run on one warp's 16 rows with fp32 accumulators in mma.sync's layout (acc[j][e]:
// lane 4g + q holds row g (e 0, 1) and g + 8 (e 2, 3), column 8j + 2q + e % 2):
//   bf16: tensor cores, m16n8k16 (bf16 in, fp32 sums; the probabilities and their
//         gradients rounded to bf16 on the way in, as the NumPy reference stores them);
//   fp32 with tf32: tensor cores, m16n8k8 (inputs rounded to TF32, as cuBLAS's TF32 mode);
//   fp32 without: exact FMA dot products (verify's arithmetic).
// Head sizes up to 128, multiples of 8: each kernel is built for HSP in FLASH_HEAD_SIZES,
// the smallest one >= HS taken, dimensions HS..HSP zero in shared memory.
// Backward is two kernels, so every sum has one owner and a fixed order (deterministic, no
// atomics): flash_dq (a block per query tile; also writes D) then flash_dkdv (a block per key
// tile, over the query tiles after it).
#include "common.cuh"

#if !defined(FLASH_WARPS) || !defined(FLASH_COLS)
#error "flash geometry not defined: compile with cupygpt.kernels.OPTIONS"
#endif
constexpr int FR = 16 * FLASH_WARPS, FC = FLASH_COLS;
static_assert(FR % FC == 0 && FC % 16 == 0, "a block's rows are whole column tiles");
constexpr int SKEW = PACK;          // shared rows padded by 16 bytes: fewer bank conflicts
constexpr int LP = FC + 4;          // the FMA path's per-warp operand rows (floats)
enum Math { FMA, TF32, BF16MMA };

__device__ __forceinline__ unsigned bf16_pair(float lo, float hi) {  // rounded, lo low
    return (unsigned)__bfloat16_as_ushort(__float2bfloat16_rn(lo)) |
           ((unsigned)__bfloat16_as_ushort(__float2bfloat16_rn(hi)) << 16);
}

// acc (16 x N) = A (16 x K) B^T, B (N x K): both row-major in shared memory, ld apart.
template <int M, int K, int N, class X>
__device__ __forceinline__ void tile_nt(float (&acc)[N / 8][4], const X* A, const X* B, int ld) {
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
                const X *a = A + (g + 8 * (e / 2)) * ld, *b = B + (8 * j + 2 * q + e % 2) * ld;
                float s = 0.f;
#pragma unroll 8
                for (int k = 0; k < K; k++) s = fmaf(load(a[k]), load(b[k]), s);
                acc[j][e] = s;
            }
    } else if constexpr (M == TF32) {
        #pragma unroll
        for (int k0 = 0; k0 < K; k0 += 8) {
            const X *a = A + g * ld + k0 + q;
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
        // ldmatrix: A's fragment is its 8x8 quarters (rows +8 for a1, columns +8 for a2);
        // B's for tiles j and j + 1 are rows 8j.. and 8j + 8.., columns k0 and k0 + 8
        int l = threadIdx.x % WARP, m = l / 8, r = l % 8;
        #pragma unroll
        for (int k0 = 0; k0 < K; k0 += 16) {
            unsigned x[4];
            ldmatrix_x4(x, A + (r + 8 * (m % 2)) * ld + k0 + 8 * (m / 2));
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
// in shared memory, ld apart. pw: the warp's 16 x LP floats (FMA only: each lane needs whole
// rows of a, which other lanes hold).
template <int M, int K, int N, class X>
__device__ __forceinline__ void tile_nn(float (&acc)[N / 8][4], const float (&a)[K / 8][4],
                                        const X* B, int ld, float* pw) {
    int g = threadIdx.x % WARP / 4, q = threadIdx.x % 4;
    if constexpr (M == FMA) {
        #pragma unroll
        for (int t = 0; t < K / 8; t++)
            #pragma unroll
            for (int e = 0; e < 4; e++)
                pw[(g + 8 * (e / 2)) * LP + 8 * t + 2 * q + e % 2] = a[t][e];
        __syncwarp();
        #pragma unroll
        for (int j = 0; j < N / 8; j++)
            #pragma unroll
            for (int e = 0; e < 4; e++) {
                const float* x = pw + (g + 8 * (e / 2)) * LP;
                const X* b = B + 8 * j + 2 * q + e % 2;
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

// dst (rows x HSP, ld HSP + SKEW) = rows r0.. of src (stride apart), columns 0..HS-1;
// zeros past T and HS. 16 bytes at a time when src is 16-byte aligned (HS and C are
// multiples of 8, so then every row is), else one element at a time.
template <int HSP>
__device__ void load_rows(floatX* dst, const floatX* src, long long stride, int r0, int rows,
                          int T, int HS) {
    constexpr int LD = HSP + SKEW, PER = HSP / PACK;
    bool wide = aligned16(src);
    for (int i = threadIdx.x; i < rows * PER; i += blockDim.x) {
        int r = i / PER, c = i % PER * PACK;
        Pack* d = reinterpret_cast<Pack*>(dst + r * LD + c);
        const floatX* s = src + (r0 + r) * stride + c;
        if (r0 + r >= T || c >= HS) {
            for (int e = 0; e < PACK; e++) d->v[e] = floatX(0.f);
        } else if (wide) {
            *d = *reinterpret_cast<const Pack*>(s);
        } else {
            for (int e = 0; e < PACK; e++) d->v[e] = s[e];
        }
    }
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
    int w = threadIdx.x / WARP, g = threadIdx.x % WARP / 4, q = threadIdx.x % 4;
    #pragma unroll
    for (int j = 0; j < HSP / 8; j++)
        #pragma unroll
        for (int e = 0; e < 4; e++)
            store(&tile[(16 * w + g + 8 * (e / 2)) * LD + 8 * j + 2 * q + e % 2],
                  acc[j][e]);
}

// Shared memory: the block's own rows (own tiles of FR rows), the walked tiles (2 of FC
// rows), and the FMA path's per-warp operand rows; flash_smem_bytes in cuda_backend.py
// computes the same, and each kernel checks it was given that much.
template <int HSP, int M>
__device__ __forceinline__ unsigned smem_need(int own, int extra_floats) {
    return (own * FR + 2 * FC) * (HSP + SKEW) * sizeof(floatX) +
           4 * (extra_floats + (M == FMA ? FLASH_WARPS * 16 * LP : 0));
}

template <int HSP, int M>
__device__ void flash_forward(floatX* out, float* lse, const floatX* qkv,
                              float scale, int T, int NH, int HS) {
    constexpr int LD = HSP + SKEW;
    DYNAMIC_SHARED(smem);
    if (dynamic_smem_bytes() < smem_need<HSP, M>(1, 0)) __trap();
    floatX *Qs = reinterpret_cast<floatX*>(smem), *Ks = Qs + FR * LD, *Vs = Ks + FC * LD;
    float* pw = reinterpret_cast<float*>(Vs + FC * LD) + threadIdx.x / WARP * 16 * LP;
    int w = threadIdx.x / WARP, g = threadIdx.x % WARP / 4, q = threadIdx.x % 4;
    int r0 = ((T + FR - 1) / FR - 1 - blockIdx.y) * FR;  // the longest rows first
    int b = blockIdx.x / NH, h = blockIdx.x % NH;
    long long C = (long long)NH * HS;
    const floatX* base = qkv + (long long)b * T * 3 * C + h * HS;
    load_rows<HSP>(Qs, base, 3 * C, r0, FR, T, HS);
    int row[2] = {r0 + 16 * w + g, r0 + 16 * w + g + 8};
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, o[HSP / 8][4] = {};
    float sl = scale * LOG2E;  // scores in log2 units: each exponential one exp2
    for (int k0 = 0; k0 < T && k0 < r0 + FR; k0 += FC) {
        __syncthreads();  // the last tile's readers are done
        load_rows<HSP>(Ks, base + C, 3 * C, k0, FC, T, HS);
        load_rows<HSP>(Vs, base + 2 * C, 3 * C, k0, FC, T, HS);
        __syncthreads();
        if (k0 > r0 + 16 * w + 15) continue;  // every key is after this warp's queries
        float s[FC / 8][4], mx[2] = {m[0], m[1]}, sum[2] = {0.f, 0.f};
        tile_nt<M, HSP, FC>(s, Qs + 16 * w * LD, Ks, LD);
        bool diagonal = k0 + FC - 1 > r0 + 16 * w;  // (warp-uniform: only there a key is masked)
        #pragma unroll
        for (int j = 0; j < FC / 8; j++)
            #pragma unroll
            for (int e = 0; e < 4; e++) {
                int key = k0 + 8 * j + 2 * q + e % 2;
                s[j][e] *= sl;
                if (diagonal && key > row[e / 2]) s[j][e] = -INFINITY;
                mx[e / 2] = fmaxf(mx[e / 2], s[j][e]);
            }
        float alpha[2];
        #pragma unroll
        for (int i = 0; i < 2; i++) {  // key 0 is in every row's first tile: mx is finite
            mx[i] = quad_max(mx[i]);
            alpha[i] = exp2f(m[i] - mx[i]);
            m[i] = mx[i];
        }
        #pragma unroll
        for (int j = 0; j < FC / 8; j++)
            #pragma unroll
            for (int e = 0; e < 4; e++) {
                s[j][e] = exp2f(s[j][e] - m[e / 2]);
                sum[e / 2] += s[j][e];
            }
        #pragma unroll
        for (int i = 0; i < 2; i++) l[i] = l[i] * alpha[i] + quad_sum(sum[i]);
        #pragma unroll
        for (int j = 0; j < HSP / 8; j++)
            #pragma unroll
            for (int e = 0; e < 4; e++) o[j][e] *= alpha[e / 2];
        tile_nn<M, FC, HSP>(o, s, Vs, LD, pw);
    }
    #pragma unroll
    for (int i = 0; i < 2; i++)
        if (q == 0 && row[i] < T)  // (natural log: m is in log2 units)
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

// dq for a query tile: dS = P (dP - D) * scale, dq = dS k over the keys up to the tile's end;
// first D = rowsum(dy * y) of its rows, written for flash_dkdv.
template <int HSP, int M>
__device__ void flash_dq(floatX* dqkv, float* Dbuf, const floatX* dy, const floatX* qkv,
                         const floatX* y, const float* lse, float scale,
                         int T, int NH, int HS) {
    constexpr int LD = HSP + SKEW;
    DYNAMIC_SHARED(smem);
    if (dynamic_smem_bytes() < smem_need<HSP, M>(2, 0)) __trap();
    floatX *Qs = reinterpret_cast<floatX*>(smem), *dYs = Qs + FR * LD, *Ks = dYs + FR * LD,
           *Vs = Ks + FC * LD;
    float* pw = reinterpret_cast<float*>(Vs + FC * LD) + threadIdx.x / WARP * 16 * LP;
    int w = threadIdx.x / WARP, g = threadIdx.x % WARP / 4, q = threadIdx.x % 4;
    int r0 = ((T + FR - 1) / FR - 1 - blockIdx.y) * FR;
    int b = blockIdx.x / NH, h = blockIdx.x % NH;
    long long C = (long long)NH * HS;
    const floatX* base = qkv + (long long)b * T * 3 * C + h * HS;
    load_rows<HSP>(Qs, base, 3 * C, r0, FR, T, HS);
    load_rows<HSP>(dYs, dy + (long long)b * T * C + h * HS, C, r0, FR, T, HS);
    __syncthreads();
    int row[2] = {r0 + 16 * w + g, r0 + 16 * w + g + 8};
    float D[2], L[2], dq[HSP / 8][4] = {};
    #pragma unroll
    for (int i = 0; i < 2; i++) {  // a quad sums a row: lane q takes packs q, q + 4, ..
        bool in = row[i] < T;
        const floatX* dyr = dYs + (16 * w + g + 8 * i) * LD;
        const floatX* yr = y + ((long long)b * T + row[i]) * C + h * HS;
        float s = 0.f, fd[PACK], fy[PACK];
        for (int c = q * PACK; c < HS && in; c += 4 * PACK) {  // (HS: a multiple of PACK)
            load_pack(fd, dyr + c, PACK, true);
            load_pack(fy, yr + c, HS - c, aligned16(yr));  // (as load_rows)
            for (int e = 0; e < PACK; e++) s += fd[e] * fy[e];
        }
        D[i] = quad_sum(s);
        L[i] = in ? lse[(long long)blockIdx.x * T + row[i]] * LOG2E : 0.f;  // (log2 units)
        if (q == 0 && in) Dbuf[(long long)blockIdx.x * T + row[i]] = D[i];
    }
    for (int k0 = 0; k0 < T && k0 < r0 + FR; k0 += FC) {
        __syncthreads();
        load_rows<HSP>(Ks, base + C, 3 * C, k0, FC, T, HS);
        load_rows<HSP>(Vs, base + 2 * C, 3 * C, k0, FC, T, HS);
        __syncthreads();
        if (k0 > r0 + 16 * w + 15) continue;
        float s[FC / 8][4], dp[FC / 8][4], sl = scale * LOG2E;
        tile_nt<M, HSP, FC>(s, Qs + 16 * w * LD, Ks, LD);
        tile_nt<M, HSP, FC>(dp, dYs + 16 * w * LD, Vs, LD);
        bool diagonal = k0 + FC - 1 > r0 + 16 * w;  // (warp-uniform: only there a key is masked)
        #pragma unroll
        for (int j = 0; j < FC / 8; j++)
            #pragma unroll
            for (int e = 0; e < 4; e++) {
                int key = k0 + 8 * j + 2 * q + e % 2, i = e / 2;
                float p = exp2f(fmaf(s[j][e], sl, -L[i]));
                if (diagonal && key > row[i]) p = 0.f;
                dp[j][e] = (dp[j][e] - D[i]) * p * scale;
            }
        tile_nn<M, FC, HSP>(dq, dp, Ks, LD, pw);
    }
    __syncthreads();
    stage<HSP>(Qs, dq);
    __syncthreads();
    store_rows<HSP>(dqkv + (long long)b * T * 3 * C + h * HS, 3 * C, Qs, r0, FR, T, HS);
}

// dk, dv for a key tile, over the query tiles from its own on: P^T and dS^T are this tile's
// rows (keys) against a query tile's columns; dv = P^T dy, dk = dS^T q.
template <int HSP, int M>
__device__ void flash_dkdv(floatX* dqkv, const float* Dbuf, const floatX* dy, const floatX* qkv,
                           const float* lse, float scale, int T, int NH,
                           int HS) {
    constexpr int LD = HSP + SKEW;
    DYNAMIC_SHARED(smem);
    if (dynamic_smem_bytes() < smem_need<HSP, M>(2, 2 * FC)) __trap();
    floatX *Ks = reinterpret_cast<floatX*>(smem), *Vs = Ks + FR * LD, *Qs = Vs + FR * LD,
           *dYs = Qs + FC * LD;
    float *Ls = reinterpret_cast<float*>(dYs + FC * LD), *Ds = Ls + FC,
          *pw = Ds + FC + threadIdx.x / WARP * 16 * LP;
    int w = threadIdx.x / WARP, g = threadIdx.x % WARP / 4, q = threadIdx.x % 4;
    int k0 = blockIdx.y * FR;  // the first key tiles see the most queries: launched first
    int b = blockIdx.x / NH, h = blockIdx.x % NH;
    long long C = (long long)NH * HS;
    const floatX* base = qkv + (long long)b * T * 3 * C + h * HS;
    load_rows<HSP>(Ks, base + C, 3 * C, k0, FR, T, HS);
    load_rows<HSP>(Vs, base + 2 * C, 3 * C, k0, FR, T, HS);
    int key[2] = {k0 + 16 * w + g, k0 + 16 * w + g + 8};
    float dk[HSP / 8][4] = {}, dv[HSP / 8][4] = {};
    for (int t0 = k0; t0 < T; t0 += FC) {  // FR is a multiple of FC: t0 starts a tile
        __syncthreads();
        load_rows<HSP>(Qs, base, 3 * C, t0, FC, T, HS);
        load_rows<HSP>(dYs, dy + (long long)b * T * C + h * HS, C, t0, FC, T, HS);
        for (int i = threadIdx.x; i < FC; i += blockDim.x) {
            bool in = t0 + i < T;
            Ls[i] = in ? lse[(long long)blockIdx.x * T + t0 + i] * LOG2E : 0.f;  // (log2)
            Ds[i] = in ? Dbuf[(long long)blockIdx.x * T + t0 + i] : 0.f;
        }
        __syncthreads();
        if (t0 + FC - 1 < k0 + 16 * w) continue;  // every query is before this warp's keys
        float s[FC / 8][4], dp[FC / 8][4], sl = scale * LOG2E;
        tile_nt<M, HSP, FC>(s, Ks + 16 * w * LD, Qs, LD);
        // (warp-uniform) a query of the tile before one of the warp's keys, or past T
        bool edge = t0 < k0 + 16 * w + 15 || t0 + FC > T;
        #pragma unroll
        for (int j = 0; j < FC / 8; j++)
            #pragma unroll
            for (int e = 0; e < 4; e++) {
                int c = 8 * j + 2 * q + e % 2;
                s[j][e] = exp2f(fmaf(s[j][e], sl, -Ls[c]));
                if (edge && (t0 + c < key[e / 2] || t0 + c >= T)) s[j][e] = 0.f;
            }
        tile_nn<M, FC, HSP>(dv, s, dYs, LD, pw);
        tile_nt<M, HSP, FC>(dp, Vs + 16 * w * LD, dYs, LD);
        #pragma unroll
        for (int j = 0; j < FC / 8; j++)
            #pragma unroll
            for (int e = 0; e < 4; e++) {
                int c = 8 * j + 2 * q + e % 2;
                dp[j][e] = (dp[j][e] - Ds[c]) * s[j][e] * scale;
            }
        tile_nn<M, FC, HSP>(dk, dp, Qs, LD, pw);
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

// Entry points: each kernel per head size of FLASH_HEAD_SIZES (kernels.py).
extern "C" __global__ void flash_forward_16(floatX* out, float* lse, const floatX* qkv,
                                           float scale, int T, int NH, int HS, int tf32) {
    flash_forward_by_math<16>(tf32, out, lse, qkv, scale, T, NH, HS);
}
extern "C" __global__ void flash_dq_16(floatX* dqkv, float* D, const floatX* dy,
                                      const floatX* qkv, const floatX* y, const float* lse,
                                      float scale, int T, int NH, int HS, int tf32) {
    flash_dq_by_math<16>(tf32, dqkv, D, dy, qkv, y, lse, scale, T, NH, HS);
}
extern "C" __global__ void flash_dkdv_16(floatX* dqkv, const float* D, const floatX* dy,
                                        const floatX* qkv, const float* lse, float scale,
                                        int T, int NH, int HS, int tf32) {
    flash_dkdv_by_math<16>(tf32, dqkv, D, dy, qkv, lse, scale, T, NH, HS);
}
extern "C" __global__ void flash_forward_32(floatX* out, float* lse, const floatX* qkv,
                                           float scale, int T, int NH, int HS, int tf32) {
    flash_forward_by_math<32>(tf32, out, lse, qkv, scale, T, NH, HS);
}
extern "C" __global__ void flash_dq_32(floatX* dqkv, float* D, const floatX* dy,
                                      const floatX* qkv, const floatX* y, const float* lse,
                                      float scale, int T, int NH, int HS, int tf32) {
    flash_dq_by_math<32>(tf32, dqkv, D, dy, qkv, y, lse, scale, T, NH, HS);
}
extern "C" __global__ void flash_dkdv_32(floatX* dqkv, const float* D, const floatX* dy,
                                        const floatX* qkv, const float* lse, float scale,
                                        int T, int NH, int HS, int tf32) {
    flash_dkdv_by_math<32>(tf32, dqkv, D, dy, qkv, lse, scale, T, NH, HS);
}
extern "C" __global__ void flash_forward_64(floatX* out, float* lse, const floatX* qkv,
                                           float scale, int T, int NH, int HS, int tf32) {
    flash_forward_by_math<64>(tf32, out, lse, qkv, scale, T, NH, HS);
}
extern "C" __global__ void flash_dq_64(floatX* dqkv, float* D, const floatX* dy,
                                      const floatX* qkv, const floatX* y, const float* lse,
                                      float scale, int T, int NH, int HS, int tf32) {
    flash_dq_by_math<64>(tf32, dqkv, D, dy, qkv, y, lse, scale, T, NH, HS);
}
extern "C" __global__ void flash_dkdv_64(floatX* dqkv, const float* D, const floatX* dy,
                                        const floatX* qkv, const float* lse, float scale,
                                        int T, int NH, int HS, int tf32) {
    flash_dkdv_by_math<64>(tf32, dqkv, D, dy, qkv, lse, scale, T, NH, HS);
}
extern "C" __global__ void flash_forward_96(floatX* out, float* lse, const floatX* qkv,
                                           float scale, int T, int NH, int HS, int tf32) {
    flash_forward_by_math<96>(tf32, out, lse, qkv, scale, T, NH, HS);
}
extern "C" __global__ void flash_dq_96(floatX* dqkv, float* D, const floatX* dy,
                                      const floatX* qkv, const floatX* y, const float* lse,
                                      float scale, int T, int NH, int HS, int tf32) {
    flash_dq_by_math<96>(tf32, dqkv, D, dy, qkv, y, lse, scale, T, NH, HS);
}
extern "C" __global__ void flash_dkdv_96(floatX* dqkv, const float* D, const floatX* dy,
                                        const floatX* qkv, const float* lse, float scale,
                                        int T, int NH, int HS, int tf32) {
    flash_dkdv_by_math<96>(tf32, dqkv, D, dy, qkv, lse, scale, T, NH, HS);
}
extern "C" __global__ void flash_forward_128(floatX* out, float* lse, const floatX* qkv,
                                           float scale, int T, int NH, int HS, int tf32) {
    flash_forward_by_math<128>(tf32, out, lse, qkv, scale, T, NH, HS);
}
extern "C" __global__ void flash_dq_128(floatX* dqkv, float* D, const floatX* dy,
                                      const floatX* qkv, const floatX* y, const float* lse,
                                      float scale, int T, int NH, int HS, int tf32) {
    flash_dq_by_math<128>(tf32, dqkv, D, dy, qkv, y, lse, scale, T, NH, HS);
}
extern "C" __global__ void flash_dkdv_128(floatX* dqkv, const float* D, const floatX* dy,
                                        const floatX* qkv, const float* lse, float scale,
                                        int T, int NH, int HS, int tf32) {
    flash_dkdv_by_math<128>(tf32, dqkv, D, dy, qkv, lse, scale, T, NH, HS);
}
