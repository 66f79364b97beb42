// AVX2 path of the Music Transformer skew and its adjoint (Huang et al. 2018):
//   skew:           y[n, i, j] = x[n, i, skew_col(i, j)]          (causal: zero for j > i)
//   skew_backward:  dx[n, i, skew_col(i, j)] = dy[n, i, j]        (zero elsewhere)
// skew_col(i, j) = j - i + Lq - 1 grows by one per key, so each row is one contiguous copy plus a
// zero fill; memcpy/memset (glibc's vectorised versions) do the moving. Work items: rows (n, i).
#include <cstring>

#include "common/relpos_index.h"
#include "cpu/kernels.h"
#include "cpu/vec_avx2.h"

namespace relpos::cpu::avx2 {
namespace {

// Keys [0, visible) of row i are copied; the rest of an output row is zero (causal only).
inline int64_t visible_keys(const SkewParams& p, int64_t i) {
  return p.causal ? imin(i + 1, p.k_len) : p.k_len;
}

template <typename T>
void skew_rows(const SkewParams& p, int64_t begin, int64_t end) {
  const T* x = static_cast<const T*>(p.in);
  T* y = static_cast<T*>(p.out);
  const int64_t width = p.causal ? p.k_len : skew_width(p.q_len, p.k_len);
  for (int64_t item = begin; item < end; ++item) {
    const int64_t i = item % p.q_len;
    const int64_t n = visible_keys(p, i);
    T* yr = y + item * p.k_len;
    std::memcpy(yr, x + item * width + skew_col(i, 0, p.q_len), sizeof(T) * n);
    std::memset(yr + n, 0, sizeof(T) * (p.k_len - n));
  }
}

template <typename T>
void unskew_rows(const SkewParams& p, int64_t begin, int64_t end) {
  const T* dy = static_cast<const T*>(p.in);
  T* dx = static_cast<T*>(p.out);
  const int64_t width = p.causal ? p.k_len : skew_width(p.q_len, p.k_len);
  for (int64_t item = begin; item < end; ++item) {
    const int64_t i = item % p.q_len;
    const int64_t n = visible_keys(p, i);
    const int64_t c0 = skew_col(i, 0, p.q_len);
    T* xr = dx + item * width;
    std::memset(xr, 0, sizeof(T) * c0);
    std::memcpy(xr + c0, dy + item * p.k_len, sizeof(T) * n);
    std::memset(xr + c0 + n, 0, sizeof(T) * (width - c0 - n));
  }
}

}  // namespace

void skew(const SkewParams& p, int64_t begin, int64_t end) {
  dispatch(p.dtype, [&](auto tag) { skew_rows<decltype(tag)>(p, begin, end); });
}

void skew_backward(const SkewParams& p, int64_t begin, int64_t end) {
  dispatch(p.dtype, [&](auto tag) { unskew_rows<decltype(tag)>(p, begin, end); });
}

}  // namespace relpos::cpu::avx2
