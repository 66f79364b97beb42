// CUDA device functions as host C++: atomics, fences, read-only loads, bit tricks, the intrinsic
// math functions and CUDA's global min/max. The C math library (expf, fmaxf, INFINITY, ...) is
// the host's own <math.h>.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <math.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

// ---- atomics ---------------------------------------------------------------------------------
// Only one kernel thread runs at a time and it is switched out only at a synchronisation point,
// so a plain read-modify-write is atomic. The order of the updates still varies with the seed,
// because blocks and threads run in shuffled order.
namespace relpos_emu::detail {

template <typename T, typename Op>
T atomic_update(T* address, Op op) {
  const T old = *address;
  *address = op(old);
  return old;
}

}  // namespace relpos_emu::detail

#define RELPOS_EMU_ATOMIC(name, T, expr)                                                  \
  inline T name(T* address, T val) {                                                      \
    return relpos_emu::detail::atomic_update(address,                                     \
                                             [val]([[maybe_unused]] T old) { return expr; }); \
  }

RELPOS_EMU_ATOMIC(atomicAdd, int, old + val)
RELPOS_EMU_ATOMIC(atomicAdd, unsigned int, old + val)
RELPOS_EMU_ATOMIC(atomicAdd, unsigned long long, old + val)
RELPOS_EMU_ATOMIC(atomicAdd, float, old + val)
RELPOS_EMU_ATOMIC(atomicAdd, double, old + val)
RELPOS_EMU_ATOMIC(atomicAdd, __half, __float2half_rn(__half2float(old) + __half2float(val)))
RELPOS_EMU_ATOMIC(atomicAdd, __nv_bfloat16,
                  __float2bfloat16_rn(__bfloat162float(old) + __bfloat162float(val)))
RELPOS_EMU_ATOMIC(atomicSub, int, old - val)
RELPOS_EMU_ATOMIC(atomicSub, unsigned int, old - val)
RELPOS_EMU_ATOMIC(atomicExch, int, val)
RELPOS_EMU_ATOMIC(atomicExch, unsigned int, val)
RELPOS_EMU_ATOMIC(atomicExch, unsigned long long, val)
RELPOS_EMU_ATOMIC(atomicExch, float, val)
RELPOS_EMU_ATOMIC(atomicMin, int, val < old ? val : old)
RELPOS_EMU_ATOMIC(atomicMin, unsigned int, val < old ? val : old)
RELPOS_EMU_ATOMIC(atomicMin, long long, val < old ? val : old)
RELPOS_EMU_ATOMIC(atomicMin, unsigned long long, val < old ? val : old)
RELPOS_EMU_ATOMIC(atomicMax, int, val > old ? val : old)
RELPOS_EMU_ATOMIC(atomicMax, unsigned int, val > old ? val : old)
RELPOS_EMU_ATOMIC(atomicMax, long long, val > old ? val : old)
RELPOS_EMU_ATOMIC(atomicMax, unsigned long long, val > old ? val : old)
RELPOS_EMU_ATOMIC(atomicAnd, int, old & val)
RELPOS_EMU_ATOMIC(atomicAnd, unsigned int, old & val)
RELPOS_EMU_ATOMIC(atomicAnd, unsigned long long, old & val)
RELPOS_EMU_ATOMIC(atomicOr, int, old | val)
RELPOS_EMU_ATOMIC(atomicOr, unsigned int, old | val)
RELPOS_EMU_ATOMIC(atomicOr, unsigned long long, old | val)
RELPOS_EMU_ATOMIC(atomicXor, int, old ^ val)
RELPOS_EMU_ATOMIC(atomicXor, unsigned int, old ^ val)
RELPOS_EMU_ATOMIC(atomicXor, unsigned long long, old ^ val)

#undef RELPOS_EMU_ATOMIC

#define RELPOS_EMU_ATOMIC_CAS(T)                                                               \
  inline T atomicCAS(T* address, T compare, T val) {                                           \
    return relpos_emu::detail::atomic_update(address,                                          \
                                             [=](T old) { return old == compare ? val : old; }); \
  }

RELPOS_EMU_ATOMIC_CAS(unsigned short)
RELPOS_EMU_ATOMIC_CAS(int)
RELPOS_EMU_ATOMIC_CAS(unsigned int)
RELPOS_EMU_ATOMIC_CAS(unsigned long long)

#undef RELPOS_EMU_ATOMIC_CAS

// ---- memory ----------------------------------------------------------------------------------
// Fences order nothing here: threads never run concurrently.
inline void __threadfence_block() {}
inline void __threadfence() {}
inline void __threadfence_system() {}

template <typename T>
inline T __ldg(const T* address) {
  return *address;
}

// ---- bits ------------------------------------------------------------------------------------
inline int __popc(unsigned int x) { return std::popcount(x); }
inline int __popcll(unsigned long long x) { return std::popcount(x); }
inline int __clz(int x) { return std::countl_zero(static_cast<unsigned int>(x)); }
inline int __clzll(long long x) { return std::countl_zero(static_cast<unsigned long long>(x)); }
inline int __ffs(int x) { return x == 0 ? 0 : std::countr_zero(static_cast<unsigned int>(x)) + 1; }
inline int __ffsll(long long x) {
  return x == 0 ? 0 : std::countr_zero(static_cast<unsigned long long>(x)) + 1;
}
inline unsigned int __brev(unsigned int x) {
  unsigned int r = 0;
  for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
  return r;
}
inline int __float_as_int(float x) { return std::bit_cast<int>(x); }
inline unsigned int __float_as_uint(float x) { return std::bit_cast<unsigned int>(x); }
inline float __int_as_float(int x) { return std::bit_cast<float>(x); }
inline float __uint_as_float(unsigned int x) { return std::bit_cast<float>(x); }
inline long long __double_as_longlong(double x) { return std::bit_cast<long long>(x); }
inline double __longlong_as_double(long long x) { return std::bit_cast<double>(x); }

