// AVX2 path of the fused skewed matmul and the first stage of its backward:
//   rel_logits:  out[b, h, i, j] = q[b, h, i, :] . table[(h,) b(i, j), :]
//   bucket_sum:  wsum[b, h, i, c] = sum_{j: b(i, j) = bucket0 + c} grad[b, h, i, j]
//
// rel_logits tiling. A row i reaches the buckets [b(i, 0), b(i, Lk-1)], at most min(Lk, 2K+1) of
// them; rows i0..i0+5 together reach at most 5 more. Per block of kMR = 6 consecutive rows of one
// (b, h) the kernel computes QE = q_block @ table[reached buckets]^T (kMR x 16 register tile: 12
// accumulators, one broadcast of q per row and two loads of a table panel per d), and then writes
// each output row as the three runs of common/relpos_index.h: unclamped_keys: a constant fill with
// QE[., 0], a contiguous slice of the QE row (the bucket grows by one per key) and a constant fill
// with QE[., 2K]. The table is repacked once per call and (b, h) run into float32 panels of 16
// buckets, [D][16] each (the "packed B" of a GEMM), covering only the buckets the rows reach: the
// cost is O(reached buckets * D), small next to the O(rows * min(Lk, 2K+1) * D) of the products.
//
// Clipped tables (2K+1 << Lk) are bound by the output stores, unclipped ones (K >= L-1) by the
// FMAs (Lq * Lk * D of them, half of what q @ E^T over all Lq + Lk - 1 distances costs).
#include <cstring>

#include "common/relpos_index.h"
#include "cpu/kernels.h"
#include "cpu/vec_avx2.h"

namespace relpos::cpu::avx2 {
namespace {

constexpr int64_t kMR = 6;   // query rows per register tile
constexpr int64_t kNR = 16;  // buckets per packed panel (two ymm)

// C[r, 0:16] = sum_d A[r, d] * P[d, 0:16] for r < M. A: M rows of D floats; P: one [D][16] panel.
template <int M>
inline void tile_kernel(const float* A, int64_t D, const float* P, float* C, int64_t ldc) {
  __m256 c0[M], c1[M];
#pragma GCC unroll 6
  for (int r = 0; r < M; ++r) c0[r] = c1[r] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m256 b0 = _mm256_load_ps(P + d * kNR), b1 = _mm256_load_ps(P + d * kNR + 8);
#pragma GCC unroll 6
    for (int r = 0; r < M; ++r) {
      const __m256 a = _mm256_broadcast_ss(A + r * D + d);
      c0[r] = _mm256_fmadd_ps(a, b0, c0[r]);
      c1[r] = _mm256_fmadd_ps(a, b1, c1[r]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < M; ++r) {
    _mm256_storeu_ps(C + r * ldc, c0[r]);
    _mm256_storeu_ps(C + r * ldc + 8, c1[r]);
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, float*, int64_t);
constexpr TileFn kTile[kMR + 1] = {nullptr,         tile_kernel<1>, tile_kernel<2>, tile_kernel<3>,
                                   tile_kernel<4>, tile_kernel<5>, tile_kernel<6>};

// Buckets [lo, lo + 16 * panels) of one head's table as float32 panels P[p][d][k] = table[lo +
// 16p + k][d]; buckets past the table's end are zero.
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

template <typename T>
void logits_rows(const RelLogitsParams& p, int64_t begin, int64_t end) {
  const T* q = static_cast<const T*>(p.q);
  const T* table = static_cast<const T*>(p.table);
  T* out = static_cast<T*>(p.out);
  const int64_t D = p.dim, K = p.max_distance, rows = num_buckets(K);
  const int64_t Lq = p.q_len, Lk = p.k_len, qo = p.q_offset, ko = p.k_offset;
  Packed pk;  // valid for this call only: a later call may reuse the table's address
  float* qe = nullptr;
  int64_t ldqe = 0;
  for (int64_t item = begin; item < end;) {
    // One run of rows [ia, ib) of the same (b, h).
    const int64_t bh = item / Lq, ia = item % Lq;
    const int64_t run_end = imin(end, (bh + 1) * Lq);
    const int64_t ib = ia + (run_end - item);
    const T* tab = table + (p.table_per_head ? (bh % p.heads) * rows * D : 0);
    const int64_t run_lo = shaw_bucket(ib - 1, 0, K, qo, ko);
    const int64_t run_hi = shaw_bucket(ia, Lk - 1, K, qo, ko);
    if (!pk.covers(tab, run_lo, run_hi)) {
      pk.src = tab;
      pk.lo = run_lo;
      pk.panels = (run_hi - run_lo) / kNR + 1;
      pk.data = t_packed.get(pk.panels * kNR * D);
      pack_panels(tab, rows, D, pk);
      ldqe = pk.panels * kNR;
      qe = t_qe.get(kMR * ldqe);
    }
    for (int64_t i0 = ia; i0 < ib; i0 += kMR) {
      const int64_t m = imin(kMR, ib - i0);
      const int64_t row0 = bh * Lq + i0;
      const float* A;
      if constexpr (sizeof(T) == sizeof(float)) {
        A = q + row0 * D;
      } else {
        float* qf = t_qf.get(kMR * D);
        convert_load(qf, q + row0 * D, m * D);
        A = qf;
      }
      // Panels holding the buckets that rows i0 .. i0+m-1 reach.
      const int64_t p0 = (shaw_bucket(i0 + m - 1, 0, K, qo, ko) - pk.lo) / kNR;
      const int64_t p1 = (shaw_bucket(i0, Lk - 1, K, qo, ko) - pk.lo) / kNR;
      const TileFn tile = kTile[m];
      for (int64_t pp = p0; pp <= p1; ++pp) tile(A, D, pk.data + pp * kNR * D, qe + pp * kNR, ldqe);
      for (int64_t r = 0; r < m; ++r) {
        const int64_t i = i0 + r;
        const float* e = qe + r * ldqe;  // e[b - pk.lo] = q_i . table[b]
        T* o = out + (row0 + r) * Lk;
        const KeySpan s = unclamped_keys(i, Lk, K, qo, ko);
        if (s.begin > 0) fill(o, from_f32<T>(e[0 - pk.lo]), s.begin);
        if (s.end > s.begin) {
          const int64_t b = shaw_bucket(i, s.begin, K, qo, ko);
          convert_store(o + s.begin, e + (b - pk.lo), s.end - s.begin);
        }
        if (s.end < Lk) fill(o + s.end, from_f32<T>(e[rows - 1 - pk.lo]), Lk - s.end);
      }
    }
    item = run_end;
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

}  // namespace relpos::cpu::avx2
