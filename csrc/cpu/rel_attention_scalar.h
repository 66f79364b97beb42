// Scalar fused Shaw attention (forward and backward), the portable and float64 path and the
// readable statement of what the AVX2 and CUDA kernels compute (maths: RelAttentionParams).
// Query rows go in small blocks of one (b, h), each against the keys its rows may reach (the
// causal limit and the window cut the rest), with an O(block rows x (Lk + number of buckets))
// scratch per thread, plus the keys (and in the backward the values) of the current kv head
// transposed, O(Lk D); nothing of size [Lq, Lk] exists. Per row, q . rel_k[b] is computed once
// per reachable bucket (the skewed matmul), and the probability mass per bucket W[b] feeds the
// value term. The key-side table (rel_q) is the transpose: k_j . rel_q[b] is computed once per
// key for the two clamped buckets (per head, key_side_ends) and directly for the pairs inside
// the band.
// The matmuls are loops the compiler vectorises (SSE2, NEON) without reassociating anything:
// the scores accumulate over d with the keys contiguous (scores_block), the same sums in the same
// order as a dot product per key, so this path stays exact for float64 gradcheck. They take a
// few rows at once with those rows interleaved (element d of row r at d * ld + r), the layout
// for which GCC keeps the whole block in registers; with the rows one after another it spilled
// and ran 3x slower than one row at a time.
#pragma once

#include <ATen/OpMathType.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "common/dropout.h"
#include "common/params.h"
#include "common/relpos_index.h"

// The namespace of these kernels: scalar, or (rel_attention_f64.cpp) the namespace of a copy
// compiled for AVX2/FMA by target pragmas. That file must include every header included above
// before its pragmas (cmake/check_isa_confined.py fails the build otherwise).
#ifndef RELPOS_SCALAR_ATTENTION_NS
#define RELPOS_SCALAR_ATTENTION_NS scalar
#endif

