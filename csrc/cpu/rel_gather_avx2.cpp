// AVX2 path of the relative-embedding gather and its adjoint:
//   rel_gather:           out[h, i, j, :] = table[h, b(i, j), :]
//   rel_gather_backward:  dtable[h, b, :] = sum_{(i, j): b(i, j) = b} grad[h, i, j, :]
// Per query row the keys split into three runs (common/relpos_index.h: unclamped_keys): a left run
// that all maps to bucket 0, a middle run whose bucket grows by one per key, and a right run that
// maps to bucket 2K. The forward is therefore one memcpy of consecutive table rows plus two
// replicated rows; the backward adds each run in (i, j) order into float32 accumulators, which is
// the scalar kernel's order per bucket, so the result is bit-identical to it and independent of
// how the work items (h, 16-wide d block) are split over threads.
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

// acc[0, w) += g[t * stride + (0, w)] for t = 0, 1, ..., count - 1 in that order (a clamped run:
// every key of it adds into the same bucket). Stripes of 32 columns stay in registers.
template <typename T>
inline void add_run(float* acc, const T* g, int64_t stride, int64_t count, int64_t w) {
  int64_t c = 0;
  for (; c + 32 <= w; c += 32) {
    __m256 a0 = _mm256_loadu_ps(acc + c), a1 = _mm256_loadu_ps(acc + c + 8);
    __m256 a2 = _mm256_loadu_ps(acc + c + 16), a3 = _mm256_loadu_ps(acc + c + 24);
    for (int64_t t = 0; t < count; ++t) {
      const T* r = g + t * stride + c;
      a0 = _mm256_add_ps(a0, load8(r));
      a1 = _mm256_add_ps(a1, load8(r + 8));
      a2 = _mm256_add_ps(a2, load8(r + 16));
      a3 = _mm256_add_ps(a3, load8(r + 24));
    }
    _mm256_storeu_ps(acc + c, a0);
    _mm256_storeu_ps(acc + c + 8, a1);
    _mm256_storeu_ps(acc + c + 16, a2);
    _mm256_storeu_ps(acc + c + 24, a3);
  }
  if (c + 16 <= w) {
    __m256 a0 = _mm256_loadu_ps(acc + c), a1 = _mm256_loadu_ps(acc + c + 8);
    for (int64_t t = 0; t < count; ++t) {
      a0 = _mm256_add_ps(a0, load8(g + t * stride + c));
      a1 = _mm256_add_ps(a1, load8(g + t * stride + c + 8));
    }
    _mm256_storeu_ps(acc + c, a0);
    _mm256_storeu_ps(acc + c + 8, a1);
    c += 16;
  }
  if (c + 8 <= w) {
    __m256 a0 = _mm256_loadu_ps(acc + c);
    for (int64_t t = 0; t < count; ++t) a0 = _mm256_add_ps(a0, load8(g + t * stride + c));
    _mm256_storeu_ps(acc + c, a0);
    c += 8;
  }
  for (; c < w; ++c) {
    float a0 = acc[c];
    for (int64_t t = 0; t < count; ++t) a0 += to_f32(g[t * stride + c]);
    acc[c] = a0;
  }
}

// acc[t * lda + (0, w)] += g[t * stride + (0, w)] for t in [0, count): the middle run, one bucket
// per key.
template <typename T>
inline void add_diag(float* acc, int64_t lda, const T* g, int64_t stride, int64_t count,
                     int64_t w) {
  for (int64_t t = 0; t < count; ++t) {
    float* a = acc + t * lda;
    const T* r = g + t * stride;
    int64_t c = 0;
    for (; c + 8 <= w; c += 8) _mm256_storeu_ps(a + c, _mm256_add_ps(_mm256_loadu_ps(a + c), load8(r + c)));
    for (; c < w; ++c) a[c] += to_f32(r[c]);
  }
}

thread_local Scratch t_gather_acc;

// Accumulators of one pass: reached buckets x (16-wide d blocks). The budget keeps them in L2.
constexpr int64_t kGatherAccBytes = int64_t(256) << 10;

// Consecutive work items (h, d block) of one head in [begin, end) are done in one pass over the
// gradient, reading its rows contiguously instead of 16 elements at a stride of D. Each element of
// dtable still receives its terms in (i, j) order, so the result does not depend on the grouping.
template <typename T>
void gather_backward_items(const RelGatherBwdParams& p, int64_t begin, int64_t end) {
  const T* grad = static_cast<const T*>(p.grad);
  T* dtable = static_cast<T*>(p.dtable);
  const int64_t rows = num_buckets(p.max_distance), D = p.dim, K = p.max_distance;
  const int64_t nblk = (D + kGatherBwdDBlock - 1) / kGatherBwdDBlock;
  // Only buckets [lo, hi] are reachable; accumulate those, write zeros elsewhere.
  const int64_t lo = first_bucket(p.q_len, K, p.q_offset, p.k_offset);
  const int64_t hi = last_bucket(p.k_len, K, p.q_offset, p.k_offset);
  const int64_t reach = hi - lo + 1;
  const int64_t max_blocks =
      imax(1, kGatherAccBytes / (reach * kGatherBwdDBlock * int64_t(sizeof(float))));
  for (int64_t item = begin; item < end;) {
    const int64_t h = item / nblk, blk = item % nblk;
    const int64_t nb = imin(imin(end - item, nblk - blk), max_blocks);
    const int64_t d0 = blk * kGatherBwdDBlock;
    const int64_t w = imin(D, d0 + nb * kGatherBwdDBlock) - d0;  // columns [d0, d0 + w)
    const int64_t lda = nb * kGatherBwdDBlock;
    float* acc = t_gather_acc.get(reach * lda);
    std::memset(acc, 0, sizeof(float) * reach * lda);
    for (int64_t i = 0; i < p.q_len; ++i) {
      const T* g = grad + ((h * p.q_len + i) * p.k_len) * D + d0;
      const KeySpan s = unclamped_keys(i, p.k_len, K, p.q_offset, p.k_offset);
      // (i, j) order per bucket: bucket 0 gets the left run before a middle key of distance -K,
      // bucket 2K gets a middle key of distance +K before the right run, as in the scalar loop.
      if (s.begin > 0) add_run(acc + (0 - lo) * lda, g, D, s.begin, w);
      if (s.end > s.begin) {
        const int64_t b = shaw_bucket(i, s.begin, K, p.q_offset, p.k_offset);
        add_diag(acc + (b - lo) * lda, lda, g + s.begin * D, D, s.end - s.begin, w);
      }
      if (s.end < p.k_len) add_run(acc + (2 * K - lo) * lda, g + s.end * D, D, p.k_len - s.end, w);
    }
    T* dt = dtable + h * rows * D + d0;
    for (int64_t b = 0; b < rows; ++b) {
      if (b < lo || b > hi) {
        std::memset(dt + b * D, 0, sizeof(T) * w);
      } else {
        convert_store(dt + b * D, acc + (b - lo) * lda, w);
      }
    }
    item += nb;
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
