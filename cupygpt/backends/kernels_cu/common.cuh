// Shared helpers. Every kernel file includes this; all kernels are extern "C".
#pragma once
#ifndef INFINITY  // NVRTC (CuPy's compiler) has no <math.h>
#define INFINITY __int_as_float(0x7f800000)
#endif
// The launch geometry comes from cupygpt/backends/cuda/kernels.py (GEOMETRY), as -D options, so
// the Python that launches a kernel and the kernel agree on it.
#if !defined(WARP) || !defined(EW_THREADS) || !defined(ROW_WARPS) || !defined(CLS_THREADS) || \
    !defined(COL_TILE) || !defined(ROW_LANES)
#error "launch geometry not defined: compile with cupygpt.backends.cuda.kernels.options"
#endif
#define FULL_MASK 0xffffffffu

// floatX: how parameters, activations and gradients are stored, float or __nv_bfloat16 (a
// bf16 run's). The backend compiles each file once per type (-DfloatX=..., kernels.py). A
// kernel loads floatX into float, computes in float and rounds what it stores once, to the
// nearest even (store), as the NumPy reference does (precision.py); statistics, losses and
// AdamW's state are float whatever floatX is.
#ifndef floatX
#error "storage type not defined: compile with cupygpt.backends.cuda.kernels.options(dtype)"
#endif
#include <cuda_bf16.h>

