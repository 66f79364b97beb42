// AVX2 path of the relative-embedding gather and its adjoint:
//   rel_gather:           out[h, i, j, :] = table[h, b(i, j), :]
//   rel_gather_backward:  dtable[h, b, :] = sum_{(i, j): b(i, j) = b} grad[h, i, j, :]
// Per query row the keys split into three runs (common/relpos_index.h: unclamped_keys): a left run
// that all maps to bucket 0, a middle run whose bucket grows by one per key, and a right run that
// maps to bucket 2K. The forward is therefore one memcpy of consecutive table rows plus two
// replicated rows; the backward adds each run in (i, j) order into float32 accumulators, which is
// the scalar kernel's order per bucket, so the result is bit-identical to it and independent of
// how the work items are split over threads.
#include <cstring>

#include "common/relpos_index.h"
#include "cpu/kernels.h"
#include "cpu/vec_avx2.h"

namespace relpos::cpu::avx2 {
namespace {

// dst[0, count * row_elems) = count copies of `row` (row_elems elements), by doubling memcpys.
template <typename T>
void replicate_row(T* dst, const T* row, int64_t row_elems, int64_t count) {
  if (count <= 0) return;
  std::memcpy(dst, row, sizeof(T) * row_elems);
  int64_t done = 1;
  while (done < count) {
    const int64_t n = imin(done, count - done);
    std::memcpy(dst + done * row_elems, dst, sizeof(T) * n * row_elems);
    done += n;
  }
}

template <typename T>
void gather_rows(const RelGatherParams& p, int64_t begin, int64_t end) {
  const T* table = static_cast<const T*>(p.table);
  T* out = static_cast<T*>(p.out);
  const int64_t rows = num_buckets(p.max_distance), D = p.dim;
  for (int64_t item = begin; item < end; ++item) {
    const int64_t h = item / p.q_len, i = item % p.q_len;
    const T* tab = table + h * rows * D;
    T* o = out + item * p.k_len * D;
    const KeySpan s = unclamped_keys(i, p.k_len, p.max_distance, p.q_offset, p.k_offset);
    replicate_row(o, tab, D, s.begin);
    if (s.end > s.begin) {
      const int64_t b = shaw_bucket(i, s.begin, p.max_distance, p.q_offset, p.k_offset);
      std::memcpy(o + s.begin * D, tab + b * D, sizeof(T) * (s.end - s.begin) * D);
    }
    replicate_row(o + s.end * D, tab + (rows - 1) * D, D, p.k_len - s.end);
  }
}

// acc[0, 16) += grad rows g, g + stride, ... (count rows), in order. nd (<= 16) valid lanes.
template <typename T>
inline void add_rows16(float* acc, const T* g, int64_t stride, int64_t count, int64_t nd) {
  if (nd == kGatherBwdDBlock) {
    __m256 a0 = _mm256_loadu_ps(acc), a1 = _mm256_loadu_ps(acc + 8);
    for (int64_t t = 0; t < count; ++t) {
      a0 = _mm256_add_ps(a0, load8(g + t * stride));
      a1 = _mm256_add_ps(a1, load8(g + t * stride + 8));
    }
    _mm256_storeu_ps(acc, a0);
    _mm256_storeu_ps(acc + 8, a1);
  } else {
    for (int64_t t = 0; t < count; ++t)
      for (int64_t d = 0; d < nd; ++d) acc[d] += to_f32(g[t * stride + d]);
  }
}

// acc[t * 16 + d] += g[t * stride + d] for t in [0, count): the middle run, one bucket per key.
template <typename T>
inline void add_diag16(float* acc, const T* g, int64_t stride, int64_t count, int64_t nd) {
  if (nd == kGatherBwdDBlock) {
    for (int64_t t = 0; t < count; ++t) {
      float* a = acc + t * kGatherBwdDBlock;
      _mm256_storeu_ps(a, _mm256_add_ps(_mm256_loadu_ps(a), load8(g + t * stride)));
      _mm256_storeu_ps(a + 8, _mm256_add_ps(_mm256_loadu_ps(a + 8), load8(g + t * stride + 8)));
    }
  } else {
    for (int64_t t = 0; t < count; ++t)
      for (int64_t d = 0; d < nd; ++d) acc[t * kGatherBwdDBlock + d] += to_f32(g[t * stride + d]);
  }
}

thread_local Scratch t_gather_acc;

template <typename T>
void gather_backward_items(const RelGatherBwdParams& p, int64_t begin, int64_t end) {
  const T* grad = static_cast<const T*>(p.grad);
  T* dtable = static_cast<T*>(p.dtable);
  const int64_t rows = num_buckets(p.max_distance), D = p.dim, K = p.max_distance;
  const int64_t nblk = (D + kGatherBwdDBlock - 1) / kGatherBwdDBlock;
  // Only buckets [lo, hi] are reachable; accumulate those, write zeros elsewhere.
  const int64_t lo = first_bucket(p.q_len, K, p.q_offset, p.k_offset);
  const int64_t hi = last_bucket(p.k_len, K, p.q_offset, p.k_offset);
  float* acc = t_gather_acc.get((hi - lo + 1) * kGatherBwdDBlock);
  for (int64_t item = begin; item < end; ++item) {
    const int64_t h = item / nblk, d0 = (item % nblk) * kGatherBwdDBlock;
    const int64_t nd = imin(kGatherBwdDBlock, D - d0);
    std::memset(acc, 0, sizeof(float) * (hi - lo + 1) * kGatherBwdDBlock);
    for (int64_t i = 0; i < p.q_len; ++i) {
      const T* g = grad + ((h * p.q_len + i) * p.k_len) * D + d0;
      const KeySpan s = unclamped_keys(i, p.k_len, K, p.q_offset, p.k_offset);
      // (i, j) order per bucket: bucket 0 gets the left run before a middle key of distance -K,
      // bucket 2K gets a middle key of distance +K before the right run, as in the scalar loop.
      if (s.begin > 0) add_rows16(acc + (0 - lo) * kGatherBwdDBlock, g, D, s.begin, nd);
      if (s.end > s.begin) {
        const int64_t b = shaw_bucket(i, s.begin, K, p.q_offset, p.k_offset);
        add_diag16(acc + (b - lo) * kGatherBwdDBlock, g + s.begin * D, D, s.end - s.begin, nd);
      }
      if (s.end < p.k_len) {
        add_rows16(acc + (2 * K - lo) * kGatherBwdDBlock, g + s.end * D, D, p.k_len - s.end, nd);
      }
    }
    T* dt = dtable + h * rows * D + d0;
    for (int64_t b = 0; b < rows; ++b) {
      T* dst = dt + b * D;
      if (b < lo || b > hi) {
        std::memset(dst, 0, sizeof(T) * nd);
        continue;
      }
      const float* a = acc + (b - lo) * kGatherBwdDBlock;
      if (nd == kGatherBwdDBlock) {
        store8(dst, _mm256_loadu_ps(a));
        store8(dst + 8, _mm256_loadu_ps(a + 8));
      } else {
        for (int64_t d = 0; d < nd; ++d) dst[d] = from_f32<T>(a[d]);
      }
    }
  }
}

}  // namespace

void rel_gather(const RelGatherParams& p, int64_t begin, int64_t end) {
  dispatch(p.dtype, [&](auto tag) { gather_rows<decltype(tag)>(p, begin, end); });
}

void rel_gather_backward(const RelGatherBwdParams& p, int64_t begin, int64_t end) {
  dispatch(p.dtype, [&](auto tag) { gather_backward_items<decltype(tag)>(p, begin, end); });
}

}  // namespace relpos::cpu::avx2