namespace relpos::cpu::RELPOS_SCALAR_ATTENTION_NS {

// Keys visible from query row i of head h: causal positions, the padding and attention masks,
// the segments, the window.
inline bool key_visible(const RelAttentionParams& p, int64_t b, int64_t h, int64_t i, int64_t j) {
  if (p.causal && p.k_offset + j > p.q_offset + i) return false;
  if (masks_hide(p, b, h, i, j)) return false;
  return p.key_padding_mask == nullptr || !p.key_padding_mask[b * p.k_len + j];
}

// The keys rows [i_first, i_last] may see at most, by the causal limit and the window, as [begin,
// end) clipped to [0, k_len); key_visible decides inside it. Keys outside are never read.
inline KeySpan reachable_keys(const RelAttentionParams& p, int64_t i_first, int64_t i_last) {
  const int64_t d_first = p.q_offset + i_first - p.k_offset, d_last = p.q_offset + i_last - p.k_offset;
  int64_t begin = 0, end = p.k_len;
  if (p.window_left >= 0) begin = std::max(begin, d_first - p.window_left);
  if (p.causal) end = std::min(end, d_last + 1);
  if (p.window_right >= 0) end = std::min(end, d_last + p.window_right + 1);
  begin = std::min(begin, p.k_len);
  return KeySpan{begin, std::max(begin, end)};
}

// Whether only the causal limit and the window hide keys (no attention mask, segment ids or
// padding): then a row's reachable keys are exactly its visible ones, and the per-key loops need
// no visibility test.
inline bool spans_exact(const RelAttentionParams& p) {
  return p.attn_mask == nullptr && p.q_segment_ids == nullptr && p.key_padding_mask == nullptr;
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
acc_t dot_product(const T* a, const T* b, int64_t n) {
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

// s[r * lds + j] = a_r . x_j, r < R, j < n, for R rows a_r held interleaved, a_r[d] = a[d * lda
// + r], and rows x_j held transposed, x_j[d] = xt[d * ld + j] (transpose_rows: ld = the number of
// rows); each sum over d in order. kJ values of j of every row at a time in a local block the
// compiler keeps in registers, so the loop over d loads xt once for all R rows.
template <int64_t R, int64_t kJ, typename A, typename acc_t>
void scores_block(const A* a, int64_t lda, const acc_t* xt, int64_t ld, int64_t n, int64_t dim,
                  acc_t* s, int64_t lds) {
  int64_t j0 = 0;
  for (; j0 + kJ <= n; j0 += kJ) {
    acc_t blk[R][kJ] = {};
    for (int64_t d = 0; d < dim; ++d) {
      const acc_t* x = xt + d * ld + j0;
      for (int64_t r = 0; r < R; ++r) {
        const acc_t ad = static_cast<acc_t>(a[d * lda + r]);
        for (int64_t j = 0; j < kJ; ++j) blk[r][j] += ad * x[j];
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t j = 0; j < kJ; ++j) s[r * lds + j0 + j] = blk[r][j];
    }
  }
  for (int64_t r = 0; r < R && j0 < n; ++r) {
    acc_t* sr = s + r * lds;
    std::fill(sr + j0, sr + n, acc_t(0));
    for (int64_t d = 0; d < dim; ++d) {
      const acc_t ad = static_cast<acc_t>(a[d * lda + r]);
      const acc_t* x = xt + d * ld;
      for (int64_t j = j0; j < n; ++j) sr[j] += ad * x[j];
    }
  }
}

// scores_block for any number of rows nr: four at a time, then one at a time.
template <typename A, typename acc_t>
void scores(const A* a, int64_t lda, int64_t nr, const acc_t* xt, int64_t ld, int64_t n, int64_t dim,
            acc_t* s, int64_t lds) {
  int64_t r = 0;
  for (; r + 4 <= nr; r += 4) scores_block<4, 8>(a + r, lda, xt, ld, n, dim, s + r * lds, lds);
  for (; r < nr; ++r) scores_block<1, 16>(a + r, lda, xt, ld, n, dim, s + r * lds, lds);
}

// acc[r * dim + d] += sum_j w[j * ldw + r] x_j[d], r < R, over the n rows x_j = x + j * dim,
// added in the order of j. kD values of d of every row r at a time in a local block the compiler
// keeps in registers, so the loop over j loads x once for all R rows.
template <int64_t R, int64_t kD, typename T, typename acc_t>
void accumulate_block(const acc_t* w, int64_t ldw, const T* x, int64_t n, int64_t dim, acc_t* acc) {
  int64_t d0 = 0;
  for (; d0 + kD <= dim; d0 += kD) {
    acc_t blk[R][kD];
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t d = 0; d < kD; ++d) blk[r][d] = acc[r * dim + d0 + d];
    }
    for (int64_t j = 0; j < n; ++j) {
      const T* xj = x + j * dim + d0;
      for (int64_t r = 0; r < R; ++r) {
        const acc_t wj = w[j * ldw + r];
        for (int64_t d = 0; d < kD; ++d) blk[r][d] += wj * static_cast<acc_t>(xj[d]);
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t d = 0; d < kD; ++d) acc[r * dim + d0 + d] = blk[r][d];
    }
  }
  for (int64_t r = 0; r < R && d0 < dim; ++r) {
    acc_t* ar = acc + r * dim;
    for (int64_t j = 0; j < n; ++j) {
      const acc_t wj = w[j * ldw + r];
      for (int64_t d = d0; d < dim; ++d) ar[d] += wj * static_cast<acc_t>(x[j * dim + d]);
    }
  }
}

// accumulate_block for any number of rows nr: four at a time, then one at a time.
template <typename T, typename acc_t>
void accumulate(const acc_t* w, int64_t ldw, int64_t nr, const T* x, int64_t n, int64_t dim, acc_t* acc) {
  int64_t r = 0;
  for (; r + 4 <= nr; r += 4) accumulate_block<4, 8>(w + r, ldw, x, n, dim, acc + r * dim);
  for (; r < nr; ++r) accumulate_block<1, 16>(w + r, ldw, x, n, dim, acc + r * dim);
}

// at[d * nr + r] = a[r * dim + d]: nr rows interleaved (the layout of scores), in acc_t.
template <typename T, typename acc_t>
void interleave_rows(const T* a, int64_t nr, int64_t dim, acc_t* at) {
  for (int64_t r = 0; r < nr; ++r) {
    for (int64_t d = 0; d < dim; ++d) at[d * nr + r] = static_cast<acc_t>(a[r * dim + d]);
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
  scores(eq, 1, 1, kt.data(), k_len, k_len, dim, lo.data(), 0);
  scores(eq + (rows - 1) * dim, 1, 1, kt.data(), k_len, k_len, dim, hi.data(), 0);
}

// k_j . eq[bucket]: from the per-key ends for a clamped bucket, a dot product inside the band.
template <typename T, typename acc_t>
acc_t key_side_term(const T* eq, const T* kj, int64_t bucket, int64_t rows, int64_t dim,
                    const std::vector<acc_t>& lo, const std::vector<acc_t>& hi, int64_t j) {
  if (bucket == 0) return lo[j];
  if (bucket == rows - 1) return hi[j];
  return dot_product<T, acc_t>(kj, eq + bucket * dim, dim);
}

// The keys and buckets a block of query rows [i_first, i_last] reaches: keys [begin, end) by the
// causal limit and the window (reachable_keys), and the buckets those keys fall in for those
// rows, [bucket0, bucket0 + buckets).
struct BlockReach {
  int64_t begin, end, bucket0, buckets;
};

inline BlockReach block_reach(const RelAttentionParams& p, int64_t i_first, int64_t i_last) {
  const KeySpan keys = reachable_keys(p, i_first, i_last);
  BlockReach br{keys.begin, keys.end, 0, 0};
  if (keys.end > keys.begin) {
    br.bucket0 = shaw_bucket(i_last, keys.begin, p.max_distance, p.q_offset, p.k_offset);
    br.buckets = shaw_bucket(i_first, keys.end - 1, p.max_distance, p.q_offset, p.k_offset) - br.bucket0 + 1;
  }
  return br;
}

// Query rows go in blocks of kFwdRows consecutive rows of one (b, h). The matmuls of a block -
// scores, q . rel_k over the buckets its rows reach, P V and W @ rel_v - take all its rows at
// once (scores, accumulate), which reads each key, value and table row once per four rows
// instead of once per row: the same sums in the same order as row by row. (Compiled with FMA,
// rel_attention_f64.cpp, a row's last bits may still depend on how many rows share its block.)
constexpr int64_t kFwdRows = 8;

// Query-row blocks of one (b, h): rows [kFwdRows t, kFwdRows (t + 1)) of q_len.
inline int64_t fwd_row_blocks(int64_t q_len) { return (q_len + kFwdRows - 1) / kFwdRows; }

// Work items: the row blocks (b, h, t) of batch * heads * fwd_row_blocks(q_len). Which rows share
// a block is fixed by the shapes, so the results do not depend on how the items are split over
// threads.
template <typename T>
void rel_attention(const RelAttentionParams& p, int64_t begin, int64_t end) {
  using acc_t = at::opmath_type<T>;
  constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  const T* rel_k = static_cast<const T*>(p.rel_k);
  const T* rel_v = static_cast<const T*>(p.rel_v);
  const T* rel_bias = static_cast<const T*>(p.rel_bias);
  T* out = static_cast<T*>(p.out);
  acc_t* lse = static_cast<acc_t*>(p.lse);
  const int64_t rows = num_buckets(p.max_distance), group = p.heads / p.kv_heads, D = p.dim;
  const bool exact = spans_exact(p);
  // A block's rows reach at most k_len + kFwdRows - 1 buckets (max_distance may be huge when
  // there are no tables). Per block: the rows interleaved; the scores row by row; the
  // probabilities and the probability mass per bucket, interleaved; q . rel_k row by row; the
  // output rows.
  const int64_t reach = std::min(rows, p.k_len + kFwdRows - 1);
  std::vector<acc_t> qt(kFwdRows * D), sblk(kFwdRows * p.k_len), pt(kFwdRows * p.k_len);
  std::vector<acc_t> wt(kFwdRows * reach), qeblk(kFwdRows * reach), accblk(kFwdRows * D);
  std::vector<acc_t> kt, ekt, ke_lo, ke_hi;
  int64_t kt_of = -1;          // offset of the kv head whose keys are in kt
  const T* ekt_of = nullptr;   // table whose rows are in ekt
  int64_t ke_of = -1;          // kv head offset whose key-side ends are in ke_lo / ke_hi ...
  const T* ke_table = nullptr;  // ... for this rel_q
  const int64_t blocks = fwd_row_blocks(p.q_len);
  for (int64_t item = begin; item < end; ++item) {
    const int64_t bh = item / blocks, h = bh % p.heads, b = bh / p.heads;
    const int64_t i0 = item % blocks * kFwdRows, nr = std::min(kFwdRows, p.q_len - i0);
    const int64_t item0 = bh * p.q_len + i0;  // the block's first row (b, h, i0)
    const int64_t kv = (b * p.kv_heads + h / group) * p.kv_stride;
    if (kv != kt_of) {  // an item range holds few kv heads: a transpose per head, not per row
      transpose_rows<T, acc_t>(k + kv, p.k_len, D, kt);
      kt_of = kv;
    }
    const T* eq = key_side_table<T>(p, h);
    if (eq != nullptr && (kv != ke_of || eq != ke_table)) {
      key_side_ends<T, acc_t>(eq, kt, p.k_len, rows, D, ke_lo, ke_hi);
      ke_of = kv;
      ke_table = eq;
    }
    const T* ek = rel_k == nullptr ? nullptr : rel_k + (p.rel_k_per_head ? h * rows * D : 0);
    if (ek != nullptr && ek != ekt_of) {
      transpose_rows<T, acc_t>(ek, rows, D, ekt);
      ekt_of = ek;
    }
    const T* ev = rel_v == nullptr ? nullptr : rel_v + (p.rel_v_per_head ? h * rows * D : 0);
    const T* bias = rel_bias == nullptr ? nullptr : rel_bias + (p.rel_bias_per_head ? h * rows : 0);
    const BlockReach br = block_reach(p, i0, i0 + nr - 1);
    const int64_t jb = br.begin, je = br.end, u_lo = br.bucket0, nu = br.buckets;
    interleave_rows(q + item0 * D, nr, D, qt.data());
    scores(qt.data(), nr, nr, kt.data() + jb, p.k_len, je - jb, D, sblk.data() + jb, p.k_len);
    if (ek != nullptr) scores(qt.data(), nr, nr, ekt.data() + u_lo, rows, nu, D, qeblk.data(), nu);
    std::fill(wt.begin(), wt.begin() + nr * nu, acc_t(0));
    acc_t l[kFwdRows], m[kFwdRows];
    // 1. each row's logits and maximum over its reachable keys, then its probabilities and mass
    // per bucket
    for (int64_t r = 0; r < nr; ++r) {
      const int64_t i = i0 + r;
      acc_t* s = sblk.data() + r * p.k_len;
      const acc_t* qe = qeblk.data() + r * nu;  // qe[bucket - u_lo]
      const KeySpan vis = exact ? reachable_keys(p, i, i) : KeySpan{jb, je};
      std::fill(s + jb, s + vis.begin, kNegInf);
      std::fill(s + vis.end, s + je, kNegInf);
      acc_t mr = kNegInf;
      for (int64_t j = vis.begin; j < vis.end; ++j) {
        if (!exact && !key_visible(p, b, h, i, j)) {
          s[j] = kNegInf;
          continue;
        }
        acc_t e = s[j];
        const int64_t bucket = shaw_bucket(i, j, p.max_distance, p.q_offset, p.k_offset);
        if (ek != nullptr) e += qe[bucket - u_lo];
        if (eq != nullptr) {
          e += key_side_term<T, acc_t>(eq, k + kv + j * D, bucket, rows, D, ke_lo, ke_hi, j);
        }
        s[j] = e * static_cast<acc_t>(p.scale);
        if (bias != nullptr) s[j] += static_cast<acc_t>(bias[bucket]);
        if (s[j] > mr || s[j] != s[j]) mr = s[j];  // a NaN logit makes the row NaN, as in torch
      }
      m[r] = mr;
      l[r] = 0;
      if (mr == kNegInf) {  // no visible key: the row's output is zero
        for (int64_t j = jb; j < je; ++j) pt[j * nr + r] = acc_t(0);
        continue;
      }
      const RowDropout<acc_t> drop(p, b, h, i);
      for (int64_t j = jb; j < je; ++j) {
        if (s[j] == kNegInf) {  // masked
          pt[j * nr + r] = acc_t(0);
          continue;
        }
        const acc_t e = std::exp(s[j] - mr);
        l[r] += e;  // the normaliser is the one without dropout
        const acc_t pij = drop.d.on ? e * drop.factor(j) : e;
        pt[j * nr + r] = pij;
        if (ev != nullptr) {
          wt[(shaw_bucket(i, j, p.max_distance, p.q_offset, p.k_offset) - u_lo) * nr + r] += pij;
        }
      }
    }
    // 2. P V and the value term W @ rel_v of the block
    std::fill(accblk.begin(), accblk.begin() + nr * D, acc_t(0));
    accumulate(pt.data() + jb * nr, nr, nr, v + kv + jb * D, je - jb, D, accblk.data());
    if (ev != nullptr) accumulate(wt.data(), nr, nr, ev + u_lo * D, nu, D, accblk.data());
    // 3. the rows out
    for (int64_t r = 0; r < nr; ++r) {
      T* oi = out + (item0 + r) * D;
      const acc_t* acc = accblk.data() + r * D;
      if (m[r] == kNegInf) {
        for (int64_t d = 0; d < D; ++d) oi[d] = T(0);
        lse[item0 + r] = std::numeric_limits<acc_t>::infinity();
        continue;
      }
      for (int64_t d = 0; d < D; ++d) oi[d] = static_cast<T>(acc[d] / l[r]);
      lse[item0 + r] = m[r] + std::log(l[r]);
    }
  }
}

// Work items: (b, kv head) of batch * kv_heads; each item owns dk/dv of its kv head and the
// table-gradient partials of its query heads, so nothing is shared between threads. Query rows
// go in blocks of kBwdRows: the block's P and dS are computed first (with its score matmuls
// taking the rows four at a time, as in the forward), then every matmul of the block takes it
// whole: dk/dv of four keys at a time take the block's contributions in registers, and so do
// dq and the table gradients of four rows or buckets at a time (accumulate) - the same sums in
// the same order as row by row, except that with rel_q dk takes a block's key-side terms before
// its q terms. 16 rows and 8 (or 32) ran within noise of each other.
constexpr int64_t kBwdRows = 16;

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
  const bool exact = spans_exact(p);
  const int64_t L = p.k_len, reach = std::min(rows, L + kBwdRows - 1);  // buckets of a block, at most
  std::vector<acc_t> dk_acc(L * D), dv_acc(L * D), kt, vt, ekt, evt;
  // the key-side table: k_j . rel_q at the clamped buckets, and the dS mass each key sends there
  std::vector<acc_t> ke_lo, ke_hi, ds_lo, ds_hi;
  // per block: q and dO interleaved; P, dO . v and scale * dS row by row; dS key-major; dq
  std::vector<acc_t> qt(kBwdRows * D), dout_t(kBwdRows * D), pblk(kBwdRows * L), dpblk(kBwdRows * L);
  std::vector<acc_t> dsblk(kBwdRows * L), dscol(kBwdRows * L), dqblk(kBwdRows * D);
  // per block, over its buckets: q . rel_k and dO . rel_v row by row; the dS and P mass per bucket
  // row by row (gk: scaled), and the scaled dS mass bucket-major
  std::vector<acc_t> qeblk(kBwdRows * reach), deblk(kBwdRows * reach), gk(kBwdRows * reach);
  std::vector<acc_t> wp(kBwdRows * reach), gkt(kBwdRows * reach), wds(kBwdRows * reach);
  for (int64_t item = begin; item < end; ++item) {
    const int64_t b = item / p.kv_heads;
    const int64_t kv = item * L * D;             // dk, dv: packed
    const T* k_item = k + item * p.kv_stride;    // k, v: slabs kv_stride apart
    const T* v_item = v + item * p.kv_stride;
    transpose_rows<T, acc_t>(k_item, L, D, kt);
    transpose_rows<T, acc_t>(v_item, L, D, vt);
    std::fill(dk_acc.begin(), dk_acc.end(), acc_t(0));
    std::fill(dv_acc.begin(), dv_acc.end(), acc_t(0));
    for (int64_t h = item % p.kv_heads * group; h < (item % p.kv_heads + 1) * group; ++h) {
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
        key_side_ends<T, acc_t>(eq, kt, L, rows, D, ke_lo, ke_hi);
        ds_lo.assign(L, acc_t(0));
        ds_hi.assign(L, acc_t(0));
      }
      const int64_t row0 = (b * p.heads + h) * p.q_len;
      for (int64_t i0 = 0; i0 < p.q_len; i0 += kBwdRows) {
        const int64_t nr = std::min(kBwdRows, p.q_len - i0);
        const T* q_blk = q + (row0 + i0) * D;
        const T* do_blk = dout + (row0 + i0) * D;
        const BlockReach br = block_reach(p, i0, i0 + nr - 1);
        const int64_t jb = br.begin, je = br.end, u_lo = br.bucket0, nu = br.buckets;
        // 1. the block's scores, q_i . k_j and dO_i . v_j, and q_i . rel_k[b] and dO_i . rel_v[b]
        // over its buckets; then P and dS of each row and their sums per bucket
        interleave_rows(q_blk, nr, D, qt.data());
        interleave_rows(do_blk, nr, D, dout_t.data());
        scores(qt.data(), nr, nr, kt.data() + jb, L, je - jb, D, pblk.data() + jb, L);
        scores(dout_t.data(), nr, nr, vt.data() + jb, L, je - jb, D, dpblk.data() + jb, L);
        if (ek) scores(qt.data(), nr, nr, ekt.data() + u_lo, rows, nu, D, qeblk.data(), nu);
        if (ev) scores(dout_t.data(), nr, nr, evt.data() + u_lo, rows, nu, D, deblk.data(), nu);
        std::fill(wds.begin(), wds.begin() + nr * nu, acc_t(0));
        std::fill(wp.begin(), wp.begin() + nr * nu, acc_t(0));
        for (int64_t r = 0; r < nr; ++r) {
          const int64_t i = i0 + r, row = row0 + i;
          acc_t* pr = pblk.data() + r * L;
          acc_t* dsr = dsblk.data() + r * L;
          const acc_t li = lse[row];
          // no visible key (every p_ij is 0), or keys the causal limit or the window hide
          const KeySpan vis = std::isinf(li) ? KeySpan{jb, jb} : exact ? reachable_keys(p, i, i) : KeySpan{jb, je};
          for (const KeySpan hidden : {KeySpan{jb, vis.begin}, KeySpan{vis.end, je}}) {
            std::fill(pr + hidden.begin, pr + hidden.end, acc_t(0));
            std::fill(dsr + hidden.begin, dsr + hidden.end, acc_t(0));
          }
          if (vis.end == vis.begin) continue;
          // per bucket c - u_lo: q_i . rel_k, dO_i . rel_v, the sums of dS and P
          const acc_t* qe = qeblk.data() + r * nu;
          const acc_t* de = deblk.data() + r * nu;
          acc_t* wdsr = wds.data() + r * nu;
          acc_t* wpr = wp.data() + r * nu;
          const acc_t di = dot_product<T, acc_t>(do_blk + r * D, out + row * D, D);
          const acc_t* dprow = dpblk.data() + r * L;
          const RowDropout<acc_t> drop(p, b, h, i);
          for (int64_t j = vis.begin; j < vis.end; ++j) {
            if (!exact && !key_visible(p, b, h, i, j)) {
              pr[j] = dsr[j] = acc_t(0);
              continue;
            }
            const int64_t bucket = shaw_bucket(i, j, p.max_distance, p.q_offset, p.k_offset);
            const int64_t c = bucket - u_lo;
            acc_t sij = pr[j] + (ek ? qe[c] : acc_t(0));
            if (eq) sij += key_side_term<T, acc_t>(eq, k_item + j * D, bucket, rows, D, ke_lo, ke_hi, j);
            const acc_t e = bias ? std::exp(sij * scale + static_cast<acc_t>(bias[bucket]) - li)
                                 : std::exp(sij * scale - li);
            // with dropout: dv and drel_v take the dropped p, ds = p (keep / (1 - p) dp - d_i)
            const acc_t f = drop.d.on ? drop.factor(j) : acc_t(1);
            const acc_t pij = e * f;
            const acc_t dpij = dprow[j] + (ev ? de[c] : acc_t(0));
            const acc_t dsij = e * (drop.d.on ? f * dpij - di : dpij - di);
            wdsr[c] += dsij;
            wpr[c] += pij;
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
        // 2. dv_j += sum_r p_rj dO_r and dk_j += sum_r scale ds_rj q_r, four keys at a time; dq_r +=
        // sum_j scale ds_rj k_j (from dS key-major)
        accumulate(pblk.data() + jb, L, je - jb, do_blk, nr, D, dv_acc.data() + jb * D);
        accumulate(dsblk.data() + jb, L, je - jb, q_blk, nr, D, dk_acc.data() + jb * D);
        for (int64_t r = 0; r < nr; ++r) {
          for (int64_t j = jb; j < je; ++j) dscol[j * nr + r] = dsblk[r * L + j];
        }
        std::fill(dqblk.begin(), dqblk.begin() + nr * D, acc_t(0));
        accumulate(dscol.data() + jb * nr, nr, nr, k_item + jb * D, je - jb, D, dqblk.data());
        // 3. the relative terms over the block's buckets: dq_r += sum_b scale ds_rb rel_k[b],
        // drel_k[b] += sum_r scale ds_rb q_r, drel_v[b] += sum_r p_rb dO_r, drel_bias[b] += ds_b
        if (ek || pbh) {
          for (int64_t r = 0; r < nr; ++r) {
            for (int64_t c = 0; c < nu; ++c) {
              gk[r * nu + c] = scale * wds[r * nu + c];
              gkt[c * nr + r] = gk[r * nu + c];
              if (pbh) pbh[u_lo + c] += wds[r * nu + c];
            }
          }
        }
        if (ek) {
          accumulate(gkt.data(), nr, nr, ek + u_lo * D, nu, D, dqblk.data());
          accumulate(gk.data(), nu, nu, q_blk, nr, D, pkh + u_lo * D);
        }
        if (ev) accumulate(wp.data(), nu, nu, do_blk, nr, D, pvh + u_lo * D);
        for (int64_t r = 0; r < nr; ++r) {
          for (int64_t d = 0; d < D; ++d) dq[(row0 + i0 + r) * D + d] = static_cast<T>(dqblk[r * D + d]);
        }
      }
      if (eq) {  // the clamped buckets of the key-side table, once per key
        const T* e_lo = eq;
        const T* e_hi = eq + (rows - 1) * D;
        for (int64_t j = 0; j < L; ++j) {
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
    for (int64_t e = 0; e < L * D; ++e) {
      dk[kv + e] = static_cast<T>(dk_acc[e]);
      dv[kv + e] = static_cast<T>(dv_acc[e]);
    }
  }
}

}  // namespace relpos::cpu::RELPOS_SCALAR_ATTENTION_NS