__device__ __forceinline__ float load(float x) { return x; }
__device__ __forceinline__ float load(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

// v as stored: rounded to floatX (what the next kernel reading it back gets).
__device__ __forceinline__ float stored(float v) {
    floatX t;
    store(&t, v);
    return load(t);
}

// 128-bit access: PACK floatX in one 16-byte load or store (4 floats, 8 bf16). An
// elementwise kernel's thread takes PACK consecutive elements, with one 16-byte access per
// array where the run is whole and every pointer 16-byte aligned, else one at a time: the
// same float math per element either way.
#define PACK (16 / (int)sizeof(floatX))
struct alignas(16) Pack {
    floatX v[PACK];
};
// 16 bytes of any element type: the column sums' loads of floatX or float partials, and
// AdamW's float state.
#define VEC(T) (16 / (int)sizeof(T))
template <class T>
struct alignas(16) Vec {
    T v[VEC(T)];
};

__device__ __forceinline__ bool aligned16(const void* p) {
    return ((unsigned long long)p & 15) == 0;
}

// f[k] = p[k] for k < n, 0 after; one 16-byte load where vec (n is PACK, p aligned).
// Where vec is a runtime value, n must be one too (not the constant PACK): g++ (cudasim)
// was seen merging the two paths into one aligned 16-byte load, which faults on the
// misaligned view the element-wise path is for.
__device__ __forceinline__ void load_pack(float* f, const floatX* p, int n, bool vec) {
    if (vec) {
        Pack v = *reinterpret_cast<const Pack*>(p);
        for (int k = 0; k < PACK; k++) f[k] = load(v.v[k]);
        return;
    }
    for (int k = 0; k < PACK; k++) f[k] = k < n ? load(p[k]) : 0.f;
}

// p[k] = f[k] rounded, for k < n; one 16-byte store where vec.
__device__ __forceinline__ void store_pack(floatX* p, const float* f, int n, bool vec) {
    if (vec) {
        Pack v;
        for (int k = 0; k < PACK; k++) store(&v.v[k], f[k]);
        *reinterpret_cast<Pack*>(p) = v;
        return;
    }
    for (int k = 0; k < n && k < PACK; k++) store(&p[k], f[k]);
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ double warp_sum_d(double v) {
    for (int o = WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

#define LOG2E 1.4426950408889634f  // exp(x) = exp2(x * LOG2E): one MUFU.EX2, no IEEE expf
#define LN2 0.6931471805599453f     // log(x) = log2(x) * LN2

// exp(x - m), as exp2 with log2(e) folded in (ml = m * LOG2E, computed once per m).
__device__ __forceinline__ float exp_from(float x, float ml) { return exp2f(fmaf(x, LOG2E, -ml)); }

// Online softmax state (running max m, sum s of exp(x - m)), merged across lanes.
__device__ __forceinline__ void merge_max_sum(float& m, float& s, float m2, float s2) {
    float mn = fmaxf(m, m2);
    if (mn == -INFINITY) { m = mn; s = 0.f; return; }  // both empty: exp(-inf - -inf) is nan
    float ml = mn * LOG2E;
    s = s * exp_from(m, ml) + s2 * exp_from(m2, ml);
    m = mn;
}

__device__ __forceinline__ void warp_max_sum(float& m, float& s) {
    for (int o = WARP / 2; o > 0; o >>= 1) {
        float m2 = __shfl_xor_sync(FULL_MASK, m, o), s2 = __shfl_xor_sync(FULL_MASK, s, o);
        merge_max_sum(m, s, m2, s2);
    }
}

#define GELU_SCALE 0.7978845608028654f  // sqrt(2/pi)

// --- tensor cores and dynamic shared memory --------------------------------------------
// The warp-wide matrix instructions are inline PTX (sm_80+). cudasim (g++, no PTX) defines
// CUDASIM and brings its own versions of these eleven, emulating the PTX ISA's fragment
// layouts and cp.async's groups (tests/support/cudasim/sim_mma.h); a kernel uses only these
// names.
#ifndef CUDASIM
// One mma.sync of a 16x8 float accumulator from four A and two B registers (both shapes
// below take operands so).
#define MMA_16x8(NAME, PTX)                                                               \
    __device__ __forceinline__ void NAME(float d[4], const unsigned a[4],                 \
                                         const unsigned b[2]) {                           \
        asm(PTX " {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"                  \
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                              \
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));          \
    }
// d += a b on one warp: m16n8k16, A 16x16 row-major bf16 (4 registers of 2), B 16x8
// column-major bf16 (2 of 2), C/D 16x8 float. Lane l = 4g + q holds A's (g, 2q..2q+1),
// (g+8, ..), (g, 2q+8..), (g+8, 2q+8..); B's (k 2q..2q+1, n g), (k 2q+8.., g); D's (g,
// 2q..2q+1), (g+8, ..). Low halves hold the lower index.
MMA_16x8(mma_bf16_16816, "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32")

// d += a b: m16n8k8 in TF32, A 16x8 row-major (lane 4g + q: (g, q), (g+8, q), (g, q+4),
// (g+8, q+4)), B 8x8 column-major ((k q, n g), (k q+4, n g)), D as above.
MMA_16x8(mma_tf32_1688, "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32")

// Four 8x8 matrices of 16-bit elements from shared memory, one instruction for the warp:
// lane l gives the address of row l % 8 of matrix l / 8 (16 contiguous bytes, 16-byte
// aligned) and gets in r[m] matrix m's row l / 4, columns 2 (l % 4) and + 1 (an mma
// fragment's pair); _trans: rows 2 (l % 4) and + 1 of column l / 4. Lower index low.
// volatile: the same address reads new data after each __syncthreads.
__device__ __forceinline__ void ldmatrix_x4(unsigned r[4], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"((unsigned)__cvta_generic_to_shared(row)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned r[4], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"((unsigned)__cvta_generic_to_shared(row)));
}

// x rounded to TF32 (10 mantissa bits, to nearest, ties away), as the matmuls' TF32 mode.
__device__ __forceinline__ unsigned to_tf32(float x) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

// Asynchronous copies from global to shared memory (sm_80+): issued without waiting, so a
// tile's loads fly while the tile before it computes, and without passing through
// registers. cp_async16: 16 bytes (dst and src 16-byte aligned), .cg (L2 only: a tile is
// read once per block); src_bytes of them read, the rest zero-filled (0: src is not read,
// but must still be a valid address). cp_async4: 4 bytes (.ca, the only size .cg lacks), 0
// or 4 read. A thread's copies since its last commit form a group; cp_async_wait<N>()
// returns once at most N of its committed groups are still in flight. Each thread waits
// for its own copies: a __syncthreads after the wait makes every thread's visible.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::
                 "r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src), "r"(src_bytes)
                 : "memory");
}

__device__ __forceinline__ void cp_async4(void* dst, const void* src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::
                 "r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src), "r"(src_bytes)
                 : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// 2^x in one MUFU.EX2: exp2f's own instruction without the four or so around it that
// handle results below 2^-126 (flushed to 0 here: flash attention's probabilities, where
// such a value adds nothing beside the row's largest, 1).
__device__ __forceinline__ float exp2_ftz(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

// The block's dynamic shared memory (the launch's shared_mem bytes), and its size.
#define DYNAMIC_SHARED(name) extern __shared__ __align__(16) unsigned char name[]
__device__ __forceinline__ unsigned dynamic_smem_bytes() {
    unsigned r;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
    return r;
}
#endif
