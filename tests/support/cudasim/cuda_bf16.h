// cudasim's cuda_bf16.h (g++ finds it before any CUDA toolkit's): the part of CUDA's bf16
// type the kernels use, with CUDA's semantics. __nv_bfloat16 is 16 bits, the top half of a
// float; float to bf16 rounds to the nearest, ties to even, and a NaN becomes CUDA's
// canonical 0x7fff; bf16 to float is exact.
#pragma once
#include <stdint.h>

namespace sim {
inline unsigned short float_to_bf16_bits(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;     // NaN
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);  // overflow: to inf
}
}  // namespace sim

struct __nv_bfloat16 {
    unsigned short __x;
    __nv_bfloat16() = default;
    __nv_bfloat16(float f) : __x(sim::float_to_bf16_bits(f)) {}  // as CUDA's: to nearest
    operator float() const { return __uint_as_float((unsigned)__x << 16); }
};
static_assert(sizeof(__nv_bfloat16) == 2, "bf16 is 16 bits");

struct __nv_bfloat162 {
    __nv_bfloat16 x, y;
};

inline float __bfloat162float(__nv_bfloat16 h) { return (float)h; }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __float2bfloat16_rz(float f) {  // toward zero: the top half as it is
    __nv_bfloat16 h;
    h.__x = (f != f) ? 0x7fffu : (unsigned short)(__float_as_uint(f) >> 16);
    return h;
}
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short s) {
    __nv_bfloat16 h;
    h.__x = s;
    return h;
}
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return {a, b}; }
inline __nv_bfloat162 __float2bfloat162_rn(float a) { return {a, a}; }
inline float __low2float(__nv_bfloat162 h) { return (float)h.x; }
inline float __high2float(__nv_bfloat162 h) { return (float)h.y; }
