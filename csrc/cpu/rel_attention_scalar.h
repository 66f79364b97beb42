// Scalar fused Shaw attention (forward and backward), the portable and float64 path and the
// readable statement of what the AVX2 and CUDA kernels compute (maths: RelAttentionParams).
// A query row is processed against all its keys with an O(Lk + number of buckets) scratch per
// thread, plus the keys (and in the backward the values) of the current kv head transposed,
// O(Lk D); nothing of size [Lq, Lk] exists. Per row, q . rel_k[b] is computed once per reachable
// bucket (the skewed matmul), and the probability mass per bucket W[b] feeds the value term.
// The key-side table (rel_q) is the transpose: k_j . rel_q[b] is computed once per key for the
// two clamped buckets (per head, key_side_ends) and directly for the pairs inside the band.
// The scores of a row are accumulated over d with the keys contiguous (scores_row): the same
// sums, in the same order, as a dot product per key, but a loop the compiler vectorises (SSE2,
// NEON) without reassociating anything, so this path stays exact for float64 gradcheck.
#pragma once

#include <ATen/OpMathType.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "common/dropout.h"
#include "common/params.h"
#include "common/relpos_index.h"

namespace relpos::cpu::scalar {

// Keys visible from query row i of head h: causal positions, the padding and attention masks,
// the segments, the window.
inline bool key_visible(const RelAttentionParams& p, int64_t b, int64_t h, int64_t i, int64_t j) {
  if (p.causal && p.k_offset + j > p.q_offset + i) return false;
  if (masks_hide(p, b, h, i, j)) return false;
  return p.key_padding_mask == nullptr || !p.key_padding_mask[b * p.k_len + j];
}

// Attention dropout of row (b, h, i) (common/dropout.h): factor(j) is keep_scale for a kept key,
// 0 for a dropped one, 1 when dropout is off.
template <typename acc_t>
struct RowDropout {
  const DropoutParams& d;
  uint32_t row_key = 0;
  RowDropout(const RelAttentionParams& p, int64_t b, int64_t h, int64_t i) : d(p.dropout) {
    if (d.on) row_key = dropout_row_key(d.seed, b * p.heads + h, i);
  }
  acc_t factor(int64_t j) const {
    if (!d.on) return acc_t(1);
    return dropout_kept(row_key, j, d.threshold) ? static_cast<acc_t>(d.keep_scale) : acc_t(0);
  }
};

template <typename T, typename acc_t>
acc_t dot(const T* a, const T* b, int64_t n) {
  acc_t s = 0;
  for (int64_t d = 0; d < n; ++d) s += static_cast<acc_t>(a[d]) * static_cast<acc_t>(b[d]);
  return s;
}

// xt[d * n + j] = x[j * dim + d]: n rows (the keys or values of a kv head, a table) transposed,
// in acc_t.
template <typename T, typename acc_t>
void transpose_rows(const T* x, int64_t n, int64_t dim, std::vector<acc_t>& xt) {
  xt.resize(n * dim);
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t d = 0; d < dim; ++d) xt[d * n + j] = static_cast<acc_t>(x[j * dim + d]);
  }
}

// s[j] = a . x_j, j < n, for rows x_j held transposed: x_j[d] = xt[d * ld + j] (transpose_rows:
// ld = the number of rows), summed over d in order. Sixteen j at a time in a local block the
// compiler keeps in registers, so the loop over d only loads xt.
template <typename T, typename acc_t>
void scores_row(const T* a, const acc_t* xt, int64_t ld, int64_t n, int64_t dim, acc_t* s) {
  constexpr int64_t kJ = 16;
  int64_t j0 = 0;
  for (; j0 + kJ <= n; j0 += kJ) {
    acc_t blk[kJ] = {};
    for (int64_t d = 0; d < dim; ++d) {
      const acc_t ad = static_cast<acc_t>(a[d]);
      const acc_t* x = xt + d * ld + j0;
      for (int64_t j = 0; j < kJ; ++j) blk[j] += ad * x[j];
    }
    for (int64_t j = 0; j < kJ; ++j) s[j0 + j] = blk[j];
  }
  if (j0 < n) {
    std::fill(s + j0, s + n, acc_t(0));
    for (int64_t d = 0; d < dim; ++d) {
      const acc_t ad = static_cast<acc_t>(a[d]);
      const acc_t* x = xt + d * ld;
      for (int64_t j = j0; j < n; ++j) s[j] += ad * x[j];
    }
  }
}

