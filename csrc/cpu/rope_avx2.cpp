// AVX2 path of rope (rotary position embedding; RopeParams in common/params.h), float32
// arithmetic on float32, float16 and bfloat16 storage. Work items: rows of x.
//   half-split: eight pairs (f, f + rot/2) at a time, from two 8-lane loads of each operand;
//   interleaved: four pairs (2f, 2f + 1) per 8-lane load, the partner swapped in by a lane
//   permute and the signs applied by addsub (minus in the even lanes, plus in the odd ones).
// No fused multiply-adds: each output is two rounded products and their sum or difference, as in
// the scalar path and in transformers' x * cos + rotate_half(x) * sin, so float32 results are
// bitwise theirs (the op is memory-bound; the FMA would save nothing measurable).
#include <cstring>

#include "common/relpos_index.h"
#include "cpu/kernels.h"
#include "cpu/vec_avx2.h"

namespace relpos::cpu::avx2 {
namespace {

inline __m256 swap_pairs(__m256 v) { return _mm256_permute_ps(v, 0xB1); }  // lanes 1,0,3,2,...
inline __m256 negate(__m256 v) { return _mm256_xor_ps(v, _mm256_set1_ps(-0.0f)); }

// The first n <= 8 lanes (the others load as zero / are not written).
template <typename T>
inline __m256 load_upto8(const T* p, int64_t n) { return n == 8 ? load8(p) : load_n(p, n); }
template <typename T>
inline void store_upto8(T* p, __m256 v, int64_t n) {
  if (n == 8) {
    store8(p, v);
  } else {
    store_n(p, v, n);
  }
}

// Pairs (f, f + h) for f in [f0, f0 + n), n <= 8.
template <typename T>
inline void half_split8(const T* x, const T* c, const T* s, T* y, int64_t f0, int64_t h, int64_t n,
                        bool inverse) {
  const __m256 xa = load_upto8(x + f0, n), xb = load_upto8(x + f0 + h, n);
  const __m256 ca = load_upto8(c + f0, n), cb = load_upto8(c + f0 + h, n);
  const __m256 sa = load_upto8(s + f0, n), sb = load_upto8(s + f0 + h, n);
  // products rounded before the sum, as the scalar path and transformers' eager code
  const __m256 xaca = _mm256_mul_ps(xa, ca), xbcb = _mm256_mul_ps(xb, cb);
  const __m256 ya = inverse ? _mm256_add_ps(xaca, _mm256_mul_ps(xb, sb))
                            : _mm256_sub_ps(xaca, _mm256_mul_ps(xb, sa));
  const __m256 yb = inverse ? _mm256_sub_ps(xbcb, _mm256_mul_ps(xa, sa))
                            : _mm256_add_ps(xbcb, _mm256_mul_ps(xa, sb));
  store_upto8(y + f0, ya, n);
  store_upto8(y + f0 + h, yb, n);
}

// Features [k0, k0 + n) of an interleaved row, n <= 8 and even.
template <typename T>
inline void interleaved8(const T* x, const T* c, const T* s, T* y, int64_t k0, int64_t n,
                         bool inverse) {
  const __m256 xv = load_upto8(x + k0, n), cv = load_upto8(c + k0, n), sv = load_upto8(s + k0, n);
  const __m256 xc = _mm256_mul_ps(xv, cv);
  // forward: even lanes x[a] c[a] - x[b] s[a], odd lanes x[b] c[b] + x[a] s[b];
  // inverse: even lanes x[a] c[a] + x[b] s[b], odd lanes x[b] c[b] - x[a] s[a].
  const __m256 yv = inverse ? _mm256_addsub_ps(xc, negate(swap_pairs(_mm256_mul_ps(xv, sv))))
                            : _mm256_addsub_ps(xc, _mm256_mul_ps(swap_pairs(xv), sv));
  store_upto8(y + k0, yv, n);
}

template <typename T>
void rope_rows(const RopeParams& p, int64_t begin, int64_t end) {
  const T* x = static_cast<const T*>(p.x);
  const T* cos = static_cast<const T*>(p.cos);
  const T* sin = static_cast<const T*>(p.sin);
  T* out = static_cast<T*>(p.out);
  const int64_t h = p.rot / 2;
  for (int64_t row = begin; row < end; ++row) {
    const T* xr = x + row * p.dim;
    T* yr = out + row * p.dim;
    const int64_t co = rope_cos_offset(row, p.n1, p.n2, p.cs0, p.cs1, p.cs2);
    if (p.interleaved) {
      for (int64_t k = 0; k < p.rot; k += 8) {
        interleaved8(xr, cos + co, sin + co, yr, k, imin(8, p.rot - k), p.inverse);
      }
    } else {
      for (int64_t f = 0; f < h; f += 8) {
        half_split8(xr, cos + co, sin + co, yr, f, h, imin(8, h - f), p.inverse);
      }
    }
    std::memcpy(yr + p.rot, xr + p.rot, sizeof(T) * (p.dim - p.rot));
  }
}

}  // namespace

void rope(const RopeParams& p, int64_t begin, int64_t end) {
  dispatch(p.dtype, [&](auto tag) { rope_rows<decltype(tag)>(p, begin, end); });
}

}  // namespace relpos::cpu::avx2
