// cudasim: runs our CUDA C kernels on the CPU, compiled by g++ as C++ with this header
// force-included. Each CUDA thread of a block is a fiber (ucontext); fibers run in turn
// until they reach a barrier (__syncthreads, or the one a warp shuffle implies), so block
// and warp semantics hold exactly, one block at a time. Blocks alternate the order their
// threads run in, so a missing barrier shows up as a wrong result. Errors CUDA leaves
// undefined (a shuffle with exited lanes, __syncthreads in divergent code) are reported
// as a deadlock instead of guessed at.
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <functional>

using std::max;
using std::min;

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};

#define CUDASIM 1  // common.cuh: this file brings what CUDA does in inline PTX (sim_mma.h)

namespace sim {
extern dim3 thread_idx, block_idx, block_dim, grid_dim;
void syncthreads();
void syncwarp(unsigned mask);
void warp_exchange(const void* in, void* out, int lane_xor, unsigned mask, int bytes);
void warp_gather(const void* in, void* all, int bytes, const char* what);
unsigned char* dynamic_shared();
unsigned dynamic_shared_bytes();
[[noreturn]] void trap();
[[noreturn]] void fail(const char* what);  // a fault CUDA reports (the block is abandoned)
const char* launch(dim3 grid, dim3 block, unsigned shared_bytes,
                   const std::function<void()>& body);
}  // namespace sim

#define threadIdx sim::thread_idx
#define blockIdx sim::block_idx
#define blockDim sim::block_dim
#define gridDim sim::grid_dim
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)  // registers: nothing to bound on the CPU
#define __shared__ static  // one block runs at a time: a static is that block's shared memory

inline void __syncthreads() { sim::syncthreads(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { sim::syncwarp(mask); }
inline void __trap() { sim::trap(); }

template <class T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_xor) {
    static_assert(sizeof(T) <= 8, "shuffle of more than 8 bytes");
    T r;
    sim::warp_exchange(&v, &r, lane_xor, mask, sizeof(T));
    return r;
}

inline float atomicAdd(float* p, float v) {  // fibers never run at once: a plain add is atomic
    float old = *p;
    *p = old + v;
    return old;
}

inline float __fmul_rn(float a, float b) { return a * b; }  // (g++ contracts no FMA here)

inline int atomicAdd(int* p, int v) {
    int old = *p;
    *p = old + v;
    return old;
}

inline void __threadfence() {}  // one block at a time: every write is already visible
template <class T>
inline T __ldcg(const T* p) { return *p; }
struct alignas(16) float4 { float x, y, z, w; };  // CUDA's vector type (16-byte loads)

// CUDA's bit casts between float and its 32 bits
inline unsigned __float_as_uint(float f) {
    unsigned u;
    memcpy(&u, &f, 4);
    return u;
}

inline float __uint_as_float(unsigned u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

inline float __int_as_float(int i) { return __uint_as_float((unsigned)i); }

#include "sim_mma.h"
