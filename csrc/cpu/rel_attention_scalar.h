// Scalar fused Shaw attention (forward and backward), the portable and float64 path and the
// readable statement of what the AVX2 and CUDA kernels compute (maths: RelAttentionParams).
// A query row is processed against all its keys with an O(Lk + number of buckets) scratch per
// thread, plus the keys (and in the backward the values) of the current kv head transposed,
// O(Lk D); nothing of size [Lq, Lk] exists. Per row, q . rel_k[b] is computed once per reachable
// bucket (the skewed matmul), and the probability mass per bucket W[b] feeds the value term.
// The scores of a row are accumulated over d with the keys contiguous (scores_row): the same
// sums, in the same order, as a dot product per key, but a loop the compiler vectorises (SSE2,
// NEON) without reassociating anything, so this path stays exact for float64 gradcheck.
#pragma once

#include <ATen/OpMathType.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "common/params.h"
#include "common/relpos_index.h"

namespace relpos::cpu::scalar {

// Keys visible from query row i: causal positions and the padding mask.
inline bool key_visible(const RelAttentionParams& p, int64_t b, int64_t i, int64_t j) {
  if (p.causal && p.k_offset + j > p.q_offset + i) return false;
  return p.key_padding_mask == nullptr || !p.key_padding_mask[b * p.k_len + j];
}

template <typename T, typename acc_t>
acc_t dot(const T* a, const T* b, int64_t n) {
  acc_t s = 0;
  for (int64_t d = 0; d < n; ++d) s += static_cast<acc_t>(a[d]) * static_cast<acc_t>(b[d]);
  return s;
}

// xt[d * n + j] = x[j * dim + d]: the n rows of a kv head, transposed and in acc_t.
template <typename T, typename acc_t>
void transpose_rows(const T* x, int64_t n, int64_t dim, std::vector<acc_t>& xt) {
  xt.resize(n * dim);
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t d = 0; d < dim; ++d) xt[d * n + j] = static_cast<acc_t>(x[j * dim + d]);
  }
}

// s[j] = a . x_j for the n rows of xt (transposed, see transpose_rows), summed over d in order.
template <typename T, typename acc_t>
void scores_row(const T* a, const std::vector<acc_t>& xt, int64_t n, int64_t dim, acc_t* s) {
  std::fill(s, s + n, acc_t(0));
  for (int64_t d = 0; d < dim; ++d) {
    const acc_t ad = static_cast<acc_t>(a[d]);
    const acc_t* x = xt.data() + d * n;
    for (int64_t j = 0; j < n; ++j) s[j] += ad * x[j];
  }
}

