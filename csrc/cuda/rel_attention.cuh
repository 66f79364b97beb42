// Fused Shaw attention (Shaw et al. 2018, relative keys and values), forward and backward, in the
// style of FlashAttention-2 (Dao 2023): tiles of queries and keys, an online softmax, no [Lq, Lk]
// matrix anywhere. Maths and layouts: RelAttentionParams / RelAttentionBwdParams (common/params.h);
//   s_ij = (q_i . k_j + q_i . rel_k[b(i, j)]) * scale (+ rel_bias[b(i, j)]),
//   out_i = sum_j p_ij (v_j + rel_v[b(i, j)])
//
// Relative terms (as the AVX2 kernel, cpu/rel_attention_avx2.cpp): per query row the keys split into
// bucket-0 keys, the inner keys (common/relpos_index.h inner_keys, bucket = r + K, one new bucket per
// key: the skew) and bucket-2K keys. The two clamped buckets are per-row scalars (q_i . rel_k[0],
// q_i . rel_k[2K] and the probability mass of each, rescaled with the online softmax, applied at the
// end). The inner buckets of a (query tile, key tile) pair are a contiguous band of at most
// kOwn + 32 - 1 table rows (tile_inner_buckets); the band is staged in shared memory next to the
// key tile and each (i, j) reads its row along the skew. rel_bias (one scalar per bucket, added
// after the scale) is staged the same way per tile pair, its two clamped entries first
// (stage_bias); its gradient is the unscaled dS summed per bucket, in the dq kernel with the
// table gradients.
//
// Tiling: a block of 4 warps owns 16 rows (8 for float64; query rows in the forward and the dq
// kernel, key rows in the dk/dv kernel), 4 (2) per warp, held in shared memory at full head dim (up to kD = 32 kDC) and as
// register accumulators (column d = lane + 32 c of each owned row). The other side streams in tiles
// of 32, one per lane: lane l computes the dot products of its key (or query) with the warp's 4 rows
// over chunks of kDK columns staged in shared memory. Head dims up to 256, any value (zero-padded).
// Backward (all deterministic except the table-gradient partials, which take float atomics, in a
// fixed order only with RelAttentionBwdParams::serial_q_tiles):
//   rows kernel  per query row: D_i = dO_i . O_i and the four clamped-bucket dots -> workspace
//   dq kernel    per query tile, loops over key tiles: dq, and drel_k/drel_v/drel_bias partials
//                (atomicAdd)
//   dkdv kernel  per key tile of one kv head, loops over the group's query heads and query tiles
// For float16/bfloat16 the tensor-core kernels (rel_attention_tc_bwd.cuh) take the dq and dk/dv
// parts where they cover the case, after the same rows kernel.
#pragma once

#include <math.h>

#include <cstdint>

#include "common/dropout.h"
#include "common/params.h"
#include "common/relpos_index.h"
#include "cuda/device.cuh"
#include "cuda/dtype.cuh"

namespace relpos::cuda {

// Per query row of the backward, computed once by the rows kernel: D_i and the clamped dots.
enum RowTerm : int { kRowDi = 0, kRowQeLo, kRowQeHi, kRowDeLo, kRowDeHi, kRowTerms };

template <typename A, int kDC>
struct AttnTile {
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kRows = sizeof(A) == 8 ? 2 : 4;  // owned rows per warp (float64: fewer
                                                        // registers per accumulator row)
  static constexpr int kOwn = kWarps * kRows;          // owned rows per block
  static constexpr int kLanes = 32;                    // streamed tile: one row per lane
  static constexpr int kD = 32 * kDC;                  // largest head dim of this instantiation
  static constexpr int kDK = (sizeof(A) == 8 || kDC == 1) ? 32 : 64;  // staged columns per chunk
  static constexpr int kCPC = kDK / 32;                // accumulator column groups per chunk
  static constexpr int kChunks = kD / kDK;
  static constexpr int kLd = kDK + 1;                  // chunk row stride: odd, conflict-free
  static constexpr int kBand = kOwn + kLanes - 1;      // table rows of one tile pair
  static constexpr int kLdP = kLanes + 1;
  static constexpr int kBiasSmem = 2 + kBand;          // staged rel_bias (stage_bias)
  // staged rel_q rows of a chunk (stage_key_side: bucket 0, bucket 2K, the band) and, for the
  // dk/dv kernel, the clamped dS mass of each owned key
  static constexpr int kKeySideSmem = (2 + kBand) * kLd + 2 * kOwn;