// acc[d] += sum_j w[j] x_j[d] over the n rows x_j = x + j * dim, added in the order of j. Sixteen
// d at a time in a local block the compiler keeps in registers, so the loop over j only loads x.
template <typename T, typename acc_t>
void accumulate_rows(const acc_t* w, const T* x, int64_t n, int64_t dim, acc_t* acc) {
  constexpr int64_t kD = 16;
  int64_t d0 = 0;
  for (; d0 + kD <= dim; d0 += kD) {
    acc_t blk[kD];
    for (int64_t d = 0; d < kD; ++d) blk[d] = acc[d0 + d];
    for (int64_t j = 0; j < n; ++j) {
      const acc_t wj = w[j];
      const T* xj = x + j * dim + d0;
      for (int64_t d = 0; d < kD; ++d) blk[d] += wj * static_cast<acc_t>(xj[d]);
    }
    for (int64_t d = 0; d < kD; ++d) acc[d0 + d] = blk[d];
  }
  for (int64_t j = 0; j < n && d0 < dim; ++j) {
    for (int64_t d = d0; d < dim; ++d) acc[d] += w[j] * static_cast<acc_t>(x[j * dim + d]);
  }
}

// The key-side table of query head h, or null.
template <typename T>
const T* key_side_table(const RelAttentionParams& p, int64_t h) {
  const T* rel_q = static_cast<const T*>(p.rel_q);
  if (rel_q == nullptr) return nullptr;
  return rel_q + (p.rel_q_per_head ? h * num_buckets(p.max_distance) * p.dim : 0);
}

// k_j . eq[0] and k_j . eq[2K] for every key (the clamped buckets, which most pairs fall in when
// K is small), from the keys held transposed (kt).
template <typename T, typename acc_t>
void key_side_ends(const T* eq, const std::vector<acc_t>& kt, int64_t k_len, int64_t rows,
                   int64_t dim, std::vector<acc_t>& lo, std::vector<acc_t>& hi) {
  lo.resize(k_len);
  hi.resize(k_len);
  scores_row<T, acc_t>(eq, kt.data(), k_len, k_len, dim, lo.data());
  scores_row<T, acc_t>(eq + (rows - 1) * dim, kt.data(), k_len, k_len, dim, hi.data());
}

