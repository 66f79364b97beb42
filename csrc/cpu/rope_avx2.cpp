// AVX2 path of rope (rotary position embedding; RopeParams in common/params.h), float32
// arithmetic on float32, float16 and bfloat16 storage. Work items: rows of x.
//   half-split: sixteen pairs (f, f + rot/2) at a time (then eight, then a tail), from load16 of
//   each operand at f and at f + rot/2;
//   interleaved: eight pairs (2f, 2f + 1) per load16 (then four), the partner swapped in by a
//   lane permute and the signs applied by addsub (minus in the even lanes, plus in the odd ones).
// 16 at a time: for bfloat16 one 256-bit load, two unpacks and one pack per 16 values instead of
// two widening loads, two shifts and two 128-bit packs. Llama's shapes, one thread, medians of 3
// alternating runs: bfloat16 11% faster, interleaved 29%; float16 interleaved 15%; the others
// within the noise.
// No fused multiply-adds: each output is two rounded products and their sum or difference, as in
// the scalar path and in transformers' x * cos + rotate_half(x) * sin, so float32 results are
// bitwise theirs (float32 is memory-bound, and the 16-bit dtypes spend their time converting).
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

// One 8-lane block of pairs: (ya, yb) from (xa, xb) and their cos/sin. Products are rounded
// before the sum, as in the scalar path and transformers' eager code.
inline void rotate_pairs(__m256 xa, __m256 xb, __m256 ca, __m256 cb, __m256 sa, __m256 sb,
                         bool inverse, __m256& ya, __m256& yb) {
  const __m256 xaca = _mm256_mul_ps(xa, ca), xbcb = _mm256_mul_ps(xb, cb);
  ya = inverse ? _mm256_add_ps(xaca, _mm256_mul_ps(xb, sb))
               : _mm256_sub_ps(xaca, _mm256_mul_ps(xb, sa));
  yb = inverse ? _mm256_sub_ps(xbcb, _mm256_mul_ps(xa, sa))
               : _mm256_add_ps(xbcb, _mm256_mul_ps(xa, sb));
}

// One 8-lane block of an interleaved row (pairs in lanes (2i, 2i + 1)):
// forward: even lanes x[a] c[a] - x[b] s[a], odd lanes x[b] c[b] + x[a] s[b];
// inverse: even lanes x[a] c[a] + x[b] s[b], odd lanes x[b] c[b] - x[a] s[a].
inline __m256 rotate_interleaved(__m256 xv, __m256 cv, __m256 sv, bool inverse) {
  const __m256 xc = _mm256_mul_ps(xv, cv);
  return inverse ? _mm256_addsub_ps(xc, negate(swap_pairs(_mm256_mul_ps(xv, sv))))
                 : _mm256_addsub_ps(xc, _mm256_mul_ps(swap_pairs(xv), sv));
}

// Pairs (f, f + h) for f in [f0, f0 + 16).
template <typename T>
inline void half_split16(const T* x, const T* c, const T* s, T* y, int64_t f0, int64_t h,
                         bool inverse) {
  __m256 xa[2], xb[2], ca[2], cb[2], sa[2], sb[2], ya[2], yb[2];
  load16(x + f0, xa[0], xa[1]);
  load16(x + f0 + h, xb[0], xb[1]);
  load16(c + f0, ca[0], ca[1]);
  load16(c + f0 + h, cb[0], cb[1]);
  load16(s + f0, sa[0], sa[1]);
  load16(s + f0 + h, sb[0], sb[1]);
  for (int i = 0; i < 2; ++i) {
    rotate_pairs(xa[i], xb[i], ca[i], cb[i], sa[i], sb[i], inverse, ya[i], yb[i]);
  }
  store16(y + f0, ya[0], ya[1]);
  store16(y + f0 + h, yb[0], yb[1]);
}

// Pairs (f, f + h) for f in [f0, f0 + n), n <= 8.
template <typename T>
inline void half_split8(const T* x, const T* c, const T* s, T* y, int64_t f0, int64_t h, int64_t n,
                        bool inverse) {
  __m256 ya, yb;
  rotate_pairs(load_upto8(x + f0, n), load_upto8(x + f0 + h, n), load_upto8(c + f0, n),
               load_upto8(c + f0 + h, n), load_upto8(s + f0, n), load_upto8(s + f0 + h, n),
               inverse, ya, yb);
  store_upto8(y + f0, ya, n);
  store_upto8(y + f0 + h, yb, n);
}

// Features [k0, k0 + 16) of an interleaved row (load16's order keeps pairs in adjacent lanes).
template <typename T>
inline void interleaved16(const T* x, const T* c, const T* s, T* y, int64_t k0, bool inverse) {
  __m256 xv[2], cv[2], sv[2];
  load16(x + k0, xv[0], xv[1]);
  load16(c + k0, cv[0], cv[1]);
  load16(s + k0, sv[0], sv[1]);
  store16(y + k0, rotate_interleaved(xv[0], cv[0], sv[0], inverse),
          rotate_interleaved(xv[1], cv[1], sv[1], inverse));
}

// Features [k0, k0 + n) of an interleaved row, n <= 8 and even.
template <typename T>
inline void interleaved8(const T* x, const T* c, const T* s, T* y, int64_t k0, int64_t n,
                         bool inverse) {
  store_upto8(y + k0, rotate_interleaved(load_upto8(x + k0, n), load_upto8(c + k0, n),
                                         load_upto8(s + k0, n), inverse), n);
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
      int64_t k = 0;
      for (; k + 16 <= p.rot; k += 16) interleaved16(xr, cos + co, sin + co, yr, k, p.inverse);
      for (; k < p.rot; k += 8) {
        interleaved8(xr, cos + co, sin + co, yr, k, imin(8, p.rot - k), p.inverse);
      }
    } else {
      int64_t f = 0;
      for (; f + 16 <= h; f += 16) half_split16(xr, cos + co, sin + co, yr, f, h, p.inverse);
      for (; f < h; f += 8) {
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