  // Dynamic shared memory of each kernel, in elements of A (layouts in the kernels); the staged
  // bias at the end, only with a bias, and after it the staged rel_q, only with one (the rel_q
  // kernels are also the bias kernels, kBias, so they always hold the bias's room).
  static constexpr int tail_smem(bool bias, bool rel_q) {
    return (bias || rel_q ? kBiasSmem : 0) + (rel_q ? kKeySideSmem : 0);
  }
  static constexpr int fwd_smem(bool bias, bool rel_q) {
    return kOwn * kD + (kLanes + kBand) * kLd + kOwn * kLdP + 2 * kOwn + tail_smem(bias, rel_q);
  }
  static constexpr int dq_smem(bool bias, bool rel_q) {
    return 2 * kOwn * kD + 2 * (kLanes + kBand) * kLd + 2 * kOwn * kLdP +
           (4 + 1 + kRowTerms) * kOwn + tail_smem(bias, rel_q);
  }
  static constexpr int dkdv_smem(bool bias, bool rel_q) {
    return 2 * kOwn * kD + 2 * (kLanes + kBand) * kLd + 2 * kOwn * kLdP + tail_smem(bias, rel_q) +
           (rel_q ? kOwn * kD : 0);  // sDkq
  }
};

// The SIMT kernels' softmax keeps its logits in natural units, as the op's log-sum-exp: x =
// (q . k + terms) * scale (+ bias), P = 2^((x - m) log2 e) by exp2_acc, lse = m + ln l. The
// backward recomputes P = 2^((x - lse) log2 e) and forms x by the same operations as the
// forward (the scale by mul_rn, so that no FMA contraction rounds it differently in one of
// them): a row with one dominant key then gets exactly 1, at any size of the logits. Logits in
// base 2 (scale * log2 e) against the lse in base e, as before, cost up to 3 ulp of the lse in
// the round trip wherever the scale is no power of 2: at head dim 32 and logits of 1e5, dv was
// 3% off, at 1e9 inf. That is one multiply more per probability. kLog2e is in common/params.h.
// (The tensor-core kernels still work in base 2.)
// In float, exp2 is one MUFU.EX2 (PTX ex2.approx.ftz.f32), which gives +0 for results below
// 2^-126, the smallest normal float. CUDA's exp2f adds a compare and two multiplies around it
// to return those as denormals: three more instructions per probability. A probability below
// 2^-126 is that fraction of the row's largest one, whose own is 1, so it cannot move a float32
// sum; the CPU backward flushes them too (FlushDenormals). Same result as exp2f otherwise.
// The emulator (no inline PTX) flushes the same results to 0.
RELPOS_DEVICE float exp2_acc(float x) {
#if !defined(RELPOS_CUDA_EMU) && defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return x < -126.f ? 0.f : exp2f(x);
#endif
}
RELPOS_DEVICE double exp2_acc(double x) { return exp2(x); }
// a * b rounded as it stands, never contracted into an FMA with a following add
RELPOS_DEVICE float mul_rn(float a, float b) { return __fmul_rn(a, b); }
RELPOS_DEVICE double mul_rn(double a, double b) { return __dmul_rn(a, b); }
RELPOS_DEVICE float log_acc(float x) { return logf(x); }
RELPOS_DEVICE double log_acc(double x) { return log(x); }

// Head h's rows of an optional table (rel_k, rel_v, rel_q: head_elems = (2K+1) D; rel_bias:
// 2K+1): the table itself when shared, its h-th slab when per head, null when absent.
template <typename T>
RELPOS_DEVICE const T* head_table(const void* t, bool per_head, int64_t h, int64_t head_elems) {
  return t == nullptr ? nullptr : static_cast<const T*>(t) + (per_head ? h * head_elems : 0);
}

// Key j visible from query row i of head h (both in range): causal positions, the padding and
// attention masks, the segments, the window.
RELPOS_DEVICE bool attn_visible(const RelAttentionParams& p, int64_t b, int64_t h, int64_t i,
                                int64_t j) {
  if (i >= p.q_len || j >= p.k_len) return false;
  if (p.causal && p.k_offset + j > p.q_offset + i) return false;
  if (masks_hide(p, b, h, i, j)) return false;
  return p.key_padding_mask == nullptr || !p.key_padding_mask[b * p.k_len + j];
}

// Attention dropout (common/dropout.h): the factor of (row key of query i, key j), keep_scale
// when kept and 0 when dropped; 1 when dropout is off.
RELPOS_DEVICE uint32_t attn_dropout_key(const RelAttentionParams& p, int64_t bh, int64_t i) {
  return p.dropout.on ? dropout_row_key(p.dropout.seed, bh, i) : 0u;
}
template <typename A>
RELPOS_DEVICE A attn_dropout(const RelAttentionParams& p, uint32_t row_key, int64_t j) {
  if (!p.dropout.on) return A(1);
  return dropout_kept(row_key, j, p.dropout.threshold) ? static_cast<A>(p.dropout.keep_scale) : A(0);
}

// Whether the attention mask, the segment ids or the window hide every (i, j) of the rows
// [i0, i0 + ni) and keys [j0, j0 + nj) from head h of batch b: such a tile pair adds nothing
// (all its probabilities are 0) and is skipped, so that a block-sparse mask (packed documents)
// costs only the tiles it leaves visible. Decided by the whole block (a barrier): call it from
// every thread, with the same arguments, when has_tile_masks(p).
template <typename Tl>
RELPOS_DEVICE bool attn_tile_hidden(const RelAttentionParams& p, int64_t b, int64_t h, int64_t i0,
                                    int64_t ni, int64_t j0, int64_t nj) {
  int visible = 0;
  for (int64_t idx = threadIdx.x; idx < ni * nj; idx += Tl::kThreads) {
    visible |= !masks_hide(p, b, h, i0 + idx / nj, j0 + idx % nj);
  }
  return __syncthreads_or(visible) == 0;
}
// Not the window: the loops start and end at its first and last reachable tiles, and every
// tile between has a pair inside it (the rows' windows overlap), so a vote would never skip one.
RELPOS_DEVICE bool has_tile_masks(const RelAttentionParams& p) {
  return p.attn_mask != nullptr || p.q_segment_ids != nullptr;
}

// Keys a query tile [i0, i0 + nq) can see: [0, end).
// [attn_key_begin, attn_key_end): the causal limit and the window bound them.
RELPOS_DEVICE int64_t attn_key_end(const RelAttentionParams& p, int64_t i0, int64_t nq) {
  int64_t e = p.k_len;
  if (p.causal) e = p.q_offset + i0 + nq - p.k_offset;  // keys j <= q_offset + i_last - k_offset
  if (p.window_right >= 0) {  // r <= window_right for the last row
    const int64_t w = p.q_offset + i0 + nq - p.k_offset + p.window_right;
    e = w < e ? w : e;
  }
  return e < 0 ? 0 : (e > p.k_len ? p.k_len : e);
}
RELPOS_DEVICE int64_t attn_key_begin(const RelAttentionParams& p, int64_t i0) {
  if (p.window_left < 0) return 0;
  const int64_t b = p.q_offset + i0 - p.k_offset - p.window_left;  // r >= -window_left for row i0
  return b < 0 ? 0 : (b > p.k_len ? p.k_len : b);
}

// Query rows that can see a key of the key tile [j0, j0 + nk): [attn_query_begin,
// attn_query_end); i >= k_offset + j0 - q_offset when causal, i >= k_offset + j0 - q_offset -
// window_right and i <= k_offset + j_last - q_offset + window_left with a window.
RELPOS_DEVICE int64_t attn_query_begin(const RelAttentionParams& p, int64_t j0) {
  int64_t i = 0;
  if (p.causal) i = p.k_offset + j0 - p.q_offset;
  if (p.window_right >= 0 && p.k_offset + j0 - p.q_offset - p.window_right > i) {
    i = p.k_offset + j0 - p.q_offset - p.window_right;
  }
  return i < 0 ? 0 : i;
}
RELPOS_DEVICE int64_t attn_query_end(const RelAttentionParams& p, int64_t j0, int64_t nk) {
  if (p.window_left >= 0 && p.k_offset + j0 + nk - p.q_offset + p.window_left < p.q_len) {
    return p.k_offset + j0 + nk - p.q_offset + p.window_left;
  }
  return p.q_len;
}

// Row of the staged band for (i, j), clamped into the band so that every lane reads valid memory
// (its value is used only when j is an inner key of row i).
RELPOS_DEVICE int band_row(const RelAttentionParams& p, int64_t i, int64_t j, const BucketSpan& band) {
  const int64_t n = band.end - band.begin;
  int64_t r = shaw_bucket(i, j, p.max_distance, p.q_offset, p.k_offset) - band.begin;
  r = r < 0 ? 0 : (r >= n ? n - 1 : r);
  return static_cast<int>(r < 0 ? 0 : r);
}

// The rel_bias of one (query tile, key tile) pair (added after the scale, as the logits):
// dst[0] = bias[0], dst[1] = bias[2K] (the clamped buckets), dst[2 + c] = bias[band.begin + c] for
// the nb inner buckets of the band. `bias` is the head's row of rel_bias; table_rows = 2K + 1.
// The caller orders it between barriers (the previous tile's readers done before, its own after).
template <typename Tl, typename T, typename A>
RELPOS_DEVICE void stage_bias(A* dst, const T* bias, int64_t table_rows, const BucketSpan& band,
                              int nb) {
  for (int idx = threadIdx.x; idx < nb + 2; idx += Tl::kThreads) {
    const int64_t bucket = idx == 0 ? 0 : (idx == 1 ? table_rows - 1 : band.begin + idx - 2);
    dst[idx] = A(to_float(bias[bucket]));
  }
}

// The staged bias (stage_bias) of key j for a row whose inner keys are `in` and whose band row
// for j is erow (band_row): bucket 0 left of the inner keys, bucket 2K right of them.
template <typename A>
RELPOS_DEVICE A staged_bias(const A* sB, int64_t j, const KeySpan& in, int erow) {
  return j < in.begin ? sB[0] : (j >= in.end ? sB[1] : sB[2 + erow]);
}

// dst[r][c] = src[r][d0 + c] for r < rows, c < kDK (row stride kLd), zero beyond `valid` rows and
// beyond column `dim`; src rows are `dim` apart.
template <typename Tl, typename T, typename A>
RELPOS_DEVICE void stage_chunk(A* dst, const T* src, int rows, int64_t valid, int64_t dim,
                               int64_t d0) {
  for (int idx = threadIdx.x; idx < rows * Tl::kDK; idx += Tl::kThreads) {
    const int r = idx / Tl::kDK, c = idx % Tl::kDK;
    dst[r * Tl::kLd + c] = (r < valid && d0 + c < dim) ? A(to_float(src[r * dim + d0 + c])) : A(0);
  }
}

// The rel_q rows (key-side table, rel_q of one head: `eq`) one (query tile, key tile) pair reads,
// columns [d0, d0 + kDK) (stride kLd, zero beyond `dim`): dst[0] = eq[0], dst[1] = eq[2K] (the
// clamped buckets), dst[2 + c] = eq[band.begin + c] for the nb inner buckets of the band.
// table_rows = 2K + 1.
template <typename Tl, typename T, typename A>
RELPOS_DEVICE void stage_key_side(A* dst, const T* eq, int64_t table_rows, const BucketSpan& band,
                                  int nb, int64_t dim, int64_t d0) {
  for (int idx = threadIdx.x; idx < (nb + 2) * Tl::kDK; idx += Tl::kThreads) {
    const int r = idx / Tl::kDK, c = idx % Tl::kDK;
    const int64_t bucket = r == 0 ? 0 : (r == 1 ? table_rows - 1 : band.begin + r - 2);
    dst[r * Tl::kLd + c] = d0 + c < dim ? A(to_float(eq[bucket * dim + d0 + c])) : A(0);
  }
}

// Row of the staged rel_q (stage_key_side) for key j of a query row whose inner keys are `in` and
// whose band row for j is erow (band_row): 0 left of the inner keys, 1 right of them.
RELPOS_DEVICE int key_side_row(int64_t j, const KeySpan& in, int erow) {
  return j < in.begin ? 0 : (j >= in.end ? 1 : 2 + erow);
}

// k_j . rel_q[b(i, j)] over one staged chunk, for each of a warp's rows rr: the key is key[dd]
// (stride 1), its staged rel_q row eqs[qrow[rr]] (stride kLd). In the forward and the dq kernel
// the key is the lane's streamed row (one key, a row per rr); in the dk/dv kernel the owned key
// rows (key + rr kD) meet the lane's query.
template <typename Tl, typename A>
RELPOS_DEVICE void key_side_dots(const A* key, int key_stride, int n, const A* eqs,
                                 const int (&qrow)[Tl::kRows], A (&ke)[Tl::kRows]) {
  RELPOS_UNROLL4
  for (int dd = 0; dd < n; ++dd) {
    RELPOS_UNROLL
    for (int rr = 0; rr < Tl::kRows; ++rr) {
      ke[rr] += key[rr * key_stride + dd] * eqs[qrow[rr] * Tl::kLd + dd];
    }
  }
}

// dst[r][d] = src[r][d] for the kOwn owned rows at full width kD (row stride kD), zero-padded.
template <typename Tl, typename T, typename A>
RELPOS_DEVICE void stage_owned(A* dst, const T* src, int64_t valid, int64_t dim) {
  for (int idx = threadIdx.x; idx < Tl::kOwn * Tl::kD; idx += Tl::kThreads) {
    const int r = idx / Tl::kD, d = idx % Tl::kD;
    dst[idx] = (r < valid && d < dim) ? A(to_float(src[r * dim + d])) : A(0);
  }
}

// One staged chunk of the score dots: for each of the warp's rows rr (owned, broadcast reads of
// `own` at column d0 + dd) and this lane's streamed row (`str`, stride kLd):
//   s[rr] += own . str,  se[rr] += own . band[erow[rr]]   (the latter only with kBandOn)
template <typename Tl, bool kBandOn, typename A>
RELPOS_DEVICE void chunk_dots(const A* own, int64_t d0, int n, const A* str, const A* band,
                              const int (&erow)[Tl::kRows], A (&s)[Tl::kRows], A (&se)[Tl::kRows]) {
  RELPOS_UNROLL4
  for (int dd = 0; dd < n; ++dd) {
    const A x = str[dd];
    RELPOS_UNROLL
    for (int rr = 0; rr < Tl::kRows; ++rr) {
      const A o = own[rr * Tl::kD + d0 + dd];
      s[rr] += o * x;
      if (kBandOn) se[rr] += o * band[erow[rr] * Tl::kLd + dd];
    }
  }
}

// Same with the roles of the operands swapped (dkdv kernel): the owned rows are keys/values, the
// streamed lane row is a query (or dO) row that also meets the band:
//   s[rr] += own . str,  se[rr] += str . band[erow[rr]]
template <typename Tl, bool kBandOn, typename A>
RELPOS_DEVICE void chunk_dots_t(const A* own, int64_t d0, int n, const A* str, const A* band,
                                const int (&erow)[Tl::kRows], A (&s)[Tl::kRows],
                                A (&se)[Tl::kRows]) {
  RELPOS_UNROLL4
  for (int dd = 0; dd < n; ++dd) {
    const A x = str[dd];
    RELPOS_UNROLL
    for (int rr = 0; rr < Tl::kRows; ++rr) {
      s[rr] += own[rr * Tl::kD + d0 + dd] * x;
      if (kBandOn) se[rr] += x * band[erow[rr] * Tl::kLd + dd];
    }
  }
}

template <typename Tl, typename A>
RELPOS_DEVICE void score_dots(bool band_on, const A* own, int64_t d0, int n, const A* str,
                              const A* band,
                              const int (&erow)[Tl::kRows], A (&s)[Tl::kRows], A (&se)[Tl::kRows]) {
  if (band_on) {
    chunk_dots<Tl, true>(own, d0, n, str, band, erow, s, se);
  } else {
    chunk_dots<Tl, false>(own, d0, n, str, band, erow, s, se);
  }
}

template <typename Tl, typename A>
RELPOS_DEVICE void score_dots_t(bool band_on, const A* own, int64_t d0, int n, const A* str,
                              const A* band,
                                const int (&erow)[Tl::kRows], A (&s)[Tl::kRows],
                                A (&se)[Tl::kRows]) {
  if (band_on) {
    chunk_dots_t<Tl, true>(own, d0, n, str, band, erow, s, se);
  } else {
    chunk_dots_t<Tl, false>(own, d0, n, str, band, erow, s, se);
  }
}

// acc[rr][ch kCPC + cc] += sum_{jj < n} w[rr][jj] * str[jj][cc 32 + lane]  (one staged chunk ch)
// and, with a band, += sum over row rr's inner keys of w[rr][jj] * band[bucket(rr, jj)][...].
// ch is a loop index of a fully unrolled loop at every call, so acc's indices are constants.
template <typename Tl, typename A>
RELPOS_DEVICE void chunk_accumulate(A (&acc)[Tl::kRows][Tl::kChunks * Tl::kCPC], int ch, const A* w,
                                    const A* str, int n, int lane) {
  for (int jj = 0; jj < n; ++jj) {
    A x[Tl::kCPC];
    RELPOS_UNROLL
    for (int cc = 0; cc < Tl::kCPC; ++cc) x[cc] = str[jj * Tl::kLd + cc * 32 + lane];
    RELPOS_UNROLL
    for (int rr = 0; rr < Tl::kRows; ++rr) {
      const A wj = w[rr * Tl::kLdP + jj];
      RELPOS_UNROLL
      for (int cc = 0; cc < Tl::kCPC; ++cc) acc[rr][ch * Tl::kCPC + cc] += wj * x[cc];
    }
  }
}

// The band part for one owned query row: keys [jb, je) of the tile (tile-relative) are inner keys,
// key jj reads band row first + jj (the skew: one bucket per key).
template <typename Tl, typename A>
RELPOS_DEVICE void chunk_accumulate_band(A (&acc_row)[Tl::kChunks * Tl::kCPC], int ch, const A* w_row,
                                         const A* band, int jb, int je, int first, int lane) {
  for (int jj = jb; jj < je; ++jj) {
    const A wj = w_row[jj];
    const A* e = band + (first + jj) * Tl::kLd + lane;
    RELPOS_UNROLL
    for (int cc = 0; cc < Tl::kCPC; ++cc) acc_row[ch * Tl::kCPC + cc] += wj * e[cc * 32];
  }
}

// The band part for all owned rows of a warp (rows i_first .. i_first + kRows - 1): each row's
// inner keys within the key tile [j0, j0 + nk) read the staged band along the skew. Shared by the
// forward (probabilities x rel_v band) and the dq kernel (dS x rel_k band).
template <typename Tl, typename A>
RELPOS_DEVICE void accumulate_inner_band(A (&acc)[Tl::kRows][Tl::kChunks * Tl::kCPC], int ch,
                                         const A* w, const A* band_smem,
                                         const RelAttentionParams& p, int64_t i_first, int64_t j0,
                                         int64_t nk, const BucketSpan& band, int lane) {
  const int64_t K = p.max_distance;
  RELPOS_UNROLL
  for (int rr = 0; rr < Tl::kRows; ++rr) {
    const int64_t i = i_first + rr;
    const KeySpan in = inner_keys(i, p.k_len, K, p.q_offset, p.k_offset);
    const int64_t jb = in.begin > j0 ? in.begin : j0;
    const int64_t je = in.end < j0 + nk ? in.end : j0 + nk;
    if (jb >= je) continue;
    // band row of key j0 if it were inner (unclamped bucket r + K); inner keys follow it
    const int first = static_cast<int>(rel_distance(i, j0, p.q_offset, p.k_offset) + K - band.begin);
    chunk_accumulate_band<Tl>(acc[rr], ch, w + rr * Tl::kLdP, band_smem,
                              static_cast<int>(jb - j0), static_cast<int>(je - j0), first, lane);
  }
}

// The rel_q band of dk over one staged chunk (columns [d0, d0 + dn)), into dst [kOwn][kD] in
// shared memory: each owned key r (< nk) meets its inner queries of the query tile [i0, i0 + nq)
// at the staged rel_q rows (stage_key_side, band rows from 2) along the skew, one bucket fewer per
// query: dst[r][d] += sum_ii w[r][ii] rel_q[b(i0 + ii, j0 + r)][d]. Block-wide, each entry by one
// thread; in shared memory rather than the dk registers, which the D <= 256 kernels do not have
// to spare for the band's indices.
template <typename Tl, typename A>
RELPOS_DEVICE void key_side_band_dk(A* dst, const A* w, const A* eqs, const RelAttentionParams& p,
                                    int64_t i0, int64_t nq, int64_t j0, int64_t nk,
                                    const BucketSpan& band, int64_t d0, int dn) {
  const int64_t K = p.max_distance;
  for (int idx = threadIdx.x; idx < Tl::kOwn * Tl::kDK; idx += Tl::kThreads) {
    const int r = idx / Tl::kDK, dd = idx % Tl::kDK;
    if (r >= nk || dd >= dn) continue;
    // r(i0 + ii, j) = c - ii; inner queries have |r| < K
    const int64_t c = rel_distance(i0, j0 + r, p.q_offset, p.k_offset);
    const int64_t ib = c - K + 1 > 0 ? c - K + 1 : 0;
    const int64_t ie = c + K < nq ? c + K : nq;
    const int64_t first = 2 + c + K - band.begin;  // staged row of query i0 if it were inner
    A acc = 0;
    for (int64_t ii = ib; ii < ie; ++ii) acc += w[r * Tl::kLdP + ii] * eqs[(first - ii) * Tl::kLd + dd];
    dst[r * Tl::kD + d0 + dd] += acc;
  }
}

// ---- forward ------------------------------------------------------------------------------------
// Grid: batch * heads * ceil(q_len / kOwn) blocks of kThreads. Shared memory (dynamic, elements of
// the accumulation type): sQ [kOwn][kD] | sKV [32][kLd] a chunk of K, then of V | sE [kBand][kLd] a
// chunk of the rel_k band, then of the rel_v band | sP [kOwn][33] the tile's probabilities |
// sQe [kOwn][2] q_i . rel_k[0] and q_i . rel_k[2K] | sB [2 + kBand] the tile pair's rel_bias
// (stage_bias; with a bias or kRelQ) | sEq [2 + kBand][kLd] a chunk of the tile pair's rel_q rows
// (stage_key_side; kRelQ only). kRelQ: rel_q is given (a template flag, as kBias of the backward,
// so that the kernel without it keeps its registers).
template <typename T, int kDC, bool kRelQ>
__global__ void __launch_bounds__(AttnTile<acc_t<T>, kDC>::kThreads, 2)
    rel_attention_fwd_kernel(RelAttentionParams p) {
  using A = acc_t<T>;
  using Tl = AttnTile<A, kDC>;
  constexpr int R = Tl::kRows, C = Tl::kChunks * Tl::kCPC;
  RELPOS_DYNAMIC_SMEM(A, smem);
  A* sQ = smem;
  A* sKV = sQ + Tl::kOwn * Tl::kD;
  A* sE = sKV + Tl::kLanes * Tl::kLd;
  A* sP = sE + Tl::kBand * Tl::kLd;
  A* sQe = sP + Tl::kOwn * Tl::kLdP;
  A* sB = sQe + 2 * Tl::kOwn;
  A* sEq = sB + Tl::kBiasSmem;

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t q_tiles = (p.q_len + Tl::kOwn - 1) / Tl::kOwn;
  const int64_t bh = blockIdx.x / q_tiles, h = bh % p.heads, b = bh / p.heads;
  const int64_t i0 = (blockIdx.x % q_tiles) * Tl::kOwn;
  const int64_t nq = p.q_len - i0 < Tl::kOwn ? p.q_len - i0 : Tl::kOwn;
  const int64_t D = p.dim, K = p.max_distance, table_rows = num_buckets(K);
  const int64_t kvh = b * p.kv_heads + h / (p.heads / p.kv_heads);
  const T* k = static_cast<const T*>(p.k) + kvh * p.kv_stride;
  const T* v = static_cast<const T*>(p.v) + kvh * p.kv_stride;
  const T* ek = head_table<T>(p.rel_k, p.rel_k_per_head, h, table_rows * D);
  const T* ev = head_table<T>(p.rel_v, p.rel_v_per_head, h, table_rows * D);
  const T* eb = head_table<T>(p.rel_bias, p.rel_bias_per_head, h, table_rows);
  const T* eq = kRelQ ? head_table<T>(p.rel_q, p.rel_q_per_head, h, table_rows * D) : nullptr;
  const A scale = static_cast<A>(p.scale);  // logits in natural units, as the lse
  const int n_chunks = static_cast<int>((D + Tl::kDK - 1) / Tl::kDK);

  stage_owned<Tl>(sQ, static_cast<const T*>(p.q) + (bh * p.q_len + i0) * D, nq, D);
  __syncthreads();
  const A* my_q = sQ + warp * R * Tl::kD;

  // Row state: m (running max) is warp-uniform; l and the clamped masses w_lo / w_hi are per-lane
  // partials (of this lane's keys), rescaled with the row and summed over the warp at the end.
  A m[R], l[R], w_lo[R], w_hi[R], acc[R][C];
  RELPOS_UNROLL
  for (int rr = 0; rr < R; ++rr) {
    A x0 = 0, x1 = 0;
    if (ek != nullptr) {  // q_i . rel_k[0] and q_i . rel_k[2K]
      RELPOS_UNROLL
      for (int c = 0; c < C; ++c) {
        const int64_t d = c * 32 + lane;
        if (d < D) {
          x0 += my_q[rr * Tl::kD + d] * A(to_float(ek[d]));
          x1 += my_q[rr * Tl::kD + d] * A(to_float(ek[(table_rows - 1) * D + d]));
        }
      }
      x0 = warp_sum(x0);
      x1 = warp_sum(x1);
    }
    if (lane == 0) {  // read after the first key tile's __syncthreads
      sQe[(warp * R + rr) * 2 + 0] = x0;
      sQe[(warp * R + rr) * 2 + 1] = x1;
    }
    m[rr] = -INFINITY;
    l[rr] = w_lo[rr] = w_hi[rr] = 0;
    RELPOS_UNROLL
    for (int c = 0; c < C; ++c) acc[rr][c] = 0;
  }

  const int64_t n_ktiles = (attn_key_end(p, i0, nq) + Tl::kLanes - 1) / Tl::kLanes;
  for (int64_t t = attn_key_begin(p, i0) / Tl::kLanes; t < n_ktiles; ++t) {
    const int64_t j0 = t * Tl::kLanes, j = j0 + lane;
    const int nk = static_cast<int>(p.k_len - j0 < Tl::kLanes ? p.k_len - j0 : Tl::kLanes);
    if (has_tile_masks(p) && attn_tile_hidden<Tl>(p, b, h, i0, nq, j0, nk)) continue;
    const BucketSpan band = tile_inner_buckets(i0, nq, j0, nk, K, p.q_offset, p.k_offset);
    const int nb = static_cast<int>(band.end - band.begin);
    const bool k_band = ek != nullptr && nb > 0, v_band = ev != nullptr && nb > 0;
    int erow[R];
    RELPOS_UNROLL
    for (int rr = 0; rr < R; ++rr) erow[rr] = nb > 0 ? band_row(p, i0 + warp * R + rr, j, band) : 0;
    if (eb != nullptr) {
      // The previous tile's softmax read sB before the barrier of its P V loop, and the score
      // loop's barriers publish it; with D = 0 neither loop runs, so barriers of its own.
      if (n_chunks == 0) __syncthreads();
      stage_bias<Tl>(sB, eb, table_rows, band, nb);
      if (n_chunks == 0) __syncthreads();
    }

    // With rel_q, this lane's key meets one staged rel_q row per owned row (key_side_row).
    int qrow[R];
    A ke[R];
    if constexpr (kRelQ) {
      RELPOS_UNROLL
      for (int rr = 0; rr < R; ++rr) {
        const int64_t i = i0 + warp * R + rr;
        qrow[rr] = key_side_row(j, inner_keys(i, p.k_len, K, p.q_offset, p.k_offset), erow[rr]);
        ke[rr] = 0;
      }
    }

    // S = Q K^T (+ Q . rel_k along the skew, + K . rel_q), chunk by chunk of columns.
    A s[R], se[R];
    RELPOS_UNROLL
    for (int rr = 0; rr < R; ++rr) s[rr] = se[rr] = 0;
    for (int ch = 0; ch < n_chunks; ++ch) {
      const int64_t d0 = static_cast<int64_t>(ch) * Tl::kDK;
      const int dn = static_cast<int>(D - d0 < Tl::kDK ? D - d0 : Tl::kDK);
      __syncthreads();  // the previous readers of sKV / sE (/ sEq) are done
      stage_chunk<Tl>(sKV, k + j0 * D, Tl::kLanes, nk, D, d0);
      if (k_band) stage_chunk<Tl>(sE, ek + band.begin * D, nb, nb, D, d0);
      if constexpr (kRelQ) stage_key_side<Tl>(sEq, eq, table_rows, band, nb, D, d0);
      __syncthreads();
      score_dots<Tl>(k_band, my_q, d0, dn, sKV + lane * Tl::kLd, sE, erow, s, se);
      if constexpr (kRelQ) key_side_dots<Tl>(sKV + lane * Tl::kLd, 0, dn, sEq, qrow, ke);
    }

    // Online softmax; this lane's probability of each row goes to sP.
    RELPOS_UNROLL
    for (int rr = 0; rr < R; ++rr) {
      const int64_t i = i0 + warp * R + rr;
      const KeySpan in = inner_keys(i, p.k_len, K, p.q_offset, p.k_offset);
      A x = -INFINITY;
      if (attn_visible(p, b, h, i, j)) {
        const A* qe = sQe + (warp * R + rr) * 2;
        const A rel = ek == nullptr ? A(0) : (j < in.begin ? qe[0] : (j >= in.end ? qe[1] : se[rr]));
        // (q . k + k . rel_q) + q . rel_k, the order of the backward's prob_grad
        A sk = s[rr];
        if constexpr (kRelQ) sk += ke[rr];
        x = mul_rn(sk + rel, scale);
        if (eb != nullptr) x += staged_bias(sB, j, in, erow[rr]);  // the bias, after the scale
      }
      const A mt = warp_max(x);
      const A mn = mt > m[rr] || mt != mt ? mt : m[rr];  // a NaN logit makes the row NaN
      A pr = 0, alpha = 1;
      if (mn != A(-INFINITY)) {  // exp2(-inf) = 0 covers masked keys and the first visible tile
        pr = exp2_acc((x - mn) * A(kLog2e));
        alpha = exp2_acc((m[rr] - mn) * A(kLog2e));
      }
      m[rr] = mn;
      l[rr] = l[rr] * alpha + pr;  // the normaliser is the one without dropout
      if (p.dropout.on) pr *= attn_dropout<A>(p, attn_dropout_key(p, bh, i), j);
      w_lo[rr] = w_lo[rr] * alpha + (j < in.begin ? pr : A(0));
      w_hi[rr] = w_hi[rr] * alpha + (j >= in.end ? pr : A(0));
      RELPOS_UNROLL
      for (int c = 0; c < C; ++c) acc[rr][c] *= alpha;
      sP[(warp * R + rr) * Tl::kLdP + lane] = pr;
    }

    // acc += P V (+ P . rel_v along the skew), chunk by chunk; unrolled so acc stays in registers.
    const A* my_p = sP + warp * R * Tl::kLdP;
    RELPOS_UNROLL
    for (int ch = 0; ch < Tl::kChunks; ++ch) {
      if (ch >= n_chunks) break;
      const int64_t d0 = static_cast<int64_t>(ch) * Tl::kDK;
      __syncthreads();  // sP is written; the score dots are done with sKV / sE
      stage_chunk<Tl>(sKV, v + j0 * D, Tl::kLanes, nk, D, d0);
      if (v_band) stage_chunk<Tl>(sE, ev + band.begin * D, nb, nb, D, d0);
      __syncthreads();
      chunk_accumulate<Tl>(acc, ch, my_p, sKV, nk, lane);
      if (v_band) {
        accumulate_inner_band<Tl>(acc, ch, my_p, sE, p, i0 + warp * R, j0, nk, band, lane);
      }
    }
  }

  // out = (acc + w_lo rel_v[0] + w_hi rel_v[2K]) / l;  rows without a visible key: 0 and lse = +inf.
  T* out = static_cast<T*>(p.out) + (bh * p.q_len + i0) * D;
  A* lse = static_cast<A*>(p.lse) + bh * p.q_len + i0;
  RELPOS_UNROLL
  for (int rr = 0; rr < R; ++rr) {
    const int r = warp * R + rr;
    if (r >= nq) break;  // warp-uniform
    const A lsum = warp_sum(l[rr]);
    const A wl = warp_sum(w_lo[rr]), wh = warp_sum(w_hi[rr]);
    const bool empty = m[rr] == A(-INFINITY) || lsum == A(0);
    const A inv = empty ? A(0) : A(1) / lsum;
    RELPOS_UNROLL
    for (int c = 0; c < C; ++c) {
      const int64_t d = c * 32 + lane;
      if (d >= D) continue;
      A o = acc[rr][c];
      if (ev != nullptr) {
        o += wl * A(to_float(ev[d])) + wh * A(to_float(ev[(table_rows - 1) * D + d]));
      }
      out[r * D + d] = from_float<T>(empty ? A(0) : o * inv);
    }
    if (lane == 0) lse[r] = empty ? A(INFINITY) : m[rr] + log_acc(lsum);
  }
}

// ---- backward: per-row terms ----------------------------------------------------------------------
// One warp per query row, kRowsWarps rows per block: ws[row][kRow*] = D_i = dO_i . O_i,
// q_i . rel_k[0], q_i . rel_k[2K], dO_i . rel_v[0], dO_i . rel_v[2K] (zero for an absent table).
constexpr int kRowsWarps = 8;

template <typename T>
__global__ void rel_attention_bwd_rows_kernel(RelAttentionBwdParams bp, acc_t<T>* ws) {
  using A = acc_t<T>;
  const RelAttentionParams& p = bp.fwd;
  const int lane = threadIdx.x % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsWarps + threadIdx.x / 32;
  if (row >= p.batch * p.heads * p.q_len) return;  // the whole warp leaves together
  const int64_t h = (row / p.q_len) % p.heads, D = p.dim, table_rows = num_buckets(p.max_distance);
  const T* q = static_cast<const T*>(p.q) + row * D;
  const T* o = static_cast<const T*>(p.out) + row * D;
  const T* g = static_cast<const T*>(bp.grad_out) + row * D;
  const T* ek = head_table<T>(p.rel_k, p.rel_k_per_head, h, table_rows * D);
  const T* ev = head_table<T>(p.rel_v, p.rel_v_per_head, h, table_rows * D);
  A t[kRowTerms] = {0, 0, 0, 0, 0};
  for (int64_t d = lane; d < D; d += 32) {
    const A qd = to_float(q[d]), gd = to_float(g[d]);
    t[kRowDi] += gd * A(to_float(o[d]));
    if (ek != nullptr) {
      t[kRowQeLo] += qd * A(to_float(ek[d]));
      t[kRowQeHi] += qd * A(to_float(ek[(table_rows - 1) * D + d]));
    }
    if (ev != nullptr) {
      t[kRowDeLo] += gd * A(to_float(ev[d]));
      t[kRowDeHi] += gd * A(to_float(ev[(table_rows - 1) * D + d]));
    }
  }
  RELPOS_UNROLL
  for (int k = 0; k < kRowTerms; ++k) t[k] = warp_sum(t[k]);
  if (lane == 0) {
    RELPOS_UNROLL
    for (int k = 0; k < kRowTerms; ++k) ws[row * kRowTerms + k] = t[k];
  }
}

// p_ij and ds_ij = p_ij (dp_ij - D_i) of one (query row, key) pair from the accumulated dots;
// under dropout (factor f: keep_scale or 0) p_ij f and p_ij (f dp_ij - D_i). bias: rel_bias of
// the pair (staged_bias), 0 without a bias.
template <typename A>
struct ProbGrad {
  A p, ds;
};

template <typename A>
RELPOS_DEVICE ProbGrad<A> prob_grad(bool visible, bool has_k, bool has_v, int64_t j,
                                    int64_t in_begin, int64_t in_end, A s, A se, A dp, A dpe,
                                    const A* row, A lse, A bias, A scale, bool drop, A f) {
  ProbGrad<A> r{0, 0};
  if (!visible) return r;
  const bool lo = j < in_begin, hi = j >= in_end;
  const A qe = has_k ? (lo ? row[kRowQeLo] : (hi ? row[kRowQeHi] : se)) : A(0);
  const A de = has_v ? (lo ? row[kRowDeLo] : (hi ? row[kRowDeHi] : dpe)) : A(0);
  // the logit as the forward formed it (+ 0 without a bias: the same value), then its distance
  // to the lse in base 2; lse = +inf (no visible key) gives 0
  const A x = mul_rn(s + qe, scale) + bias;
  r.p = exp2_acc((x - lse) * A(kLog2e));
  if (drop) {
    r.ds = r.p * (f * (dp + de) - row[kRowDi]);
    r.p *= f;
  } else {
    r.ds = r.p * (dp + de - row[kRowDi]);
  }
  return r;
}

// ---- backward: dq and the table gradients ------------------------------------------------------
// One query tile (tile) of one (b, h) (bh); the dq kernel below runs one per block, or, with
// bp.serial_q_tiles, all the tiles of its (b, h) in order. Shared memory: sQ, sdO [kOwn][kD] | sK,
// sV [32][kLd] chunks | sEk, sEv [kBand][kLd] band chunks | sP, sDS [kOwn][33] | sLo [kOwn][4] (per
// row: clamped ds mass lo/hi, clamped p mass lo/hi) | sRow [kOwn][1 + kRowTerms] (lse, ws
// row) | sB [2 + kBand] the tile pair's rel_bias (stage_bias; kBias only) | sEq [2 + kBand][kLd]
// a chunk of the tile pair's rel_q rows (stage_key_side; kRelQ only). dq accumulates in
// registers; the table (and bias) gradients of the band go straight to drel_*_partial with
// atomicAdd (rows shared by query tiles), those of the clamped buckets at the end of the tile.
// kBias: rel_bias is given (a template flag so that the kernels without one keep the registers they
// had without bias code). kRelQ: rel_q is given (and kBias is set with it, the bias then checked
// at run time: one instantiation fewer); rel_q only enters the logits here (k_j . rel_q[b] does
// not depend on q): its gradients are the dk/dv kernel's, which owns the keys.
template <typename T, int kDC, bool kBias, bool kRelQ>
__device__ void bwd_dq_tile(const RelAttentionBwdParams& bp, const acc_t<T>* ws, int64_t bh,
                            int64_t tile) {
  using A = acc_t<T>;
  using Tl = AttnTile<A, kDC>;
  constexpr int R = Tl::kRows, C = Tl::kChunks * Tl::kCPC;
  const RelAttentionParams& p = bp.fwd;
  RELPOS_DYNAMIC_SMEM(A, smem);
  A* sQ = smem;
  A* sG = sQ + Tl::kOwn * Tl::kD;
  A* sK = sG + Tl::kOwn * Tl::kD;
  A* sV = sK + Tl::kLanes * Tl::kLd;
  A* sEk = sV + Tl::kLanes * Tl::kLd;
  A* sEv = sEk + Tl::kBand * Tl::kLd;
  A* sP = sEv + Tl::kBand * Tl::kLd;
  A* sDS = sP + Tl::kOwn * Tl::kLdP;
  A* sLo = sDS + Tl::kOwn * Tl::kLdP;
  A* sRow = sLo + 4 * Tl::kOwn;
  A* sB = sRow + (1 + kRowTerms) * Tl::kOwn;
  A* sEq = sB + Tl::kBiasSmem;

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t h = bh % p.heads, b = bh / p.heads;
  const int64_t i0 = tile * Tl::kOwn;
  const int64_t nq = p.q_len - i0 < Tl::kOwn ? p.q_len - i0 : Tl::kOwn;
  const int64_t D = p.dim, K = p.max_distance, table_rows = num_buckets(K);
  const int64_t kvh = b * p.kv_heads + h / (p.heads / p.kv_heads);
  const T* k = static_cast<const T*>(p.k) + kvh * p.kv_stride;
  const T* v = static_cast<const T*>(p.v) + kvh * p.kv_stride;
  const T* ek = head_table<T>(p.rel_k, p.rel_k_per_head, h, table_rows * D);
  const T* ev = head_table<T>(p.rel_v, p.rel_v_per_head, h, table_rows * D);
  A* pk = bp.drel_k_partial == nullptr ? nullptr
          : static_cast<A*>(bp.drel_k_partial) + bh * table_rows * D;
  A* pv = bp.drel_v_partial == nullptr ? nullptr
          : static_cast<A*>(bp.drel_v_partial) + bh * table_rows * D;
  const T* eb = kBias ? head_table<T>(p.rel_bias, p.rel_bias_per_head, h, table_rows) : nullptr;
  A* pb = !kBias || bp.drel_bias_partial == nullptr ? nullptr
          : static_cast<A*>(bp.drel_bias_partial) + bh * table_rows;
  const T* eq = kRelQ ? head_table<T>(p.rel_q, p.rel_q_per_head, h, table_rows * D) : nullptr;
  const A scale = static_cast<A>(p.scale);
  const int n_chunks = static_cast<int>((D + Tl::kDK - 1) / Tl::kDK);

  stage_owned<Tl>(sQ, static_cast<const T*>(p.q) + (bh * p.q_len + i0) * D, nq, D);
  stage_owned<Tl>(sG, static_cast<const T*>(bp.grad_out) + (bh * p.q_len + i0) * D, nq, D);
  for (int idx = threadIdx.x; idx < Tl::kOwn * (1 + kRowTerms); idx += Tl::kThreads) {
    const int r = idx / (1 + kRowTerms), t = idx % (1 + kRowTerms);
    const int64_t row = bh * p.q_len + i0 + r;
    sRow[idx] = r >= nq ? (t == 0 ? A(INFINITY) : A(0))
                        : (t == 0 ? static_cast<const A*>(p.lse)[row] : ws[row * kRowTerms + t - 1]);
  }
  __syncthreads();
  const A* my_q = sQ + warp * R * Tl::kD;
  const A* my_g = sG + warp * R * Tl::kD;

  A acc[R][C], m_lo[R][4];  // m_lo: per-lane clamped ds / p masses
  RELPOS_UNROLL
  for (int rr = 0; rr < R; ++rr) {
    RELPOS_UNROLL
    for (int c = 0; c < C; ++c) acc[rr][c] = 0;
    RELPOS_UNROLL
    for (int t = 0; t < 4; ++t) m_lo[rr][t] = 0;
  }

  const int64_t n_ktiles = (attn_key_end(p, i0, nq) + Tl::kLanes - 1) / Tl::kLanes;
  for (int64_t t = attn_key_begin(p, i0) / Tl::kLanes; t < n_ktiles; ++t) {
    const int64_t j0 = t * Tl::kLanes, j = j0 + lane;
    const int nk = static_cast<int>(p.k_len - j0 < Tl::kLanes ? p.k_len - j0 : Tl::kLanes);
    if (has_tile_masks(p) && attn_tile_hidden<Tl>(p, b, h, i0, nq, j0, nk)) continue;
    const BucketSpan band = tile_inner_buckets(i0, nq, j0, nk, K, p.q_offset, p.k_offset);
    const int nb = static_cast<int>(band.end - band.begin);
    const bool k_band = ek != nullptr && nb > 0, v_band = ev != nullptr && nb > 0;
    int erow[R];
    RELPOS_UNROLL
    for (int rr = 0; rr < R; ++rr) erow[rr] = nb > 0 ? band_row(p, i0 + warp * R + rr, j, band) : 0;
    // the previous tile read sB before its "sP / sDS complete" barrier; the chunk loop below (at
    // least one chunk: the backward does not run for D = 0) publishes it
    if (eb != nullptr) stage_bias<Tl>(sB, eb, table_rows, band, nb);
    // with rel_q, as the forward: this lane's key meets one staged rel_q row per owned row
    int qrow[R];
    A ke[R];
    if constexpr (kRelQ) {
      RELPOS_UNROLL
      for (int rr = 0; rr < R; ++rr) {
        const int64_t i = i0 + warp * R + rr;
        qrow[rr] = key_side_row(j, inner_keys(i, p.k_len, K, p.q_offset, p.k_offset), erow[rr]);
        ke[rr] = 0;
      }
    }

    A s[R], se[R], dp[R], dpe[R];
    RELPOS_UNROLL
    for (int rr = 0; rr < R; ++rr) s[rr] = se[rr] = dp[rr] = dpe[rr] = 0;
    for (int ch = 0; ch < n_chunks; ++ch) {
      const int64_t d0 = static_cast<int64_t>(ch) * Tl::kDK;
      const int dn = static_cast<int>(D - d0 < Tl::kDK ? D - d0 : Tl::kDK);
      __syncthreads();
      stage_chunk<Tl>(sK, k + j0 * D, Tl::kLanes, nk, D, d0);
      stage_chunk<Tl>(sV, v + j0 * D, Tl::kLanes, nk, D, d0);
      if (k_band) stage_chunk<Tl>(sEk, ek + band.begin * D, nb, nb, D, d0);
      if (v_band) stage_chunk<Tl>(sEv, ev + band.begin * D, nb, nb, D, d0);
      if constexpr (kRelQ) stage_key_side<Tl>(sEq, eq, table_rows, band, nb, D, d0);
      __syncthreads();
      score_dots<Tl>(k_band, my_q, d0, dn, sK + lane * Tl::kLd, sEk, erow, s, se);
      score_dots<Tl>(v_band, my_g, d0, dn, sV + lane * Tl::kLd, sEv, erow, dp, dpe);
      if constexpr (kRelQ) key_side_dots<Tl>(sK + lane * Tl::kLd, 0, dn, sEq, qrow, ke);
    }
    RELPOS_UNROLL
    for (int rr = 0; rr < R; ++rr) {
      const int64_t i = i0 + warp * R + rr;
      const KeySpan in = inner_keys(i, p.k_len, K, p.q_offset, p.k_offset);
      const A* row = sRow + (warp * R + rr) * (1 + kRowTerms);
      const A bias = eb == nullptr ? A(0) : staged_bias(sB, j, in, erow[rr]);
      A sk = s[rr];  // (q . k + k . rel_q), as the forward
      if constexpr (kRelQ) sk += ke[rr];
      const ProbGrad<A> g = prob_grad(attn_visible(p, b, h, i, j), ek != nullptr, ev != nullptr, j,
                                      in.begin, in.end, sk, se[rr], dp[rr], dpe[rr], row + 1,
                                      row[0], bias, scale, p.dropout.on,
                                      attn_dropout<A>(p, attn_dropout_key(p, bh, i), j));
      const bool lo = j < in.begin, hi = j >= in.end;
      m_lo[rr][0] += lo ? g.ds : A(0);
      m_lo[rr][1] += hi ? g.ds : A(0);
      m_lo[rr][2] += lo ? g.p : A(0);
      m_lo[rr][3] += hi ? g.p : A(0);
      sP[(warp * R + rr) * Tl::kLdP + lane] = g.p;
      sDS[(warp * R + rr) * Tl::kLdP + lane] = g.ds;
    }
    __syncthreads();  // sP / sDS complete; sK / sEk are read again below, not written

    // Table gradients of the band: bucket c of the band meets row r at the key of distance c - K.
    if (nb > 0 && (pk != nullptr || pv != nullptr)) {
      for (int64_t idx = threadIdx.x; idx < nb * D; idx += Tl::kThreads) {
        const int64_t c = idx / D, d = idx % D, bucket = band.begin + c;
        A gk = 0, gv = 0;
        for (int r = 0; r < nq; ++r) {
          const int64_t jj = p.q_offset + i0 + r - p.k_offset + (bucket - K) - j0;
          if (jj < 0 || jj >= nk) continue;
          gk += sDS[r * Tl::kLdP + jj] * sQ[r * Tl::kD + d];
          gv += sP[r * Tl::kLdP + jj] * sG[r * Tl::kD + d];
        }
        if (pk != nullptr) atomicAdd(pk + bucket * D + d, gk * scale);
        if (pv != nullptr) atomicAdd(pv + bucket * D + d, gv);
      }
    }
    if (nb > 0 && pb != nullptr) {  // drel_bias of the band: the unscaled dS
      for (int c = threadIdx.x; c < nb; c += Tl::kThreads) {
        const int64_t bucket = band.begin + c;
        A gb = 0;
        for (int r = 0; r < nq; ++r) {
          const int64_t jj = p.q_offset + i0 + r - p.k_offset + (bucket - K) - j0;
          if (jj >= 0 && jj < nk) gb += sDS[r * Tl::kLdP + jj];
        }
        atomicAdd(pb + bucket, gb);
      }
    }

    // dq += dS (K + rel_k along the skew), chunk by chunk.
    const A* my_ds = sDS + warp * R * Tl::kLdP;
    RELPOS_UNROLL
    for (int ch = 0; ch < Tl::kChunks; ++ch) {
      if (ch >= n_chunks) break;
      if (n_chunks > 1) {  // one chunk: still staged from the score pass
        __syncthreads();
        stage_chunk<Tl>(sK, k + j0 * D, Tl::kLanes, nk, D, static_cast<int64_t>(ch) * Tl::kDK);
        if (k_band) {
          stage_chunk<Tl>(sEk, ek + band.begin * D, nb, nb, D, static_cast<int64_t>(ch) * Tl::kDK);
        }
        __syncthreads();
      }
      chunk_accumulate<Tl>(acc, ch, my_ds, sK, nk, lane);
      if (k_band) {
        accumulate_inner_band<Tl>(acc, ch, my_ds, sEk, p, i0 + warp * R, j0, nk, band, lane);
      }
    }
  }

  // dq = scale (acc + ds_lo rel_k[0] + ds_hi rel_k[2K]); the clamped masses feed the table rows.
  T* dq = static_cast<T*>(bp.dq) + (bh * p.q_len + i0) * D;
  RELPOS_UNROLL
  for (int rr = 0; rr < R; ++rr) {
    const int r = warp * R + rr;
    A tot[4];
    RELPOS_UNROLL
    for (int t = 0; t < 4; ++t) tot[t] = warp_sum(m_lo[rr][t]);
    if (lane == 0) {
      RELPOS_UNROLL
      for (int t = 0; t < 4; ++t) sLo[r * 4 + t] = r < nq ? tot[t] : A(0);
    }
    if (r >= nq) continue;
    RELPOS_UNROLL
    for (int c = 0; c < C; ++c) {
      const int64_t d = c * 32 + lane;
      if (d >= D) continue;
      A x = acc[rr][c];
      if (ek != nullptr) {
        x += tot[0] * A(to_float(ek[d])) + tot[1] * A(to_float(ek[(table_rows - 1) * D + d]));
      }
      dq[r * D + d] = from_float<T>(x * scale);
    }
  }
  if (pk == nullptr && pv == nullptr && pb == nullptr) return;
  __syncthreads();
  if (pb != nullptr && threadIdx.x == Tl::kThreads - 1) {  // idle in the loop below for D < 128
    A b_lo = 0, b_hi = 0;
    for (int r = 0; r < nq; ++r) {
      b_lo += sLo[r * 4 + 0];
      b_hi += sLo[r * 4 + 1];
    }
    atomicAdd(pb, b_lo);
    atomicAdd(pb + table_rows - 1, b_hi);
  }
  if (pk == nullptr && pv == nullptr) return;
  for (int64_t d = threadIdx.x; d < D; d += Tl::kThreads) {
    A k_lo = 0, k_hi = 0, v_lo = 0, v_hi = 0;
    for (int r = 0; r < nq; ++r) {
      k_lo += sLo[r * 4 + 0] * sQ[r * Tl::kD + d];
      k_hi += sLo[r * 4 + 1] * sQ[r * Tl::kD + d];
      v_lo += sLo[r * 4 + 2] * sG[r * Tl::kD + d];
      v_hi += sLo[r * 4 + 3] * sG[r * Tl::kD + d];
    }
    if (pk != nullptr) {
      atomicAdd(pk + d, k_lo * scale);
      atomicAdd(pk + (table_rows - 1) * D + d, k_hi * scale);
    }
    if (pv != nullptr) {
      atomicAdd(pv + d, v_lo);
      atomicAdd(pv + (table_rows - 1) * D + d, v_hi);
    }
  }
}

// Grid: batch * heads * ceil(q_len / kOwn) blocks, one query tile each; or, kSerial (set from
// bp.serial_q_tiles: torch.use_deterministic_algorithms with tables or a bias), batch * heads
// blocks that each take their (b, h)'s query tiles in order. Within a block every table-gradient
// entry is added to by one thread at a time, between barriers, so one block per (b, h) adds in a
// fixed order and the table gradients come out bitwise the same on every run, with far fewer blocks
// in flight. Two instantiations rather than one loop: a loop over tiles costs the one-tile form
// 25-37 registers (ptxas, sm_80 and sm_90), for D <= 64 161-168 -> 192-194, which at 128 threads a
// block leaves registers for 2 blocks per SM instead of 3. Likewise kBias (set when rel_bias is
// given): the bias code costs the one-tile form without a bias 13-18 registers (sm_80 and sm_90; at
// D <= 32 168 -> 184-186, again 3 blocks per SM -> 2), so only the bias instantiations hold it.
// kRelQ (rel_q given; with kBias) likewise.
template <typename T, int kDC, bool kSerial, bool kBias, bool kRelQ>
__global__ void __launch_bounds__(AttnTile<acc_t<T>, kDC>::kThreads, 2)
    rel_attention_bwd_dq_kernel(RelAttentionBwdParams bp, const acc_t<T>* ws) {
  using Tl = AttnTile<acc_t<T>, kDC>;
  const int64_t q_tiles = (bp.fwd.q_len + Tl::kOwn - 1) / Tl::kOwn;
  if constexpr (!kSerial) {
    bwd_dq_tile<T, kDC, kBias, kRelQ>(bp, ws, blockIdx.x / q_tiles, blockIdx.x % q_tiles);
  } else {
    for (int64_t t = 0; t < q_tiles; ++t) {
      bwd_dq_tile<T, kDC, kBias, kRelQ>(bp, ws, blockIdx.x, t);
      __syncthreads();  // the next tile restages the shared memory this one read last
    }
  }
}

// ---- backward: dk and dv ------------------------------------------------------------------------
// One key tile (tile) of one (b, kv head) (bkv): kOwn keys (the only writer of their dk / dv); it
// loops over the query heads of the group and their query tiles of 32 (one query row per lane).
// Shared memory: sK, sV [kOwn][kD] | sQ, sdO [32][kLd] chunks | sEk, sEv [kBand][kLd] band chunks |
// sP, sDS [kOwn][33] (key row x query lane) | sB [2 + kBand] the tile pair's rel_bias
// (stage_bias; kBias only) | sEq [2 + kBand][kLd] a chunk of the tile pair's rel_q rows
// (stage_key_side), sKm [kOwn][2] the clamped dS mass of each key and sDkq [kOwn][kD] the rel_q
// part of dk (kRelQ only). kBias:
// rel_bias is given (a template flag as for the dq kernel: the bias code costs a kernel without
// one 0-9 registers, at D <= 64 168 -> 173-177). kRelQ: rel_q is given (with kBias): dk_j +=
// scale sum_i ds_ij rel_q[b(i, j)] (in sDkq, added at the end), the band along the skew per query
// tile and the clamped buckets from each key's dS mass per head; drel_q[b] = scale sum ds_ij k_j, the band per query
// tile and the clamped rows per head, with atomicAdd into drel_q_partial (rows shared by key
// tiles).
template <typename T, int kDC, bool kBias, bool kRelQ>
__device__ void bwd_dkdv_tile(const RelAttentionBwdParams& bp, const acc_t<T>* ws, int64_t bkv,
                              int64_t tile) {
  using A = acc_t<T>;
  using Tl = AttnTile<A, kDC>;
  constexpr int R = Tl::kRows, C = Tl::kChunks * Tl::kCPC;
  const RelAttentionParams& p = bp.fwd;
  RELPOS_DYNAMIC_SMEM(A, smem);
  A* sK = smem;
  A* sV = sK + Tl::kOwn * Tl::kD;
  A* sQ = sV + Tl::kOwn * Tl::kD;
  A* sG = sQ + Tl::kLanes * Tl::kLd;
  A* sEk = sG + Tl::kLanes * Tl::kLd;
  A* sEv = sEk + Tl::kBand * Tl::kLd;
  A* sP = sEv + Tl::kBand * Tl::kLd;
  A* sDS = sP + Tl::kOwn * Tl::kLdP;
  A* sB = sDS + Tl::kOwn * Tl::kLdP;
  A* sEq = sB + Tl::kBiasSmem;
  A* sKm = sEq + (2 + Tl::kBand) * Tl::kLd;
  A* sDkq = sKm + 2 * Tl::kOwn;

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t hk = bkv % p.kv_heads, b = bkv / p.kv_heads;
  const int64_t j0 = tile * Tl::kOwn;
  const int64_t nk = p.k_len - j0 < Tl::kOwn ? p.k_len - j0 : Tl::kOwn;
  const int64_t D = p.dim, K = p.max_distance, table_rows = num_buckets(K);
  const int64_t group = p.heads / p.kv_heads;
  const A scale = static_cast<A>(p.scale);
  const int n_chunks = static_cast<int>((D + Tl::kDK - 1) / Tl::kDK);

  stage_owned<Tl>(sK, static_cast<const T*>(p.k) + bkv * p.kv_stride + j0 * D, nk, D);
  stage_owned<Tl>(sV, static_cast<const T*>(p.v) + bkv * p.kv_stride + j0 * D, nk, D);
  if constexpr (kRelQ) {
    for (int idx = threadIdx.x; idx < Tl::kOwn * Tl::kD; idx += Tl::kThreads) sDkq[idx] = 0;
  }
  __syncthreads();
  const A* my_k = sK + warp * R * Tl::kD;
  const A* my_v = sV + warp * R * Tl::kD;

  A dk[R][C], dv[R][C];
  RELPOS_UNROLL
  for (int rr = 0; rr < R; ++rr) {
    RELPOS_UNROLL
    for (int c = 0; c < C; ++c) dk[rr][c] = dv[rr][c] = 0;
  }

  // Query rows that can see a key of this tile
  const int64_t i_first = attn_query_begin(p, j0), i_end = attn_query_end(p, j0, nk);
  for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
    const int64_t bh = b * p.heads + h;
    const T* q = static_cast<const T*>(p.q) + bh * p.q_len * D;
    const T* g = static_cast<const T*>(bp.grad_out) + bh * p.q_len * D;
    const T* ek = head_table<T>(p.rel_k, p.rel_k_per_head, h, table_rows * D);
    const T* ev = head_table<T>(p.rel_v, p.rel_v_per_head, h, table_rows * D);
    const T* eb = kBias ? head_table<T>(p.rel_bias, p.rel_bias_per_head, h, table_rows) : nullptr;
    const T* eq = kRelQ ? head_table<T>(p.rel_q, p.rel_q_per_head, h, table_rows * D) : nullptr;
    A* pq = !kRelQ || bp.drel_q_partial == nullptr ? nullptr
            : static_cast<A*>(bp.drel_q_partial) + bh * table_rows * D;
    // kRelQ: sKm[r][0 / 1], key r's dS mass in bucket 0 / 2K over this head's query tiles, each
    // entry summed by one thread (after the previous head's readers: its closing barrier). In
    // shared memory rather than per-lane registers: the D <= 256 kernels have none to spare.
    if constexpr (kRelQ) {
      if (threadIdx.x < 2 * Tl::kOwn) sKm[threadIdx.x] = 0;
    }
    for (int64_t i0 = (i_first / Tl::kLanes) * Tl::kLanes; i0 < i_end; i0 += Tl::kLanes) {
      const int64_t i = i0 + lane;
      const int nq = static_cast<int>(p.q_len - i0 < Tl::kLanes ? p.q_len - i0 : Tl::kLanes);
      if (has_tile_masks(p) && attn_tile_hidden<Tl>(p, b, h, i0, nq, j0, nk)) continue;
      const bool valid = i < p.q_len;
      const A lse = valid ? static_cast<const A*>(p.lse)[bh * p.q_len + i] : A(INFINITY);
      A row[kRowTerms];
      RELPOS_UNROLL
      for (int t = 0; t < kRowTerms; ++t) row[t] = valid ? ws[(bh * p.q_len + i) * kRowTerms + t] : A(0);
      const KeySpan in = inner_keys(i, p.k_len, K, p.q_offset, p.k_offset);
      const uint32_t drop_key = attn_dropout_key(p, bh, i);  // this lane's query row
      const BucketSpan band = tile_inner_buckets(i0, nq, j0, nk, K, p.q_offset, p.k_offset);
      const int nb = static_cast<int>(band.end - band.begin);
      const bool k_band = ek != nullptr && nb > 0, v_band = ev != nullptr && nb > 0;
      int erow[R];
      RELPOS_UNROLL
      for (int rr = 0; rr < R; ++rr) erow[rr] = nb > 0 ? band_row(p, i, j0 + warp * R + rr, band) : 0;
      // the previous query tile read sB before the first barrier of its dk / dv loop; the chunk
      // loop below (at least one chunk: the backward does not run for D = 0) publishes it
      if (eb != nullptr) stage_bias<Tl>(sB, eb, table_rows, band, nb);
      // with rel_q: each owned key meets this lane's query at one staged rel_q row
      int qrow[R];
      A ke[R];
      if constexpr (kRelQ) {
        RELPOS_UNROLL
        for (int rr = 0; rr < R; ++rr) {
          qrow[rr] = key_side_row(j0 + warp * R + rr, in, erow[rr]);
          ke[rr] = 0;
        }
      }

      A s[R], se[R], dp[R], dpe[R];
      RELPOS_UNROLL
      for (int rr = 0; rr < R; ++rr) s[rr] = se[rr] = dp[rr] = dpe[rr] = 0;
      for (int ch = 0; ch < n_chunks; ++ch) {
        const int64_t d0 = static_cast<int64_t>(ch) * Tl::kDK;
        const int dn = static_cast<int>(D - d0 < Tl::kDK ? D - d0 : Tl::kDK);
        __syncthreads();
        stage_chunk<Tl>(sQ, q + i0 * D, Tl::kLanes, nq, D, d0);
        stage_chunk<Tl>(sG, g + i0 * D, Tl::kLanes, nq, D, d0);
        if (k_band) stage_chunk<Tl>(sEk, ek + band.begin * D, nb, nb, D, d0);
        if (v_band) stage_chunk<Tl>(sEv, ev + band.begin * D, nb, nb, D, d0);
        if constexpr (kRelQ) stage_key_side<Tl>(sEq, eq, table_rows, band, nb, D, d0);
        __syncthreads();
        score_dots_t<Tl>(k_band, my_k, d0, dn, sQ + lane * Tl::kLd, sEk, erow, s, se);
        score_dots_t<Tl>(v_band, my_v, d0, dn, sG + lane * Tl::kLd, sEv, erow, dp, dpe);
        if constexpr (kRelQ) key_side_dots<Tl>(my_k + d0, Tl::kD, dn, sEq, qrow, ke);
      }
      RELPOS_UNROLL
      for (int rr = 0; rr < R; ++rr) {
        const int64_t j = j0 + warp * R + rr;
        const A bias = eb == nullptr ? A(0) : staged_bias(sB, j, in, erow[rr]);
        A sk = s[rr];  // (q . k + k . rel_q), as the forward
        if constexpr (kRelQ) sk += ke[rr];
        const ProbGrad<A> pg = prob_grad(attn_visible(p, b, h, i, j), ek != nullptr, ev != nullptr, j,
                                         in.begin, in.end, sk, se[rr], dp[rr], dpe[rr], row,
                                         lse, bias, scale, p.dropout.on,
                                         attn_dropout<A>(p, drop_key, j));

        sP[(warp * R + rr) * Tl::kLdP + lane] = pg.p;
        sDS[(warp * R + rr) * Tl::kLdP + lane] = pg.ds;
      }

      // dk += dS^T Q, dv += P^T dO, chunk by chunk.
      const A* my_p = sP + warp * R * Tl::kLdP;
      const A* my_ds = sDS + warp * R * Tl::kLdP;
      RELPOS_UNROLL
      for (int ch = 0; ch < Tl::kChunks; ++ch) {
        if (ch >= n_chunks) break;
        __syncthreads();  // sP / sDS complete (and, below, the previous chunk's readers done)
        if (n_chunks > 1) {  // one chunk: still staged from the score pass
          stage_chunk<Tl>(sQ, q + i0 * D, Tl::kLanes, nq, D, static_cast<int64_t>(ch) * Tl::kDK);
          stage_chunk<Tl>(sG, g + i0 * D, Tl::kLanes, nq, D, static_cast<int64_t>(ch) * Tl::kDK);
          if constexpr (kRelQ) {
            if (nb > 0) {
              stage_key_side<Tl>(sEq, eq, table_rows, band, nb, D, static_cast<int64_t>(ch) * Tl::kDK);
            }
          }
          __syncthreads();
        }
        chunk_accumulate<Tl>(dk, ch, my_ds, sQ, nq, lane);
        chunk_accumulate<Tl>(dv, ch, my_p, sG, nq, lane);
        if constexpr (kRelQ) {
          if (nb > 0) {
            key_side_band_dk<Tl>(sDkq, sDS, sEq, p, i0, nq, j0, nk, band,
                                 static_cast<int64_t>(ch) * Tl::kDK,
                                 static_cast<int>(D - ch * Tl::kDK < Tl::kDK ? D - ch * Tl::kDK
                                                                             : Tl::kDK));
          }
        }
      }
      if constexpr (kRelQ) {
        // drel_q of the band: bucket c meets owned key r at the query of distance c - K. sDS is
        // complete (the first barrier of the loop above) and rewritten only after the next
        // tile's score barriers.
        if (nb > 0 && pq != nullptr) {
          for (int64_t idx = threadIdx.x; idx < nb * D; idx += Tl::kThreads) {
            const int64_t c = idx / D, d = idx % D, bucket = band.begin + c;
            A gq = 0;
            for (int r = 0; r < nk; ++r) {
              const int64_t ii = p.k_offset + j0 + r - p.q_offset - (bucket - K) - i0;
              if (ii < 0 || ii >= nq) continue;
              gq += sDS[r * Tl::kLdP + ii] * sK[r * Tl::kD + d];
            }
            atomicAdd(pq + bucket * D + d, gq * scale);
          }
        }
        // the clamped dS mass of each key (thread 2 r + side, the one that zeroed the entry)
        if (threadIdx.x < 2 * Tl::kOwn) {
          const int r = threadIdx.x / 2;
          const bool hi_side = threadIdx.x % 2 != 0;
          A m = 0;
          for (int ii = 0; ii < nq; ++ii) {
            const KeySpan qin = inner_keys(i0 + ii, p.k_len, K, p.q_offset, p.k_offset);
            const int64_t jr = j0 + r;
            if (hi_side ? jr >= qin.end : jr < qin.begin) m += sDS[r * Tl::kLdP + ii];
          }
          sKm[threadIdx.x] += m;
        }
      }
    }
    if constexpr (kRelQ) {
      // The clamped buckets of head h: each owned key's dS mass there (sKm) times rel_q[0] /
      // rel_q[2K] into dk (sDkq), and times k_j into drel_q[0] / drel_q[2K].
      __syncthreads();  // sKm and sDkq complete
      for (int64_t idx = threadIdx.x; idx < nk * D; idx += Tl::kThreads) {
        const int64_t r = idx / D, d = idx % D;
        sDkq[r * Tl::kD + d] += sKm[r * 2 + 0] * A(to_float(eq[d])) +
                                sKm[r * 2 + 1] * A(to_float(eq[(table_rows - 1) * D + d]));
      }
      if (pq != nullptr) {
        for (int64_t d = threadIdx.x; d < D; d += Tl::kThreads) {
          A g_lo = 0, g_hi = 0;
          for (int r = 0; r < nk; ++r) {
            g_lo += sKm[r * 2 + 0] * sK[r * Tl::kD + d];
            g_hi += sKm[r * 2 + 1] * sK[r * Tl::kD + d];
          }
          atomicAdd(pq + d, g_lo * scale);
          atomicAdd(pq + (table_rows - 1) * D + d, g_hi * scale);
        }
      }
      __syncthreads();  // the readers of sKm are done before the next head zeroes it
    }
  }

