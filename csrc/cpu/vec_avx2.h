// AVX2 helpers shared by the *_avx2.cpp kernels: 8-lane float32 loads and stores from float32,
// float16 and bfloat16 storage, scalar conversions for tails, per-thread scratch buffers and the
// dtype dispatch. Included only by files compiled with -mavx2 -mfma -mf16c.
//
// ODR: everything here has internal linkage (anonymous namespace), and the AVX2 files use no std
// templates that the scalar (torch) translation units also instantiate (std::vector, std::fill,
// std::min, ...). An inline function or template instance compiled with -mavx2 is a weak symbol
// the linker may pick for the scalar path too; `nm -C --defined-only *_avx2.cpp.o | grep ' W '`
// must stay empty.
//
// Rounding matches c10: float -> half is IEEE round-to-nearest-even (F16C, as c10::Half on x86);
// float -> bfloat16 is c10::BFloat16's round_to_nearest_even (bias 0x7FFF + lsb, NaN -> 0x7FC0).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "common/params.h"

namespace relpos::cpu::avx2 {
namespace {

// Storage types of the 16-bit dtypes (distinct types so overloads pick the right conversion).
struct half_t {
  uint16_t x;
};
struct bf16_t {
  uint16_t x;
};
static_assert(sizeof(half_t) == 2 && sizeof(bf16_t) == 2);

inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }

// ---- scalar conversions (tails) ------------------------------------------------------------
inline float to_f32(float v) { return v; }
inline float to_f32(half_t v) { return _cvtsh_ss(v.x); }
inline float to_f32(bf16_t v) {
  const uint32_t u = uint32_t(v.x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <typename T>
inline T from_f32(float v);
template <>
inline float from_f32<float>(float v) {
  return v;
}
template <>
inline half_t from_f32<half_t>(float v) {
  return half_t{static_cast<uint16_t>(_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))};
}
template <>
inline bf16_t from_f32<bf16_t>(float v) {
  if (v != v) return bf16_t{0x7FC0};
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return bf16_t{static_cast<uint16_t>((u + ((u >> 16) & 1) + 0x7FFFu) >> 16)};
}

// ---- 8-lane loads and stores -----------------------------------------------------------------
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const half_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const bf16_t* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

// c10's float -> bfloat16 rounding of 8 lanes, each result in the low 16 bits of its lane.
inline __m256i bf16_round_bits(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  r = _mm256_srli_epi32(r, 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
}
inline __m128i bf16_round8(__m256 v) {
  const __m256i r = bf16_round_bits(v);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(half_t* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline void store8(bf16_t* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16_round8(v));
}

// 16 values as two 8-lane vectors, for element-wise work: `lo` and `hi` hold the values in an
// order of the storage type's choosing (bfloat16: elements 0-3, 8-11 and 4-7, 12-15, which one
// 256-bit load and two unpacks give), and store16 writes them back in the same order. Adjacent
// even/odd pairs stay adjacent, even elements in even lanes.
inline void load16(const float* p, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(p);
  hi = _mm256_loadu_ps(p + 8);
}
inline void load16(const half_t* p, __m256& lo, __m256& hi) {
  lo = load8(p);
  hi = load8(p + 8);
}
inline void load16(const bf16_t* p, __m256& lo, __m256& hi) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i zero = _mm256_setzero_si256();
  lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, w));
  hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, w));
}
inline void store16(float* p, __m256 lo, __m256 hi) {
  _mm256_storeu_ps(p, lo);
  _mm256_storeu_ps(p + 8, hi);
}
inline void store16(half_t* p, __m256 lo, __m256 hi) {
  store8(p, lo);
  store8(p + 8, hi);
}
inline void store16(bf16_t* p, __m256 lo, __m256 hi) {
  // packus works per 128-bit lane: (lo 0-3, hi 4-7 | lo 8-11, hi 12-15), the order load16 took
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm256_packus_epi32(bf16_round_bits(lo), bf16_round_bits(hi)));
}

