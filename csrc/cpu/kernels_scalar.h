// Scalar CPU kernels: the portable path for every dtype (float64 for gradcheck) and the
// readable statement of what the AVX2 and CUDA kernels must reproduce. Work items: see kernels.h.
// Arithmetic is in at::opmath_type (float for half/bfloat16, double for double).
#pragma once

#include <ATen/OpMathType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "common/params.h"
#include "common/relpos_index.h"
#include "cpu/kernels.h"

namespace relpos::cpu::scalar {

// out[h, i, j, :] = table[h, b(i, j), :]
template <typename T>
void rel_gather(const RelGatherParams& p, int64_t begin, int64_t end) {
  const T* table = static_cast<const T*>(p.table);
  T* out = static_cast<T*>(p.out);
  const int64_t rows = num_buckets(p.max_distance);
  for (int64_t item = begin; item < end; ++item) {
    const int64_t h = item / p.q_len, i = item % p.q_len;
    const T* tab = table + h * rows * p.dim;
    T* o = out + item * p.k_len * p.dim;
    for (int64_t j = 0; j < p.k_len; ++j) {
      const int64_t b = shaw_bucket(i, j, p.max_distance, p.q_offset, p.k_offset);
      std::memcpy(o + j * p.dim, tab + b * p.dim, sizeof(T) * p.dim);
    }
  }
}

// dtable[h, b, d] = sum over (i, j) with b(i, j) = b of grad[h, i, j, d], summed in (i, j) order
// so the result does not depend on the thread count.
template <typename T>
void rel_gather_backward(const RelGatherBwdParams& p, int64_t begin, int64_t end) {
  using acc_t = at::opmath_type<T>;
  const T* grad = static_cast<const T*>(p.grad);
  T* dtable = static_cast<T*>(p.dtable);
  const int64_t rows = num_buckets(p.max_distance);
  const int64_t nblk = (p.dim + kGatherBwdDBlock - 1) / kGatherBwdDBlock;
  std::vector<acc_t> acc(rows * kGatherBwdDBlock);
  for (int64_t item = begin; item < end; ++item) {
    const int64_t h = item / nblk, d0 = (item % nblk) * kGatherBwdDBlock;
    const int64_t nd = std::min(kGatherBwdDBlock, p.dim - d0);
    std::fill(acc.begin(), acc.end(), acc_t(0));
    const T* g = grad + h * p.q_len * p.k_len * p.dim + d0;
    for (int64_t i = 0; i < p.q_len; ++i) {
      for (int64_t j = 0; j < p.k_len; ++j) {
        const int64_t b = shaw_bucket(i, j, p.max_distance, p.q_offset, p.k_offset);
        const T* gij = g + (i * p.k_len + j) * p.dim;
        acc_t* a = acc.data() + b * kGatherBwdDBlock;
        for (int64_t d = 0; d < nd; ++d) a[d] += static_cast<acc_t>(gij[d]);
      }
    }
    T* dt = dtable + h * rows * p.dim + d0;
    for (int64_t b = 0; b < rows; ++b) {
      for (int64_t d = 0; d < nd; ++d) dt[b * p.dim + d] = static_cast<T>(acc[b * kGatherBwdDBlock + d]);
    }
  }
}

// y[n, i, j] = x[n, i, skew_col(i, j)]; causal: zero above the diagonal.
template <typename T>
void skew(const SkewParams& p, int64_t begin, int64_t end) {
  const T* x = static_cast<const T*>(p.in);
  T* y = static_cast<T*>(p.out);
  const int64_t width = p.causal ? p.k_len : skew_width(p.q_len, p.k_len);
  for (int64_t item = begin; item < end; ++item) {
    const int64_t i = item % p.q_len;
    const T* xr = x + item * width;
    T* yr = y + item * p.k_len;
    for (int64_t j = 0; j < p.k_len; ++j) {
      yr[j] = (!p.causal || causal_visible(i, j)) ? xr[skew_col(i, j, p.q_len)] : T(0);
    }
  }
}

// The adjoint: dx[n, i, skew_col(i, j)] = dy[n, i, j] for every visible (i, j), zero elsewhere.
template <typename T>
void skew_backward(const SkewParams& p, int64_t begin, int64_t end) {
  const T* dy = static_cast<const T*>(p.in);
  T* dx = static_cast<T*>(p.out);
  const int64_t width = p.causal ? p.k_len : skew_width(p.q_len, p.k_len);
  for (int64_t item = begin; item < end; ++item) {
    const int64_t i = item % p.q_len;
    const T* gr = dy + item * p.k_len;
    T* xr = dx + item * width;
    std::fill(xr, xr + width, T(0));
    for (int64_t j = 0; j < p.k_len; ++j) {
      if (!p.causal || causal_visible(i, j)) xr[skew_col(i, j, p.q_len)] = gr[j];
    }
  }
}

// out[b, h, i, j] = q[b, h, i] . table[b(i, j)]: one dot product per reachable bucket of the row,
// then the skew as copies (the clamped ends repeat the dot of bucket 0 or 2K).
template <typename T>
void rel_logits(const RelLogitsParams& p, int64_t begin, int64_t end) {
  using acc_t = at::opmath_type<T>;
  const T* q = static_cast<const T*>(p.q);
  const T* table = static_cast<const T*>(p.table);
  T* out = static_cast<T*>(p.out);
  const int64_t rows = num_buckets(p.max_distance);
  auto dot = [&](const T* a, const T* b) {
    acc_t s = 0;
    for (int64_t d = 0; d < p.dim; ++d) s += static_cast<acc_t>(a[d]) * static_cast<acc_t>(b[d]);
    return s;
  };
  for (int64_t item = begin; item < end; ++item) {
    const int64_t i = item % p.q_len;
    const int64_t h = (item / p.q_len) % p.heads;
    const T* qi = q + item * p.dim;
    const T* tab = table + (p.table_per_head ? h * rows * p.dim : 0);
    T* o = out + item * p.k_len;
    const KeySpan span = unclamped_keys(i, p.k_len, p.max_distance, p.q_offset, p.k_offset);
    if (span.begin > 0) {
      const T v = static_cast<T>(dot(qi, tab));
      std::fill(o, o + span.begin, v);
    }
    for (int64_t j = span.begin; j < span.end; ++j) {
      const int64_t b = shaw_bucket(i, j, p.max_distance, p.q_offset, p.k_offset);
      o[j] = static_cast<T>(dot(qi, tab + b * p.dim));
    }
    if (span.end < p.k_len) {
      const T v = static_cast<T>(dot(qi, tab + (rows - 1) * p.dim));
      std::fill(o + span.end, o + p.k_len, v);
    }
  }
}

// wsum[row, c] = sum of grad[row, j] over the keys j whose bucket is bucket0 + c.
template <typename T>
void bucket_sum(const BucketSumParams& p, int64_t begin, int64_t end) {
  using acc_t = at::opmath_type<T>;
  const T* grad = static_cast<const T*>(p.grad);
  acc_t* wsum = static_cast<acc_t*>(p.wsum);
  for (int64_t item = begin; item < end; ++item) {
    const int64_t i = item % p.q_len;
    const T* g = grad + item * p.k_len;
    acc_t* w = wsum + item * p.num_cols;
    std::fill(w, w + p.num_cols, acc_t(0));
    for (int64_t j = 0; j < p.k_len; ++j) {
      const int64_t b = shaw_bucket(i, j, p.max_distance, p.q_offset, p.k_offset);
      w[b - p.bucket0] += static_cast<acc_t>(g[j]);
    }
  }
}

// Rows r of x [n0 * n1 * n2, dim]: the pairs of the first p.rot features turned by cos/sin
// (rope_rotate), the rest copied.
template <typename T>
void rope(const RopeParams& p, int64_t begin, int64_t end) {
  using acc_t = at::opmath_type<T>;
  const T* x = static_cast<const T*>(p.x);
  const T* cos = static_cast<const T*>(p.cos);
  const T* sin = static_cast<const T*>(p.sin);
  T* out = static_cast<T*>(p.out);
  for (int64_t row = begin; row < end; ++row) {
    const T* xr = x + row * p.dim;
    T* yr = out + row * p.dim;
    const int64_t co = rope_cos_offset(row, p.n1, p.n2, p.cs0, p.cs1, p.cs2);
    const T* c = cos + co;
    const T* s = sin + co;
    for (int64_t f = 0; f < p.rot / 2; ++f) {
      const int64_t a = rope_first(f, p.interleaved), b = rope_second(f, p.rot, p.interleaved);
      acc_t ya, yb;
      rope_rotate<acc_t>(xr[a], xr[b], c[a], c[b], s[a], s[b], p.inverse, ya, yb);
      yr[a] = static_cast<T>(ya);
      yr[b] = static_cast<T>(yb);
    }
    std::memcpy(yr + p.rot, xr + p.rot, sizeof(T) * (p.dim - p.rot));
  }
}

}  // namespace relpos::cpu::scalar