  T* dkp = static_cast<T*>(bp.dk) + (bkv * p.k_len + j0) * D;
  T* dvp = static_cast<T*>(bp.dv) + (bkv * p.k_len + j0) * D;
  RELPOS_UNROLL
  for (int rr = 0; rr < R; ++rr) {
    const int r = warp * R + rr;
    if (r >= nk) break;
    RELPOS_UNROLL
    for (int c = 0; c < C; ++c) {
      const int64_t d = c * 32 + lane;
      if (d >= D) continue;
      A x = dk[rr][c];
      if constexpr (kRelQ) x += sDkq[r * Tl::kD + d];  // complete: the last head's closing barrier
      dkp[r * D + d] = from_float<T>(x * scale);
      dvp[r * D + d] = from_float<T>(dv[rr][c]);
    }
  }
}

// Grid: batch * kv_heads * ceil(k_len / kOwn) blocks, one key tile each; or, kSerial (set from
// bp.serial_q_tiles with rel_q, whose gradient the key tiles add to with atomics), batch *
// kv_heads blocks that each take their (b, kv head)'s key tiles in order, so that drel_q comes out
// bitwise the same on every run (as the dq kernel's kSerial). kSerial only with kRelQ: without
// rel_q this kernel has no atomics.
template <typename T, int kDC, bool kSerial, bool kBias, bool kRelQ>
__global__ void __launch_bounds__(AttnTile<acc_t<T>, kDC>::kThreads, 2)
    rel_attention_bwd_dkdv_kernel(RelAttentionBwdParams bp, const acc_t<T>* ws) {
  using Tl = AttnTile<acc_t<T>, kDC>;
  const int64_t k_tiles = (bp.fwd.k_len + Tl::kOwn - 1) / Tl::kOwn;
  if constexpr (!kSerial) {
    bwd_dkdv_tile<T, kDC, kBias, kRelQ>(bp, ws, blockIdx.x / k_tiles, blockIdx.x % k_tiles);
  } else {
    for (int64_t t = 0; t < k_tiles; ++t) {
      bwd_dkdv_tile<T, kDC, kBias, kRelQ>(bp, ws, blockIdx.x, t);
      __syncthreads();  // the next tile restages the shared memory this one read last
    }
  }
}

}  // namespace relpos::cuda
