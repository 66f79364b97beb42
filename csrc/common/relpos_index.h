// Index math of relative positions: the one place where distances, Shaw buckets and the Music
// Transformer skew are defined. Used by the CPU kernels, the CUDA kernels and the emulator.
//
//   pos_q(i) = q_offset + i,  pos_k(j) = k_offset + j
//   r(i, j)  = pos_k(j) - pos_q(i)                  "key minus query" (Shaw et al. 2018, T5)
//   b(i, j)  = clamp(r(i, j), -K, K) + K            row of a [2K+1, D] table
//   skew:    y[i, j] = x[i, j - i + Lq - 1]         (Huang et al. 2018; tensor2tensor's
//                                                    _relative_position_to_absolute_position_*)
#pragma once

#include <cstdint>

#include "macros.h"

namespace relpos {

RELPOS_HD int64_t rel_distance(int64_t i, int64_t j, int64_t q_offset, int64_t k_offset) {
  return (k_offset + j) - (q_offset + i);
}

RELPOS_HD int64_t clamp_bucket(int64_t r, int64_t max_distance) {
  const int64_t c = r < -max_distance ? -max_distance : (r > max_distance ? max_distance : r);
  return c + max_distance;
}

RELPOS_HD int64_t shaw_bucket(int64_t i, int64_t j, int64_t max_distance, int64_t q_offset,
                              int64_t k_offset) {
  return clamp_bucket(rel_distance(i, j, q_offset, k_offset), max_distance);
}

RELPOS_HD int64_t num_buckets(int64_t max_distance) { return 2 * max_distance + 1; }

// Columns of query row i whose bucket is not clamped, as the half-open range [begin, end) of
// key indices clipped to [0, k_len). Keys left of it all map to bucket 0, keys right of it to 2K;
// inside it the bucket grows by one per key, which is what makes the skew a contiguous copy.
struct KeySpan {
  int64_t begin;
  int64_t end;
};

RELPOS_HD KeySpan unclamped_keys(int64_t i, int64_t k_len, int64_t max_distance, int64_t q_offset,
                                 int64_t k_offset) {
  // r(i, j) in [-K, K]  <=>  j in [q_offset + i - k_offset - K, q_offset + i - k_offset + K]
  const int64_t lo = q_offset + i - k_offset - max_distance;
  const int64_t hi = q_offset + i - k_offset + max_distance + 1;
  KeySpan s;
  s.begin = lo < 0 ? 0 : (lo > k_len ? k_len : lo);
  s.end = hi < 0 ? 0 : (hi > k_len ? k_len : hi);
  if (s.end < s.begin) s.end = s.begin;
  return s;
}

// Keys of query row i strictly inside the clipping window, |r(i, j)| < K, as [begin, end) clipped
// to [0, k_len): there bucket = r + K takes each value 1..2K-1 once. Keys before `begin` are in
// bucket 0 and keys from `end` on in bucket 2K (for K = 0 both are bucket 0). Fused attention
// kernels use it to treat the two clamped buckets as running sums and the inside as a band.
RELPOS_HD KeySpan inner_keys(int64_t i, int64_t k_len, int64_t max_distance, int64_t q_offset,
                             int64_t k_offset) {
  if (max_distance == 0) {
    const int64_t t = q_offset + i - k_offset + 1;  // keys j < t have r <= 0: bucket "0 from below"
    const int64_t c = t < 0 ? 0 : (t > k_len ? k_len : t);
    return KeySpan{c, c};
  }
  return unclamped_keys(i, k_len, max_distance - 1, q_offset, k_offset);
}

// The keys of row i whose bucket is b, as a half-open range clipped to [0, k_len): the inverse of
// shaw_bucket for one row. A middle bucket (0 < b < 2K) holds at most the one key at distance
// b - K; bucket 0 collects every key at distance <= -K and bucket 2K every key at distance >= K
// (for K = 0 both are the whole row). Used by the scatter-style backward kernels.
RELPOS_HD KeySpan bucket_keys(int64_t i, int64_t b, int64_t k_len, int64_t max_distance,
                              int64_t q_offset, int64_t k_offset) {
  const int64_t j_at = q_offset + i - k_offset + (b - max_distance);  // r(i, j_at) = b - K
  const int64_t lo = b == 0 ? 0 : j_at;
  const int64_t hi = b == 2 * max_distance ? k_len : j_at + 1;
  KeySpan s;
  s.begin = lo < 0 ? 0 : (lo > k_len ? k_len : lo);
  s.end = hi < 0 ? 0 : (hi > k_len ? k_len : hi);
  if (s.end < s.begin) s.end = s.begin;
  return s;
}

// The rows i in [0, q_len) for which bucket_keys(i, b, ...) is not empty, as a half-open range.
// The key j_at = q_offset + i - k_offset + b - K moves right by one per row, so these rows are
// contiguous: bucket 0 needs j_at >= 0 only (its keys are [0, j_at]), bucket 2K needs
// j_at < k_len only (keys [j_at, k_len)), a middle bucket needs both.
struct RowSpan {
  int64_t begin;
  int64_t end;
};

RELPOS_HD RowSpan bucket_rows(int64_t b, int64_t q_len, int64_t k_len, int64_t max_distance,
                              int64_t q_offset, int64_t k_offset) {
  RowSpan s;
  s.begin = 0;
  s.end = k_len > 0 ? q_len : 0;
  const int64_t i_first = max_distance - b - q_offset + k_offset;  // row with j_at = 0
  if (b != 2 * max_distance && i_first > s.begin) s.begin = i_first;
  if (b != 0 && i_first + k_len < s.end) s.end = i_first + k_len;
  if (s.end < 0) s.end = 0;
  if (s.begin > s.end) s.begin = s.end;  // empty, and inside [0, q_len)
  return s;
}

// Inner buckets (1 .. 2K-1, where the bucket is not clamped) reached by query rows
// [i0, i0 + nq) and keys [j0, j0 + nk), as a half-open range: contiguous because b(i, j) moves by
// one per row and per key, at most nq + nk - 1 wide, empty for K = 0. The CUDA fused attention
// stages exactly these table rows for each (query tile, key tile) pair.
struct BucketSpan {
  int64_t begin;
  int64_t end;
};

RELPOS_HD BucketSpan tile_inner_buckets(int64_t i0, int64_t nq, int64_t j0, int64_t nk,
                                        int64_t max_distance, int64_t q_offset, int64_t k_offset) {
  BucketSpan s{1, 1};
  if (max_distance == 0 || nq <= 0 || nk <= 0) return s;
  const int64_t lo = shaw_bucket(i0 + nq - 1, j0, max_distance, q_offset, k_offset);
  const int64_t hi = shaw_bucket(i0, j0 + nk - 1, max_distance, q_offset, k_offset) + 1;
  s.begin = lo < 1 ? 1 : lo;
  s.end = hi > 2 * max_distance ? 2 * max_distance : hi;
  if (s.end < s.begin) s.end = s.begin;
  return s;
}

// Buckets touched by any (i, j) with i < q_len, j < k_len: [first, last]. Because b(i, j) grows
// with j and shrinks with i, the extremes are b(q_len - 1, 0) and b(0, k_len - 1).
RELPOS_HD int64_t first_bucket(int64_t q_len, int64_t max_distance, int64_t q_offset,
                               int64_t k_offset) {
  return shaw_bucket(q_len - 1, 0, max_distance, q_offset, k_offset);
}
RELPOS_HD int64_t last_bucket(int64_t k_len, int64_t max_distance, int64_t q_offset,
                              int64_t k_offset) {
  return shaw_bucket(0, k_len - 1, max_distance, q_offset, k_offset);
}

// The max_distance K' <= K that gives every (i, j) of a q_len x k_len problem the table row K
// gives it, on the slice [K - K', K + K'] of the table: when every |r(i, j)| is below K no
// bucket is clamped, and row K + r of the table is row K' + r of the slice, with K' the largest
// |r| (at the ends r(q_len - 1, 0) and r(0, k_len - 1)). Otherwise, or for an empty problem, K.
RELPOS_HD int64_t used_max_distance(int64_t q_len, int64_t k_len, int64_t max_distance,
                                    int64_t q_offset, int64_t k_offset) {
  if (q_len <= 0 || k_len <= 0) return max_distance;
  const int64_t lo = rel_distance(q_len - 1, 0, q_offset, k_offset);
  const int64_t hi = rel_distance(0, k_len - 1, q_offset, k_offset);
  if (lo <= -max_distance || hi >= max_distance) return max_distance;
  const int64_t a = lo < 0 ? -lo : lo, b = hi < 0 ? -hi : hi;
  return a > b ? a : b;
}

// Skew (Music Transformer): x has width q_len + k_len - 1, column c holds relative distance
// c - (q_len - 1); output column j of row i reads column skew_col(i, j).
RELPOS_HD int64_t skew_width(int64_t q_len, int64_t k_len) { return q_len + k_len - 1; }
RELPOS_HD int64_t skew_col(int64_t i, int64_t j, int64_t q_len) { return j - i + q_len - 1; }

// Causal skew: x is [L, L], column c holds distance c - (L - 1) (only -(L-1)..0 exist); output
// (i, j) is x[i, skew_col(i, j, L)] for j <= i and zero above the diagonal.
RELPOS_HD bool causal_visible(int64_t i, int64_t j) { return j <= i; }

// RoPE (Su et al. 2021): pair f (0 <= f < rot / 2) of a row's first `rot` features is the
// pair (f, f + rot / 2) in the half-split layout (HF's rotate_half: Llama, GPT-NeoX, Qwen) and
// (2f, 2f + 1) in the interleaved one (rotate_every_two: GPT-J, RoFormer, CodeGen).
RELPOS_HD int64_t rope_first(int64_t f, bool interleaved) { return interleaved ? 2 * f : f; }
RELPOS_HD int64_t rope_second(int64_t f, int64_t rot, bool interleaved) {
  return interleaved ? 2 * f + 1 : f + rot / 2;
}
// The offset of row `row` (of n0 * n1 * n2) in cos and sin (RopeParams).
RELPOS_HD int64_t rope_cos_offset(int64_t row, int64_t n1, int64_t n2, int64_t cs0, int64_t cs1,
                                  int64_t cs2) {
  const int64_t i2 = row % n2, i1 = (row / n2) % n1, i0 = row / (n1 * n2);
  return i0 * cs0 + i1 * cs1 + i2 * cs2;
}
// One pair, in the accumulation type A: forward (ya, yb) = (xa ca - xb sa, xb cb + xa sb), the
// inverse (the adjoint) (xa ca + xb sb, xb cb - xa sa).
template <typename A>
RELPOS_HD void rope_rotate(A xa, A xb, A ca, A cb, A sa, A sb, bool inverse, A& ya, A& yb) {
  if (inverse) {
    ya = xa * ca + xb * sb;
    yb = xb * cb - xa * sa;
  } else {
    ya = xa * ca - xb * sa;
    yb = xb * cb + xa * sb;
  }
}

}  // namespace relpos
