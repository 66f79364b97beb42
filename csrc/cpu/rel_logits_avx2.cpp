// AVX2 path of the fused skewed matmul and the first stage of its backward:
//   rel_logits:  out[b, h, i, j] = q[b, h, i, :] . table[(h,) b(i, j), :]
//   bucket_sum:  wsum[b, h, i, c] = sum_{j: b(i, j) = bucket0 + c} grad[b, h, i, j]
//
// rel_logits tiling. A row i reaches the buckets [b(i, 0), b(i, Lk-1)], at most min(Lk, 2K+1) of
// them; rows i0..i0+5 together reach at most 5 more. Per block of kMR = 6 consecutive rows of one
// (b, h) the kernel computes QE = q_block @ table[reached buckets]^T (kMR x kNR register tile: 12
// accumulators, one broadcast of q per row and two loads of a table panel per d; kNR = 16 buckets,
// or 32 where rel_logits_avx512.cpp compiles this file with AVX-512 flags, with the same FMA
// chains, so the same results), and then writes
// each output row as the three runs of common/relpos_index.h: unclamped_keys: a constant fill with
// QE[., 0], a contiguous slice of the QE row (the bucket grows by one per key) and a constant fill
// with QE[., 2K]. The table is repacked once per call and (b, h) run into float32 panels of kNR
// buckets, [D][kNR] each (the "packed B" of a GEMM), covering only the buckets the rows reach: the
// cost is O(reached buckets * D), small next to the O(rows * min(Lk, 2K+1) * D) of the products.
//
// Clipped tables (2K+1 << Lk) are bound by the output stores, unclipped ones (K >= L-1) by the
// FMAs (Lq * Lk * D of them, half of what q @ E^T over all Lq + Lk - 1 distances costs).
#include <cstring>

#include "common/relpos_index.h"
#include "cpu/kernels.h"
#include "cpu/vec_avx2.h"

#ifndef RELPOS_ISA
#define RELPOS_ISA avx2
#endif

