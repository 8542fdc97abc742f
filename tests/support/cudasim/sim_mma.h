// cudasim's versions of what common.cuh does in inline PTX: the warp's tensor-core products
// (mma.sync m16n8k16 bf16 and m16n8k8 tf32), the shared-memory matrix loads (ldmatrix x4,
// plain and transposed), the TF32 rounding, the dynamic shared memory, and cp.async. An mma gathers all 32 lanes' fragments (a warp barrier: a lane that exited or
// diverged is reported, as mma.sync.aligned requires the whole warp), rebuilds A, B and C
// from the PTX ISA's fragment layouts and gives each lane its part of D. The sums run in
// float in k order; the hardware's order and internal width are its own (the tests allow
// for that).
#pragma once

namespace sim {
struct MmaFragments {
    unsigned a[4], b[2];
    float c[4];
};

inline float bf16_bits_to_float(unsigned short h) {
    unsigned u = (unsigned)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

inline float tf32_bits_to_float(unsigned u) {  // the tensor core reads 19 bits of a tf32
    u &= 0xffffe000u;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

// D (16x8) = A (16xK) B (Kx8) + C from every lane's fragments; lane l = 4g + q.
template <int K, class Unpack>
void mma_warp(float d[4], const unsigned a[4], const unsigned b[2], Unpack unpack) {
    MmaFragments mine, all[32];
    memcpy(mine.a, a, sizeof mine.a);
    memcpy(mine.b, b, sizeof mine.b);
    memcpy(mine.c, d, sizeof mine.c);
    warp_gather(&mine, all, sizeof mine, K == 16 ? "mma.m16n8k16" : "mma.m16n8k8");
    float A[16][K], B[K][8], C[16][8];
    for (int l = 0; l < 32; l++) {
        int g = l / 4, q = l % 4;
        unpack(all[l], g, q, A, B);
        C[g][2 * q] = all[l].c[0];
        C[g][2 * q + 1] = all[l].c[1];
        C[g + 8][2 * q] = all[l].c[2];
        C[g + 8][2 * q + 1] = all[l].c[3];
    }
    int l = thread_idx.x % 32, g = l / 4, q = l % 4;  // (blocks are 1-D wherever mma runs)
    for (int e = 0; e < 4; e++) {
        int row = g + 8 * (e / 2), col = 2 * q + e % 2;
        float s = C[row][col];
        for (int k = 0; k < K; k++) s = fmaf(A[row][k], B[k][col], s);
        d[e] = s;
    }
}
}  // namespace sim

inline void mma_bf16_16816(float d[4], const unsigned a[4], const unsigned b[2]) {
    sim::mma_warp<16>(d, a, b, [](const sim::MmaFragments& f, int g, int q, float (*A)[16],
                                  float (*B)[8]) {
        for (int h = 0; h < 2; h++) {  // h: the register's low (0) and high (1) half
            A[g][2 * q + h] = sim::bf16_bits_to_float(f.a[0] >> (16 * h));
            A[g + 8][2 * q + h] = sim::bf16_bits_to_float(f.a[1] >> (16 * h));
            A[g][2 * q + 8 + h] = sim::bf16_bits_to_float(f.a[2] >> (16 * h));
            A[g + 8][2 * q + 8 + h] = sim::bf16_bits_to_float(f.a[3] >> (16 * h));
            B[2 * q + h][g] = sim::bf16_bits_to_float(f.b[0] >> (16 * h));
            B[2 * q + 8 + h][g] = sim::bf16_bits_to_float(f.b[1] >> (16 * h));
        }
    });
}

inline void mma_tf32_1688(float d[4], const unsigned a[4], const unsigned b[2]) {
    sim::mma_warp<8>(d, a, b, [](const sim::MmaFragments& f, int g, int q, float (*A)[8],
                                 float (*B)[8]) {
        A[g][q] = sim::tf32_bits_to_float(f.a[0]);
        A[g + 8][q] = sim::tf32_bits_to_float(f.a[1]);
        A[g][q + 4] = sim::tf32_bits_to_float(f.a[2]);
        A[g + 8][q + 4] = sim::tf32_bits_to_float(f.a[3]);
        B[q][g] = sim::tf32_bits_to_float(f.b[0]);
        B[q + 4][g] = sim::tf32_bits_to_float(f.b[1]);
    });
}

namespace sim {
// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lane l gives the address of row l % 8
// of matrix l / 8 (16 bytes, 16-byte aligned); every lane's addresses are gathered (a warp
// barrier), then lane l takes from matrix m the pair (row l / 4, columns 2 (l % 4) and
// +1), or transposed (rows 2 (l % 4) and +1, column l / 4), the lower index low.
inline void ldmatrix_warp(unsigned r[4], const void* row, bool trans) {
    if ((uintptr_t)row % 16) fail("ldmatrix: a row address not 16-byte aligned");
    const unsigned short* rows[32];
    const unsigned short* mine = static_cast<const unsigned short*>(row);
    warp_gather(&mine, rows, sizeof mine, trans ? "ldmatrix.x4.trans" : "ldmatrix.x4");
    int l = thread_idx.x % 32;
    for (int m = 0; m < 4; m++) {
        const unsigned short** mat = rows + 8 * m;
        unsigned lo = trans ? mat[2 * (l % 4)][l / 4] : mat[l / 4][2 * (l % 4)];
        unsigned hi = trans ? mat[2 * (l % 4) + 1][l / 4] : mat[l / 4][2 * (l % 4) + 1];
        r[m] = lo | hi << 16;
    }
}
}  // namespace sim

inline void ldmatrix_x4(unsigned r[4], const void* row) { sim::ldmatrix_warp(r, row, false); }
inline void ldmatrix_x4_trans(unsigned r[4], const void* row) {
    sim::ldmatrix_warp(r, row, true);
}

// cvt.rna.tf32.f32: to 10 mantissa bits, to nearest, ties away from zero; NaN and inf kept.
inline unsigned to_tf32(float x) {
    unsigned u;
    memcpy(&u, &x, 4);
    if ((u & 0x7f800000u) == 0x7f800000u) return u;
    return (u + 0x1000u) & 0xffffe000u;
}

// ex2.approx.ftz.f32: 2^x, results below the smallest normal float flushed to 0.
inline float exp2_ftz(float x) {
    float r = exp2f(x);
    return r < 1.17549435e-38f ? 0.f : r;
}

#define DYNAMIC_SHARED(name) unsigned char* name = sim::dynamic_shared()
inline unsigned dynamic_smem_bytes() { return sim::dynamic_shared_bytes(); }

// cp.async: each copy is deferred to the wait that covers its group (both its read and its
// write), its destination filled with 0xff bytes (NaN) at issue, so a kernel that reads a
// tile before waiting for it, or waits for too few groups, or lets a prefetch overwrite a
// tile other warps still read (no barrier before it), reads NaN; copies no commit closed
// are never made. Per thread, as on the GPU.
namespace sim {
void cp_async(void* dst, const void* src, int bytes, int src_bytes);
void cp_async_commit();
void cp_async_wait(int pending);
}  // namespace sim

inline void cp_async16(void* dst, const void* src, int src_bytes) {
    if ((uintptr_t)dst % 16 || (uintptr_t)src % 16) sim::fail("cp.async: 16 bytes misaligned");
    sim::cp_async(dst, src, 16, src_bytes);
}
inline void cp_async4(void* dst, const void* src, int src_bytes) {
    if ((uintptr_t)dst % 4 || (uintptr_t)src % 4) sim::fail("cp.async: 4 bytes misaligned");
    sim::cp_async(dst, src, 4, src_bytes);
}
inline void cp_async_commit() { sim::cp_async_commit(); }
template <int N>
inline void cp_async_wait() { sim::cp_async_wait(N); }