// The first n (< 8) lanes; the others load as zero / are not written.
template <typename T>
inline __m256 load_n(const T* p, int64_t n) {
  T tmp[8] = {};
  std::memcpy(tmp, p, sizeof(T) * n);
  return load8(tmp);
}
template <typename T>
inline void store_n(T* p, __m256 v, int64_t n) {
  T tmp[8];
  store8(tmp, v);
  std::memcpy(p, tmp, sizeof(T) * n);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// dst[0, n) = convert(src[0, n)), float32 source.
template <typename T>
inline void convert_store(T* dst, const float* src, int64_t n) {
  int64_t k = 0;
  for (; k + 32 <= n; k += 32) {
    store8(dst + k, _mm256_loadu_ps(src + k));
    store8(dst + k + 8, _mm256_loadu_ps(src + k + 8));
    store8(dst + k + 16, _mm256_loadu_ps(src + k + 16));
    store8(dst + k + 24, _mm256_loadu_ps(src + k + 24));
  }
  for (; k + 8 <= n; k += 8) store8(dst + k, _mm256_loadu_ps(src + k));
  for (; k < n; ++k) dst[k] = from_f32<T>(src[k]);
}

// dst[0, n) = float(src[0, n)).
template <typename T>
inline void convert_load(float* dst, const T* src, int64_t n) {
  int64_t k = 0;
  for (; k + 32 <= n; k += 32) {
    _mm256_storeu_ps(dst + k, load8(src + k));
    _mm256_storeu_ps(dst + k + 8, load8(src + k + 8));
    _mm256_storeu_ps(dst + k + 16, load8(src + k + 16));
    _mm256_storeu_ps(dst + k + 24, load8(src + k + 24));
  }
  for (; k + 8 <= n; k += 8) _mm256_storeu_ps(dst + k, load8(src + k));
  for (; k < n; ++k) dst[k] = to_f32(src[k]);
}

// sum of float(src[0, n)), four 8-lane accumulators.
template <typename T>
inline float sum_n(const T* src, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t k = 0;
  for (; k + 32 <= n; k += 32) {
    a0 = _mm256_add_ps(a0, load8(src + k));
    a1 = _mm256_add_ps(a1, load8(src + k + 8));
    a2 = _mm256_add_ps(a2, load8(src + k + 16));
    a3 = _mm256_add_ps(a3, load8(src + k + 24));
  }
  for (; k + 8 <= n; k += 8) a0 = _mm256_add_ps(a0, load8(src + k));
  if (k < n) a1 = _mm256_add_ps(a1, load_n(src + k, n - k));
  return hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}

// dst[0, n) = v, with v already in the storage type.
inline void fill_f32(float* dst, float v, int64_t n) {
  const __m256 x = _mm256_set1_ps(v);
  int64_t k = 0;
  for (; k + 32 <= n; k += 32) {
    _mm256_storeu_ps(dst + k, x);
    _mm256_storeu_ps(dst + k + 8, x);
    _mm256_storeu_ps(dst + k + 16, x);
    _mm256_storeu_ps(dst + k + 24, x);
  }
  for (; k + 8 <= n; k += 8) _mm256_storeu_ps(dst + k, x);
  for (; k < n; ++k) dst[k] = v;
}
inline void fill_u16(uint16_t* dst, uint16_t v, int64_t n) {
  const __m256i x = _mm256_set1_epi16(static_cast<short>(v));
  int64_t k = 0;
  for (; k + 64 <= n; k += 64) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + k), x);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + k + 16), x);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + k + 32), x);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + k + 48), x);
  }
  for (; k + 16 <= n; k += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + k), x);
  for (; k < n; ++k) dst[k] = v;
}
inline void fill(float* dst, float v, int64_t n) { fill_f32(dst, v, n); }
inline void fill(half_t* dst, half_t v, int64_t n) {
  fill_u16(reinterpret_cast<uint16_t*>(dst), v.x, n);
}
inline void fill(bf16_t* dst, bf16_t v, int64_t n) {
  fill_u16(reinterpret_cast<uint16_t*>(dst), v.x, n);
}

// Flush-to-zero and denormals-are-zero (MXCSR bits 15 and 6) on this thread for a scope, the
// caller's MXCSR restored on exit. A denormal operand or result of an FMA takes a microcode
// assist: with 1% of a 64 x 64 x 64 block's A operand denormal, gemm's AVX-512 block fell from
// 169 to 50 GFLOP/s (0.1%: 129). The attention kernels make such values themselves, so they
// flush them: P = 2^x is denormal for x in (-126.5, -126) below the row maximum, and dS = scale
// P (dP - D_i) for a wider range of small P. Their magnitude is below 2^-126 (1.2e-38), so 0 is
// as good an answer in float32. Queries scaled by 20 (logits spread over hundreds of units),
// L = 2048, B = 1, H = 8, D = 64, K = 64, 2 threads, 3 alternating runs: forward 72-94 -> 43 ms,
// forward+backward 258-266 -> 132-145 ms; unscaled inputs within the noise (39 and 130 ms).
class FlushDenormals {
 public:
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040u); }
  ~FlushDenormals() { _mm_setcsr(saved_); }
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;

 private:
  unsigned saved_;
};