// k_j . eq[bucket]: from the per-key ends for a clamped bucket, a dot product inside the band.
template <typename T, typename acc_t>
acc_t key_side_term(const T* eq, const T* kj, int64_t bucket, int64_t rows, int64_t dim,
                    const std::vector<acc_t>& lo, const std::vector<acc_t>& hi, int64_t j) {
  if (bucket == 0) return lo[j];
  if (bucket == rows - 1) return hi[j];
  return dot<T, acc_t>(kj, eq + bucket * dim, dim);
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
  const T* rel_bias = static_cast<const T*>(p.rel_bias);
  // a row reaches at most k_len buckets (max_distance may be huge when there are no tables)
  std::vector<acc_t> s(p.k_len), qe(std::min(rows, p.k_len)), w, acc(p.dim), kt, ekt, ke_lo, ke_hi;
  int64_t kt_of = -1;          // offset of the kv head whose keys are in kt
  const T* ekt_of = nullptr;   // table whose rows are in ekt
  int64_t ke_of = -1;          // kv head offset whose key-side ends are in ke_lo / ke_hi ...
  const T* ke_table = nullptr;  // ... for this rel_q
  for (int64_t item = begin; item < end; ++item) {
    const int64_t i = item % p.q_len, h = (item / p.q_len) % p.heads, b = item / (p.q_len * p.heads);
    const T* qi = q + item * p.dim;
    const int64_t kv = (b * p.kv_heads + h / group) * p.kv_stride;
    if (kv != kt_of) {  // an item range holds few kv heads: a transpose per head, not per row
      transpose_rows<T, acc_t>(k + kv, p.k_len, p.dim, kt);
      kt_of = kv;
    }
    scores_row<T, acc_t>(qi, kt.data(), p.k_len, p.k_len, p.dim, s.data());  // q_i . k_j
    const T* eq = key_side_table<T>(p, h);
    if (eq != nullptr && (kv != ke_of || eq != ke_table)) {
      key_side_ends<T, acc_t>(eq, kt, p.k_len, rows, p.dim, ke_lo, ke_hi);
      ke_of = kv;
      ke_table = eq;
    }
    // Buckets reachable from row i: [b_lo, b_lo + nb).
    const int64_t b_lo = shaw_bucket(i, 0, p.max_distance, p.q_offset, p.k_offset);
    const int64_t nb = p.k_len == 0 ? 0 : shaw_bucket(i, p.k_len - 1, p.max_distance, p.q_offset, p.k_offset) - b_lo + 1;
    if (rel_k != nullptr) {  // q_i . rel_k[b] over the reachable buckets
      const T* ek = rel_k + (p.rel_k_per_head ? h * rows * p.dim : 0);
      if (ek != ekt_of) {
        transpose_rows<T, acc_t>(ek, rows, p.dim, ekt);
        ekt_of = ek;
      }
      scores_row<T, acc_t>(qi, ekt.data() + b_lo, rows, nb, p.dim, qe.data());
    }
    const T* bias = rel_bias == nullptr ? nullptr : rel_bias + (p.rel_bias_per_head ? h * rows : 0);
    acc_t m = -std::numeric_limits<acc_t>::infinity();
    for (int64_t j = 0; j < p.k_len; ++j) {
      if (!key_visible(p, b, h, i, j)) {
        s[j] = -std::numeric_limits<acc_t>::infinity();
        continue;
      }
      acc_t e = s[j];
      const int64_t bucket = shaw_bucket(i, j, p.max_distance, p.q_offset, p.k_offset);
      if (rel_k != nullptr) e += qe[bucket - b_lo];
      if (eq != nullptr) {
        e += key_side_term<T, acc_t>(eq, k + kv + j * p.dim, bucket, rows, p.dim, ke_lo, ke_hi, j);
      }
      s[j] = e * static_cast<acc_t>(p.scale);
      if (bias != nullptr) s[j] += static_cast<acc_t>(bias[bucket]);
      if (s[j] > m || s[j] != s[j]) m = s[j];  // a NaN logit makes the row NaN, as in torch
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
    const RowDropout<acc_t> drop(p, b, h, i);
    for (int64_t j = 0; j < p.k_len; ++j) {  // s becomes the row of (dropped) probabilities
      if (s[j] == -std::numeric_limits<acc_t>::infinity()) {  // masked
        s[j] = acc_t(0);
        continue;
      }
      const acc_t e = std::exp(s[j] - m);
      l += e;  // the normaliser is the one without dropout
      const acc_t pij = drop.d.on ? e * drop.factor(j) : e;
      s[j] = pij;
      if (rel_v != nullptr) w[shaw_bucket(i, j, p.max_distance, p.q_offset, p.k_offset) - b_lo] += pij;
    }
    accumulate_rows<T, acc_t>(s.data(), v + kv, p.k_len, p.dim, acc.data());  // P V
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
// table-gradient partials of its query heads, so nothing is shared between threads. Query rows
// go in blocks of kBwdRows: the probabilities and dS of a block are computed first, then each
// key's dk/dv row takes the block's contributions in registers (accumulate_rows) - the same
// sums in the same order as row by row, where all of dk/dv went through memory for every row.
constexpr int64_t kBwdRows = 8;

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
  acc_t* pbias = static_cast<acc_t*>(bp.drel_bias_partial);
  acc_t* pq = static_cast<acc_t*>(bp.drel_q_partial);
  const T* rel_bias = static_cast<const T*>(p.rel_bias);
  const int64_t rows = num_buckets(p.max_distance), group = p.heads / p.kv_heads, D = p.dim;
  const acc_t scale = static_cast<acc_t>(p.scale);
  const int64_t reach = std::min(rows, p.k_len);  // buckets one row reaches, at most
  std::vector<acc_t> dk_acc(p.k_len * D), dv_acc(p.k_len * D), qe(reach), de(reach), kt, vt, ekt, evt;
  std::vector<acc_t> dprow(p.k_len);
  // the key-side table: k_j . rel_q at the clamped buckets, and the dS mass each key sends there
  std::vector<acc_t> ke_lo, ke_hi, ds_lo, ds_hi;
  // per row of a block: P and scale * dS over the keys, the per-bucket sums of both, and dq
  std::vector<acc_t> pblk(kBwdRows * p.k_len), dsblk(kBwdRows * p.k_len), dqblk(kBwdRows * D);
  std::vector<acc_t> pcol(kBwdRows * p.k_len), dscol(kBwdRows * p.k_len);  // the same, key-major
  std::vector<acc_t> wds[kBwdRows], wp[kBwdRows];
  for (int64_t item = begin; item < end; ++item) {
    const int64_t b = item / p.kv_heads, hk = item % p.kv_heads;
    const int64_t kv = item * p.k_len * D;       // dk, dv: packed
    const T* k_item = k + item * p.kv_stride;    // k, v: slabs kv_stride apart
    transpose_rows<T, acc_t>(k_item, p.k_len, D, kt);
    transpose_rows<T, acc_t>(v + item * p.kv_stride, p.k_len, D, vt);
    std::fill(dk_acc.begin(), dk_acc.end(), acc_t(0));
    std::fill(dv_acc.begin(), dv_acc.end(), acc_t(0));
    for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
      const T* ek = rel_k ? rel_k + (p.rel_k_per_head ? h * rows * D : 0) : nullptr;
      const T* ev = rel_v ? rel_v + (p.rel_v_per_head ? h * rows * D : 0) : nullptr;
      acc_t* pkh = pk ? pk + (b * p.heads + h) * rows * D : nullptr;
      acc_t* pvh = pv ? pv + (b * p.heads + h) * rows * D : nullptr;
      const T* bias = rel_bias ? rel_bias + (p.rel_bias_per_head ? h * rows : 0) : nullptr;
      acc_t* pbh = pbias ? pbias + (b * p.heads + h) * rows : nullptr;
      if (ek) transpose_rows<T, acc_t>(ek, rows, D, ekt);
      if (ev) transpose_rows<T, acc_t>(ev, rows, D, evt);
      const T* eq = key_side_table<T>(p, h);
      acc_t* pqh = pq ? pq + (b * p.heads + h) * rows * D : nullptr;
      if (eq) {
        key_side_ends<T, acc_t>(eq, kt, p.k_len, rows, D, ke_lo, ke_hi);
        ds_lo.assign(p.k_len, acc_t(0));
        ds_hi.assign(p.k_len, acc_t(0));
      }
      const int64_t row0 = (b * p.heads + h) * p.q_len;
      for (int64_t i0 = 0; i0 < p.q_len; i0 += kBwdRows) {
        const int64_t nr = std::min(kBwdRows, p.q_len - i0);
        std::fill(dqblk.begin(), dqblk.end(), acc_t(0));
        bool active[kBwdRows];
        // 1. P and dS of each row of the block, and their per-bucket sums
        for (int64_t r = 0; r < nr; ++r) {
          const int64_t i = i0 + r, row = row0 + i;
          acc_t* pr = pblk.data() + r * p.k_len;
          acc_t* dsr = dsblk.data() + r * p.k_len;
          const acc_t li = lse[row];
          active[r] = !std::isinf(li);  // no visible key: every p_ij is 0
          if (!active[r]) {
            std::fill(pr, pr + p.k_len, acc_t(0));
            std::fill(dsr, dsr + p.k_len, acc_t(0));
            continue;
          }
          const T* qi = q + row * D;
          const T* doi = dout + row * D;
          const int64_t b_lo = shaw_bucket(i, 0, p.max_distance, p.q_offset, p.k_offset);
          const int64_t nb = shaw_bucket(i, p.k_len - 1, p.max_distance, p.q_offset, p.k_offset) - b_lo + 1;
          wds[r].assign(nb, acc_t(0));
          wp[r].assign(nb, acc_t(0));
          // q_i . rel_k[b] and dO_i . rel_v[b] over the reachable buckets
          if (ek) scores_row<T, acc_t>(qi, ekt.data() + b_lo, rows, nb, D, qe.data());
          if (ev) scores_row<T, acc_t>(doi, evt.data() + b_lo, rows, nb, D, de.data());
          const acc_t di = dot<T, acc_t>(doi, out + row * D, D);
          scores_row<T, acc_t>(qi, kt.data(), p.k_len, p.k_len, D, pr);             // q_i . k_j, then P
          scores_row<T, acc_t>(doi, vt.data(), p.k_len, p.k_len, D, dprow.data());  // dO_i . v_j
          const RowDropout<acc_t> drop(p, b, h, i);
          for (int64_t j = 0; j < p.k_len; ++j) {
            if (!key_visible(p, b, h, i, j)) {
              pr[j] = dsr[j] = acc_t(0);
              continue;
            }
            const int64_t c = shaw_bucket(i, j, p.max_distance, p.q_offset, p.k_offset) - b_lo;
            const int64_t bucket = b_lo + c;
            acc_t sij = pr[j] + (ek ? qe[c] : acc_t(0));
            if (eq) {
              sij += key_side_term<T, acc_t>(eq, k_item + j * D, bucket, rows, D, ke_lo, ke_hi, j);
            }
            const acc_t e = bias ? std::exp(sij * scale + static_cast<acc_t>(bias[b_lo + c]) - li)
                                 : std::exp(sij * scale - li);
            // with dropout: dv and drel_v take the dropped p, ds = p (keep / (1 - p) dp - d_i)
            const acc_t f = drop.d.on ? drop.factor(j) : acc_t(1);
            const acc_t pij = e * f;
            const acc_t dpij = dprow[j] + (ev ? de[c] : acc_t(0));
            const acc_t dsij = e * (drop.d.on ? f * dpij - di : dpij - di);
            wds[r][c] += dsij;
            wp[r][c] += pij;
            if (eq) {  // dk_j += scale ds_ij rel_q[b], drel_q[b] += scale ds_ij k_j
              if (bucket == 0) {
                ds_lo[j] += dsij;
              } else if (bucket == rows - 1) {
                ds_hi[j] += dsij;
              } else {
                const acc_t g = scale * dsij;
                const T* e = eq + bucket * D;
                const T* kj = k_item + j * D;
                acc_t* dkj = dk_acc.data() + j * D;
                acc_t* tq = pqh + bucket * D;
                for (int64_t d = 0; d < D; ++d) dkj[d] += g * static_cast<acc_t>(e[d]);
                for (int64_t d = 0; d < D; ++d) tq[d] += g * static_cast<acc_t>(kj[d]);
              }
            }
            pr[j] = pij;
            dsr[j] = scale * dsij;
          }
        }
        // 2. dv_j += sum_r p_rj dO_r and dk_j += sum_r scale ds_rj q_r per key j (over the block's
        // rows, key-major copies of P and dS), dq_r += sum_j scale ds_rj k_j per row
        for (int64_t r = 0; r < nr; ++r) {
          for (int64_t j = 0; j < p.k_len; ++j) {
            pcol[j * kBwdRows + r] = pblk[r * p.k_len + j];
            dscol[j * kBwdRows + r] = dsblk[r * p.k_len + j];
          }
        }
        const T* q_blk = q + (row0 + i0) * D;
        const T* do_blk = dout + (row0 + i0) * D;
        for (int64_t j = 0; j < p.k_len; ++j) {
          accumulate_rows<T, acc_t>(pcol.data() + j * kBwdRows, do_blk, nr, D, dv_acc.data() + j * D);
          accumulate_rows<T, acc_t>(dscol.data() + j * kBwdRows, q_blk, nr, D, dk_acc.data() + j * D);
        }
        for (int64_t r = 0; r < nr; ++r) {
          accumulate_rows<T, acc_t>(dsblk.data() + r * p.k_len, k_item, p.k_len, D, dqblk.data() + r * D);
        }
        // 3. the relative terms of the block's rows, and dq out
        for (int64_t r = 0; r < nr; ++r) {
          const int64_t i = i0 + r, row = row0 + i;
          acc_t* dqr = dqblk.data() + r * D;
          if (active[r]) {
            const T* qi = q + row * D;
            const T* doi = dout + row * D;
            const int64_t b_lo = shaw_bucket(i, 0, p.max_distance, p.q_offset, p.k_offset);
            for (int64_t c = 0; c < static_cast<int64_t>(wds[r].size()); ++c) {
              // one output per loop, so each vectorises (as in step 2)
              const acc_t gk = scale * wds[r][c], gv = wp[r][c];
              if (pbh) pbh[b_lo + c] += wds[r][c];
              if (ek) {
                const T* e = ek + (b_lo + c) * D;
                acc_t* tk = pkh + (b_lo + c) * D;
                for (int64_t d = 0; d < D; ++d) dqr[d] += gk * static_cast<acc_t>(e[d]);
                for (int64_t d = 0; d < D; ++d) tk[d] += gk * static_cast<acc_t>(qi[d]);
              }
              if (ev) {
                acc_t* tv = pvh + (b_lo + c) * D;
                for (int64_t d = 0; d < D; ++d) tv[d] += gv * static_cast<acc_t>(doi[d]);
              }
            }
          }
          for (int64_t d = 0; d < D; ++d) dq[row * D + d] = static_cast<T>(dqr[d]);
        }
      }
      if (eq) {  // the clamped buckets of the key-side table, once per key
        const T* e_lo = eq;
        const T* e_hi = eq + (rows - 1) * D;
        for (int64_t j = 0; j < p.k_len; ++j) {
          const acc_t g_lo = scale * ds_lo[j], g_hi = scale * ds_hi[j];
          const T* kj = k_item + j * D;
          acc_t* dkj = dk_acc.data() + j * D;
          for (int64_t d = 0; d < D; ++d) {
            dkj[d] += g_lo * static_cast<acc_t>(e_lo[d]) + g_hi * static_cast<acc_t>(e_hi[d]);
          }
          for (int64_t d = 0; d < D; ++d) pqh[d] += g_lo * static_cast<acc_t>(kj[d]);
          for (int64_t d = 0; d < D; ++d) pqh[(rows - 1) * D + d] += g_hi * static_cast<acc_t>(kj[d]);
        }
      }
    }
    for (int64_t e = 0; e < p.k_len * D; ++e) {
      dk[kv + e] = static_cast<T>(dk_acc[e]);
      dv[kv + e] = static_cast<T>(dv_acc[e]);
    }
  }
}

}  // namespace relpos::cpu::scalar