namespace relpos::cpu::RELPOS_ISA {
using namespace relpos::cpu::avx2;  // vec_avx2.h's helpers, when compiled as namespace avx512
namespace {

using V = MatmulVec;
constexpr int64_t kMR = 6;              // query rows per register tile
constexpr int64_t kNR = 2 * V::kLanes;  // buckets per packed panel (two registers)

// C[r, 0:kNR] = sum_d A[r, d] * P[d, 0:kNR] for r < M. A: M rows of D floats; P: one [D][kNR]
// panel.
template <int M>
inline void tile_kernel(const float* A, int64_t D, const float* P, float* C, int64_t ldc) {
  typename V::reg c0[M], c1[M];
#pragma GCC unroll 6
  for (int r = 0; r < M; ++r) c0[r] = c1[r] = V::zero();
  for (int64_t d = 0; d < D; ++d) {
    const typename V::reg b0 = V::load(P + d * kNR), b1 = V::load(P + d * kNR + V::kLanes);
#pragma GCC unroll 6
    for (int r = 0; r < M; ++r) {
      const typename V::reg a = V::bcast(A + r * D + d);
      c0[r] = V::fma(a, b0, c0[r]);
      c1[r] = V::fma(a, b1, c1[r]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < M; ++r) {
    V::store(C + r * ldc, c0[r]);
    V::store(C + r * ldc + V::kLanes, c1[r]);
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, float*, int64_t);
constexpr TileFn kTile[kMR + 1] = {nullptr,         tile_kernel<1>, tile_kernel<2>, tile_kernel<3>,
                                   tile_kernel<4>, tile_kernel<5>, tile_kernel<6>};

// Buckets [lo, lo + kNR * panels) of one head's table as float32 panels P[p][d][k] = table[lo +
// kNR p + k][d]; buckets past the table's end are zero.
struct Packed {
  const void* src = nullptr;
  int64_t lo = 0, panels = 0;
  float* data = nullptr;
  bool covers(const void* s, int64_t b_lo, int64_t b_hi) const {
    return src == s && lo <= b_lo && b_hi < lo + kNR * panels;
  }
};

template <typename T>
void pack_panels(const T* tab, int64_t rows, int64_t D, Packed& pk) {
  for (int64_t p = 0; p < pk.panels; ++p) {
    float* panel = pk.data + p * kNR * D;
    for (int64_t k = 0; k < kNR; ++k) {
      const int64_t b = pk.lo + p * kNR + k;
      if (b < rows) {
        const T* src = tab + b * D;
        for (int64_t d = 0; d < D; ++d) panel[d * kNR + k] = to_f32(src[d]);
      } else {
        for (int64_t d = 0; d < D; ++d) panel[d * kNR + k] = 0.0f;
      }
    }
  }
}

thread_local Scratch t_packed, t_qe, t_qf;

// Packing a table costs about as much as 8 rows of direct dot products over it: runs that would
// use a packed table for fewer rows (decoding steps, Lq = 1 per (b, h)) take the direct path.
constexpr int64_t kPackMinRows = 8;

// e[t] = x . rows[t] for t < n (rows: n rows of D elements), four rows per pass.
template <typename T>
void dot_rows(const float* x, const T* rows, int64_t D, int64_t n, float* e) {
  const int64_t d8 = D & ~int64_t(7);
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {
    const T* r = rows + t * D;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t d = 0; d < d8; d += 8) {
      const __m256 xv = _mm256_loadu_ps(x + d);
      a0 = _mm256_fmadd_ps(xv, load8(r + d), a0);
      a1 = _mm256_fmadd_ps(xv, load8(r + D + d), a1);
      a2 = _mm256_fmadd_ps(xv, load8(r + 2 * D + d), a2);
      a3 = _mm256_fmadd_ps(xv, load8(r + 3 * D + d), a3);
    }
    if (d8 < D) {
      const __m256 xv = load_n(x + d8, D - d8);
      a0 = _mm256_fmadd_ps(xv, load_n(r + d8, D - d8), a0);
      a1 = _mm256_fmadd_ps(xv, load_n(r + D + d8, D - d8), a1);
      a2 = _mm256_fmadd_ps(xv, load_n(r + 2 * D + d8, D - d8), a2);
      a3 = _mm256_fmadd_ps(xv, load_n(r + 3 * D + d8, D - d8), a3);
    }
    // per 128-bit half: [sum a0, sum a1, sum a2, sum a3]; then add the halves
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    _mm_storeu_ps(e + t, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
  }
  for (; t < n; ++t) {
    const T* r = rows + t * D;
    __m256 a = _mm256_setzero_ps();
    for (int64_t d = 0; d < d8; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(x + d), load8(r + d), a);
    if (d8 < D) a = _mm256_fmadd_ps(load_n(x + d8, D - d8), load_n(r + d8, D - d8), a);
    e[t] = hsum(a);
  }
}

// Output row i from its QE row, e[b - lo] = q_i . table[b]: the three runs of unclamped_keys.
template <typename T>
inline void write_row(T* o, const float* e, int64_t lo, int64_t i, const RelLogitsParams& p) {
  const int64_t Lk = p.k_len, K = p.max_distance;
  const KeySpan s = unclamped_keys(i, Lk, K, p.q_offset, p.k_offset);
  if (s.begin > 0) fill(o, from_f32<T>(e[0 - lo]), s.begin);
  if (s.end > s.begin) {
    const int64_t b = shaw_bucket(i, s.begin, K, p.q_offset, p.k_offset);
    convert_store(o + s.begin, e + (b - lo), s.end - s.begin);
  }
  if (s.end < Lk) fill(o + s.end, from_f32<T>(e[2 * K - lo]), Lk - s.end);
}

// q rows [row0, row0 + m) as float32: the input itself for float32, else a converted copy.
template <typename T>
inline const float* q_as_f32(const T* q, int64_t row0, int64_t m, int64_t D) {
  if constexpr (sizeof(T) == sizeof(float)) {
    return q + row0 * D;
  } else {
    float* qf = t_qf.get(m * D);
    convert_load(qf, q + row0 * D, m * D);
    return qf;
  }
}

template <typename T>
void logits_rows(const RelLogitsParams& p, int64_t begin, int64_t end) {
  const T* q = static_cast<const T*>(p.q);
  const T* table = static_cast<const T*>(p.table);
  T* out = static_cast<T*>(p.out);
  const int64_t D = p.dim, K = p.max_distance, rows = num_buckets(K);
  const int64_t Lq = p.q_len, Lk = p.k_len, qo = p.q_offset, ko = p.k_offset;
  // A segment of consecutive rows shares one table: a run of one (b, h) for per-head tables, the
  // whole [begin, end) for a shared one (so a register tile may span heads: with Lq = 1 every row
  // reaches the same buckets).
  const int64_t rows_per_pack = p.table_per_head ? imin(Lq, end - begin) : end - begin;
  const bool direct = rows_per_pack < kPackMinRows;
  Packed pk;  // valid for this call only: a later call may reuse the table's address
  float* qe = nullptr;
  int64_t ldqe = 0;
  for (int64_t seg = begin; seg < end;) {
    const int64_t bh = seg / Lq;
    const int64_t seg_end = p.table_per_head ? imin(end, (bh + 1) * Lq) : end;
    const T* tab = table + (p.table_per_head ? (bh % p.heads) * rows * D : 0);
    if (direct) {
      for (int64_t row = seg; row < seg_end; ++row) {
        const int64_t i = row % Lq;
        const int64_t lo = shaw_bucket(i, 0, K, qo, ko), hi = shaw_bucket(i, Lk - 1, K, qo, ko);
        float* e = t_qe.get(hi - lo + 1);
        dot_rows(q_as_f32(q, row, 1, D), tab + lo * D, D, hi - lo + 1, e);
        write_row(out + row * Lk, e, lo, i, p);
      }
      seg = seg_end;
      continue;
    }
    // Rows i of the segment lie in [i_min, i_max] (all of them once it wraps to another (b, h)).
    const bool wraps = seg / Lq != (seg_end - 1) / Lq;
    const int64_t i_min = wraps ? 0 : seg % Lq, i_max = wraps ? Lq - 1 : (seg_end - 1) % Lq;
    const int64_t seg_lo = shaw_bucket(i_max, 0, K, qo, ko);
    const int64_t seg_hi = shaw_bucket(i_min, Lk - 1, K, qo, ko);
    if (!pk.covers(tab, seg_lo, seg_hi)) {
      pk.src = tab;
      pk.lo = seg_lo;
      pk.panels = (seg_hi - seg_lo) / kNR + 1;
      pk.data = t_packed.get(pk.panels * kNR * D);
      pack_panels(tab, rows, D, pk);
      ldqe = pk.panels * kNR + kNR;  // padded: QE rows 2^k floats apart would share L1 sets
      qe = t_qe.get(kMR * ldqe);
    }
    for (int64_t row0 = seg; row0 < seg_end; row0 += kMR) {
      const int64_t m = imin(kMR, seg_end - row0);
      int64_t bi_min = Lq, bi_max = -1;  // rows i of this block
      for (int64_t r = 0; r < m; ++r) {
        bi_min = imin(bi_min, (row0 + r) % Lq);
        bi_max = imax(bi_max, (row0 + r) % Lq);
      }
      const float* A = q_as_f32(q, row0, m, D);
      // Panels holding the buckets that the block's rows reach.
      const int64_t p0 = (shaw_bucket(bi_max, 0, K, qo, ko) - pk.lo) / kNR;
      const int64_t p1 = (shaw_bucket(bi_min, Lk - 1, K, qo, ko) - pk.lo) / kNR;
      const TileFn tile = kTile[m];
      for (int64_t pp = p0; pp <= p1; ++pp) tile(A, D, pk.data + pp * kNR * D, qe + pp * kNR, ldqe);
      for (int64_t r = 0; r < m; ++r) {
        write_row(out + (row0 + r) * Lk, qe + r * ldqe, pk.lo, (row0 + r) % Lq, p);
      }
    }
    seg = seg_end;
  }
}

template <typename T>
void bucket_sum_rows(const BucketSumParams& p, int64_t begin, int64_t end) {
  const T* grad = static_cast<const T*>(p.grad);
  float* wsum = static_cast<float*>(p.wsum);
  const int64_t K = p.max_distance, Lk = p.k_len, C = p.num_cols, b0 = p.bucket0;
  for (int64_t item = begin; item < end; ++item) {
    const int64_t i = item % p.q_len;
    const T* g = grad + item * Lk;
    float* w = wsum + item * C;
    const KeySpan s = unclamped_keys(i, Lk, K, p.q_offset, p.k_offset);
    // The middle run writes columns [mid, mid + n) one key each; everything else starts at zero.
    const int64_t n = s.end - s.begin;
    const int64_t mid = n > 0 ? shaw_bucket(i, s.begin, K, p.q_offset, p.k_offset) - b0 : 0;
    fill_f32(w, 0.0f, mid);
    convert_load(w + mid, g + s.begin, n);
    fill_f32(w + mid + n, 0.0f, C - mid - n);
    if (s.begin > 0) w[0 - b0] += sum_n(g, s.begin);
    if (s.end < Lk) w[2 * K - b0] += sum_n(g + s.end, Lk - s.end);
  }
}

}  // namespace

void rel_logits(const RelLogitsParams& p, int64_t begin, int64_t end) {
  dispatch(p.dtype, [&](auto tag) { logits_rows<decltype(tag)>(p, begin, end); });
}

void bucket_sum(const BucketSumParams& p, int64_t begin, int64_t end) {
  dispatch(p.dtype, [&](auto tag) { bucket_sum_rows<decltype(tag)>(p, begin, end); });
}

}  // namespace relpos::cpu::RELPOS_ISA