// Work items: rows (b, h, i) of batch * heads * q_len.
template <typename T>
void rel_attention(const RelAttentionParams& p, int64_t begin, int64_t end) {
  using acc_t = at::opmath_type<T>;
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  const T* rel_k = static_cast<const T*>(p.rel_k);
  const T* rel_v = static_cast<const T*>(p.rel_v);
  T* out = static_cast<T*>(p.out);
  acc_t* lse = static_cast<acc_t*>(p.lse);
  const int64_t rows = num_buckets(p.max_distance), group = p.heads / p.kv_heads;
  std::vector<acc_t> s(p.k_len), qe, w, acc(p.dim), kt;
  int64_t kt_of = -1;  // offset of the kv head whose keys are in kt
  for (int64_t item = begin; item < end; ++item) {
    const int64_t i = item % p.q_len, h = (item / p.q_len) % p.heads, b = item / (p.q_len * p.heads);
    const T* qi = q + item * p.dim;
    const int64_t kv = (b * p.kv_heads + h / group) * p.k_len * p.dim;
    if (kv != kt_of) {  // an item range holds few kv heads: a transpose per head, not per row
      transpose_rows<T, acc_t>(k + kv, p.k_len, p.dim, kt);
      kt_of = kv;
    }
    scores_row<T, acc_t>(qi, kt, p.k_len, p.dim, s.data());  // q_i . k_j
    // Buckets reachable from row i: [b_lo, b_lo + nb).
    const int64_t b_lo = shaw_bucket(i, 0, p.max_distance, p.q_offset, p.k_offset);
    const int64_t nb = p.k_len == 0 ? 0 : shaw_bucket(i, p.k_len - 1, p.max_distance, p.q_offset, p.k_offset) - b_lo + 1;
    if (rel_k != nullptr) {
      const T* ek = rel_k + (p.rel_k_per_head ? h * rows * p.dim : 0);
      qe.assign(nb, acc_t(0));
      for (int64_t c = 0; c < nb; ++c) qe[c] = dot<T, acc_t>(qi, ek + (b_lo + c) * p.dim, p.dim);
    }
    acc_t m = -std::numeric_limits<acc_t>::infinity();
    for (int64_t j = 0; j < p.k_len; ++j) {
      if (!key_visible(p, b, i, j)) {
        s[j] = -std::numeric_limits<acc_t>::infinity();
        continue;
      }
      acc_t e = s[j];
      if (rel_k != nullptr) e += qe[shaw_bucket(i, j, p.max_distance, p.q_offset, p.k_offset) - b_lo];
      s[j] = e * static_cast<acc_t>(p.scale);
      m = std::max(m, s[j]);
    }
    T* oi = out + item * p.dim;
    if (m == -std::numeric_limits<acc_t>::infinity()) {  // no visible key
      for (int64_t d = 0; d < p.dim; ++d) oi[d] = T(0);
      lse[item] = std::numeric_limits<acc_t>::infinity();
      continue;
    }
    acc_t l = 0;
    std::fill(acc.begin(), acc.end(), acc_t(0));
    w.assign(nb, acc_t(0));
    for (int64_t j = 0; j < p.k_len; ++j) {
      if (s[j] == -std::numeric_limits<acc_t>::infinity()) continue;
      const acc_t pij = std::exp(s[j] - m);
      l += pij;
      const T* vj = v + kv + j * p.dim;
      for (int64_t d = 0; d < p.dim; ++d) acc[d] += pij * static_cast<acc_t>(vj[d]);
      if (rel_v != nullptr) w[shaw_bucket(i, j, p.max_distance, p.q_offset, p.k_offset) - b_lo] += pij;
    }
    if (rel_v != nullptr) {  // value term: W @ rel_v over the reachable buckets
      const T* ev = rel_v + (p.rel_v_per_head ? h * rows * p.dim : 0);
      for (int64_t c = 0; c < nb; ++c) {
        if (w[c] == acc_t(0)) continue;
        const T* e = ev + (b_lo + c) * p.dim;
        for (int64_t d = 0; d < p.dim; ++d) acc[d] += w[c] * static_cast<acc_t>(e[d]);
      }
    }
    for (int64_t d = 0; d < p.dim; ++d) oi[d] = static_cast<T>(acc[d] / l);
    lse[item] = m + std::log(l);
  }
}