// ---- float intrinsics ------------------------------------------------------------------------
// The fast approximations (__expf, __fdividef, ...) are computed exactly here; tests compare
// against references with tolerances that cover the device's approximation error.
inline float __fdividef(float x, float y) { return x / y; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return std::sqrt(x); }
inline float __fadd_rn(float x, float y) { return x + y; }
inline float __fsub_rn(float x, float y) { return x - y; }
inline float __fmul_rn(float x, float y) { return x * y; }
inline float __fdiv_rn(float x, float y) { return x / y; }
inline float __fmaf_rn(float x, float y, float z) { return std::fma(x, y, z); }
inline double __fma_rn(double x, double y, double z) { return std::fma(x, y, z); }
inline double __dadd_rn(double x, double y) { return x + y; }
inline double __dmul_rn(double x, double y) { return x * y; }
inline float __saturatef(float x) { return x > 0.0f ? (x < 1.0f ? x : 1.0f) : 0.0f; }  // NaN -> 0
inline int __float2int_rn(float x) { return static_cast<int>(std::nearbyint(x)); }
inline int __float2int_rz(float x) { return static_cast<int>(x); }
inline int __float2int_rd(float x) { return static_cast<int>(std::floor(x)); }
inline int __float2int_ru(float x) { return static_cast<int>(std::ceil(x)); }
inline float __int2float_rn(int x) { return static_cast<float>(x); }

// glibc's <math.h> declares __expf, __logf, ... as C functions but libm does not export them, so
// define them here, with C linkage to match that declaration and hidden so that this library does
// not export them either.
#define RELPOS_EMU_C_INTRINSIC extern "C" inline __attribute__((visibility("hidden")))
RELPOS_EMU_C_INTRINSIC float __expf(float x) noexcept { return expf(x); }
RELPOS_EMU_C_INTRINSIC float __exp10f(float x) noexcept { return powf(10.0f, x); }
RELPOS_EMU_C_INTRINSIC float __logf(float x) noexcept { return logf(x); }
RELPOS_EMU_C_INTRINSIC float __log2f(float x) noexcept { return log2f(x); }
RELPOS_EMU_C_INTRINSIC float __log10f(float x) noexcept { return log10f(x); }
RELPOS_EMU_C_INTRINSIC float __powf(float x, float y) noexcept { return powf(x, y); }
RELPOS_EMU_C_INTRINSIC float __sinf(float x) noexcept { return sinf(x); }
RELPOS_EMU_C_INTRINSIC float __cosf(float x) noexcept { return cosf(x); }
RELPOS_EMU_C_INTRINSIC float __tanf(float x) noexcept { return tanf(x); }
RELPOS_EMU_C_INTRINSIC void __sincosf(float x, float* s, float* c) noexcept {
  *s = sinf(x);
  *c = cosf(x);
}
#undef RELPOS_EMU_C_INTRINSIC

// ---- min / max -------------------------------------------------------------------------------
// CUDA declares these overloads in the global namespace (crt/math_functions.hpp); mixed
// signed/unsigned pairs compare as unsigned and mixed float/double as double, as there.
#define RELPOS_EMU_MIN_MAX(R, A, B)                                                  \
  inline R min(A a, B b) {                                                           \
    const R x = static_cast<R>(a), y = static_cast<R>(b);                            \
    return y < x ? y : x;                                                            \
  }                                                                                  \
  inline R max(A a, B b) {                                                           \
    const R x = static_cast<R>(a), y = static_cast<R>(b);                            \
    return x < y ? y : x;                                                            \
  }

RELPOS_EMU_MIN_MAX(int, int, int)
RELPOS_EMU_MIN_MAX(unsigned int, unsigned int, unsigned int)
RELPOS_EMU_MIN_MAX(unsigned int, int, unsigned int)
RELPOS_EMU_MIN_MAX(unsigned int, unsigned int, int)
RELPOS_EMU_MIN_MAX(long, long, long)
RELPOS_EMU_MIN_MAX(unsigned long, unsigned long, unsigned long)
RELPOS_EMU_MIN_MAX(unsigned long, long, unsigned long)
RELPOS_EMU_MIN_MAX(unsigned long, unsigned long, long)
RELPOS_EMU_MIN_MAX(long long, long long, long long)
RELPOS_EMU_MIN_MAX(unsigned long long, unsigned long long, unsigned long long)
RELPOS_EMU_MIN_MAX(unsigned long long, long long, unsigned long long)
RELPOS_EMU_MIN_MAX(unsigned long long, unsigned long long, long long)
#undef RELPOS_EMU_MIN_MAX

// The floating-point ones follow fminf/fmaxf: a NaN operand yields the other operand.
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }
inline double min(float a, double b) { return fmin(a, b); }
inline double max(float a, double b) { return fmax(a, b); }
inline double min(double a, float b) { return fmin(a, b); }
inline double max(double a, float b) { return fmax(a, b); }