// n floats in whole 64-byte lines: the bytes a 64-byte aligned buffer of n floats takes.
inline int64_t aligned_float_bytes(int64_t n) { return ((n * int64_t(sizeof(float)) + 63) / 64) * 64; }

// `bytes` (a multiple of 64) from the heap, 64-byte aligned; std::free releases it. Aborts when
// the heap is out: the kernels run inside parallel regions, where nothing may throw.
inline void* alloc_aligned64(int64_t bytes) {
  void* p = std::aligned_alloc(64, static_cast<size_t>(bytes));
  if (p == nullptr) std::abort();
  return p;
}

// A per-thread, 64-byte aligned, growable float buffer (contents are not preserved on growth).
class Scratch {
 public:
  ~Scratch() { std::free(p_); }
  float* get(int64_t n) {
    if (n > cap_) {
      std::free(p_);
      p_ = static_cast<float*>(alloc_aligned64(aligned_float_bytes(n)));
      cap_ = n;
    }
    return p_;
  }

 private:
  float* p_ = nullptr;
  int64_t cap_ = 0;
};

// f(T{}) with T the storage type of `dtype` (float32, float16 or bfloat16).
template <typename F>
inline void dispatch(DType dtype, F&& f) {
  switch (dtype) {
    case DType::Float32: f(float{}); return;
    case DType::Float16: f(half_t{}); return;
    case DType::BFloat16: f(bf16_t{}); return;
    case DType::Float64: break;
  }
  std::abort();  // the glue never routes float64 here (cpu/register_cpu.cpp)
}

inline __m256i tail_mask(int64_t n) {  // lanes [0, n) of 8 enabled
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), idx);
}

// The register type of the matmul blocks (gemm_block in rel_attention_avx2.cpp, tile_kernel in
// rel_logits_avx2.cpp) and of exp2v: 8-lane AVX2, or 16-lane AVX-512 where those files are
// compiled a second time with AVX-512 flags (*_avx512.cpp). Every operation is lane by lane
// the same at both widths, so a lane's result does not depend on the width. The other loops
// there stay 8 lanes wide in both, but for the one-pass softmax rows of rel_attention_avx2.cpp
// (16 lanes under __AVX512F__).
struct Ymm {
  using reg = __m256;
  using mask = __m256i;
  static constexpr int64_t kLanes = 8;
  static mask tail(int64_t n) { return tail_mask(imin(imax(n, 0), 8)); }
  static reg zero() { return _mm256_setzero_ps(); }
  static reg load(const float* p) { return _mm256_loadu_ps(p); }
  static reg load(const float* p, mask m) { return _mm256_maskload_ps(p, m); }
  static void store(float* p, reg v) { _mm256_storeu_ps(p, v); }
  static void store(float* p, mask m, reg v) { _mm256_maskstore_ps(p, m, v); }
  static reg bcast(const float* p) { return _mm256_broadcast_ss(p); }
  static reg fma(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static reg set1(float v) { return _mm256_set1_ps(v); }
  static reg sub(reg a, reg b) { return _mm256_sub_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static reg min(reg a, reg b) { return _mm256_min_ps(a, b); }
  static reg max(reg a, reg b) { return _mm256_max_ps(a, b); }
  static reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
  // the bits of x shifted left by 23: a float whose exponent field is x's low 9 bits (exp2v)
  static reg shl23(reg x) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(x), 23)); }
};
#if defined(__AVX512F__)
struct Zmm {
  using reg = __m512;
  using mask = __mmask16;
  static constexpr int64_t kLanes = 16;
  static mask tail(int64_t n) { return n >= 16 ? mask(0xFFFF) : n <= 0 ? mask(0) : mask((1u << n) - 1); }
  static reg zero() { return _mm512_setzero_ps(); }
  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  static reg load(const float* p, mask m) { return _mm512_maskz_loadu_ps(m, p); }
  static void store(float* p, reg v) { _mm512_storeu_ps(p, v); }
  static void store(float* p, mask m, reg v) { _mm512_mask_storeu_ps(p, m, v); }
  static reg bcast(const float* p) { return _mm512_set1_ps(*p); }
  static reg fma(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static reg set1(float v) { return _mm512_set1_ps(v); }
  static reg sub(reg a, reg b) { return _mm512_sub_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static reg min(reg a, reg b) { return _mm512_min_ps(a, b); }  // NaN rule as vminps ymm
  static reg max(reg a, reg b) { return _mm512_max_ps(a, b); }
  static reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
  static reg shl23(reg x) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_castps_si512(x), 23)); }
};
using MatmulVec = Zmm;
#else
using MatmulVec = Ymm;
#endif

}  // namespace
}  // namespace relpos::cpu::avx2