// Work items: (b, kv head) of batch * kv_heads; each item owns dk/dv of its kv head and the
// table-gradient partials of its query heads, so nothing is shared between threads.
template <typename T>
void rel_attention_backward(const RelAttentionBwdParams& bp, int64_t begin, int64_t end) {
  using acc_t = at::opmath_type<T>;
  const RelAttentionParams& p = bp.fwd;
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  const T* rel_k = static_cast<const T*>(p.rel_k);
  const T* rel_v = static_cast<const T*>(p.rel_v);
  const T* out = static_cast<const T*>(p.out);
  const acc_t* lse = static_cast<const acc_t*>(p.lse);
  const T* dout = static_cast<const T*>(bp.grad_out);
  T* dq = static_cast<T*>(bp.dq);
  T* dk = static_cast<T*>(bp.dk);
  T* dv = static_cast<T*>(bp.dv);
  acc_t* pk = static_cast<acc_t*>(bp.drel_k_partial);
  acc_t* pv = static_cast<acc_t*>(bp.drel_v_partial);
  const int64_t rows = num_buckets(p.max_distance), group = p.heads / p.kv_heads;
  const acc_t scale = static_cast<acc_t>(p.scale);
  std::vector<acc_t> dk_acc(p.k_len * p.dim), dv_acc(p.k_len * p.dim), qe, de, wds, wp, dqi(p.dim);
  std::vector<acc_t> kt, vt, srow(p.k_len), dprow(p.k_len);
  for (int64_t item = begin; item < end; ++item) {
    const int64_t b = item / p.kv_heads, hk = item % p.kv_heads;
    const int64_t kv = item * p.k_len * p.dim;
    transpose_rows<T, acc_t>(k + kv, p.k_len, p.dim, kt);
    transpose_rows<T, acc_t>(v + kv, p.k_len, p.dim, vt);
    std::fill(dk_acc.begin(), dk_acc.end(), acc_t(0));
    std::fill(dv_acc.begin(), dv_acc.end(), acc_t(0));
    for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
      const T* ek = rel_k ? rel_k + (p.rel_k_per_head ? h * rows * p.dim : 0) : nullptr;
      const T* ev = rel_v ? rel_v + (p.rel_v_per_head ? h * rows * p.dim : 0) : nullptr;
      acc_t* pkh = pk ? pk + (b * p.heads + h) * rows * p.dim : nullptr;
      acc_t* pvh = pv ? pv + (b * p.heads + h) * rows * p.dim : nullptr;
      for (int64_t i = 0; i < p.q_len; ++i) {
        const int64_t row = (b * p.heads + h) * p.q_len + i;
        const acc_t li = lse[row];
        if (std::isinf(li)) continue;  // no visible key: every p_ij is 0
        const T* qi = q + row * p.dim;
        const T* doi = dout + row * p.dim;
        const T* oi = out + row * p.dim;
        const int64_t b_lo = shaw_bucket(i, 0, p.max_distance, p.q_offset, p.k_offset);
        const int64_t nb = shaw_bucket(i, p.k_len - 1, p.max_distance, p.q_offset, p.k_offset) - b_lo + 1;
        qe.assign(nb, acc_t(0));
        de.assign(nb, acc_t(0));
        wds.assign(nb, acc_t(0));
        wp.assign(nb, acc_t(0));
        for (int64_t c = 0; c < nb; ++c) {
          if (ek) qe[c] = dot<T, acc_t>(qi, ek + (b_lo + c) * p.dim, p.dim);
          if (ev) de[c] = dot<T, acc_t>(doi, ev + (b_lo + c) * p.dim, p.dim);
        }
        const acc_t di = dot<T, acc_t>(doi, oi, p.dim);
        scores_row<T, acc_t>(qi, kt, p.k_len, p.dim, srow.data());    // q_i . k_j
        scores_row<T, acc_t>(doi, vt, p.k_len, p.dim, dprow.data());  // dO_i . v_j
        std::fill(dqi.begin(), dqi.end(), acc_t(0));
        for (int64_t j = 0; j < p.k_len; ++j) {
          if (!key_visible(p, b, i, j)) continue;
          const int64_t c = shaw_bucket(i, j, p.max_distance, p.q_offset, p.k_offset) - b_lo;
          const T* kj = k + kv + j * p.dim;
          acc_t sij = srow[j] + (ek ? qe[c] : acc_t(0));
          const acc_t pij = std::exp(sij * scale - li);
          const acc_t dpij = dprow[j] + (ev ? de[c] : acc_t(0));
          const acc_t dsij = pij * (dpij - di);
          wds[c] += dsij;
          wp[c] += pij;
          for (int64_t d = 0; d < p.dim; ++d) {
            dv_acc[j * p.dim + d] += pij * static_cast<acc_t>(doi[d]);
            dk_acc[j * p.dim + d] += scale * dsij * static_cast<acc_t>(qi[d]);
            dqi[d] += scale * dsij * static_cast<acc_t>(kj[d]);
          }
        }
        for (int64_t c = 0; c < nb; ++c) {
          for (int64_t d = 0; d < p.dim; ++d) {
            if (ek) {
              dqi[d] += scale * wds[c] * static_cast<acc_t>(ek[(b_lo + c) * p.dim + d]);
              pkh[(b_lo + c) * p.dim + d] += scale * wds[c] * static_cast<acc_t>(qi[d]);
            }
            if (ev) pvh[(b_lo + c) * p.dim + d] += wp[c] * static_cast<acc_t>(doi[d]);
          }
        }
        for (int64_t d = 0; d < p.dim; ++d) dq[row * p.dim + d] = static_cast<T>(dqi[d]);
      }
    }
    for (int64_t e = 0; e < p.k_len * p.dim; ++e) {
      dk[kv + e] = static_cast<T>(dk_acc[e]);
      dv[kv + e] = static_cast<T>(dv_acc[e]);
    }
  }
}

}  // namespace relpos::cpu::scalar
