// rel_gather and its deterministic backward (DESIGN.md §1, "the relative-embedding gather").
//   forward:   out[h, i, j, :] = table[h, b(i, j), :]
//   backward:  dtable[h, b, :] = sum_{(i, j): b(i, j) = b} grad[h, i, j, :]
// Index math: common/relpos_index.h (unclamped_keys, bucket_keys, bucket_rows).
#pragma once

#include "common/params.h"
#include "common/relpos_index.h"
#include "cuda/device.cuh"
#include "cuda/dtype.cuh"

namespace relpos::cuda {

// ---- forward: a pure copy, so it is templated on the copy unit U, not on the dtype ------------
// Output row (h, i) is Lk * D elements. Inside the unclamped key span [s.begin, s.end) the bucket
// grows by one per key, so that stretch is ONE contiguous copy of table rows b(i, s.begin) ...;
// left of it every key repeats row 0, right of it row 2K. Counted in units U of the row
// (units_per_row = D * sizeof(T) / sizeof(U)), that is:
//   e <  begin * Du:  table[0][e % Du]
//   e <  end * Du:    table[b(i, begin)][0] + (e - begin * Du)
//   else:             table[2K][(e - end * Du) % Du]
// Tiling: blockDim = (bx, by); threadIdx.y picks one of `by` rows of the block (blockIdx.x), the
// bx threads of a row and the blockIdx.y chunks stride over its units (short rows fill the block
// with several rows instead of idling threads).
template <typename U>
__global__ void rel_gather_kernel(RelGatherParams p, int64_t units_per_row) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (row >= p.heads * p.q_len) return;
  const int64_t h = row / p.q_len, i = row - h * p.q_len;
  const int64_t du = units_per_row;
  const int64_t rows = num_buckets(p.max_distance);
  const U* tab = static_cast<const U*>(p.table) + h * rows * du;
  U* out = static_cast<U*>(p.out) + row * p.k_len * du;
  const KeySpan s = unclamped_keys(i, p.k_len, p.max_distance, p.q_offset, p.k_offset);
  const int64_t lo = s.begin * du, hi = s.end * du;
  const U* mid = s.end > s.begin
                     ? tab + shaw_bucket(i, s.begin, p.max_distance, p.q_offset, p.k_offset) * du
                     : tab;
  const U* last = tab + (rows - 1) * du;
  const int64_t n = p.k_len * du;
  const int64_t stride = static_cast<int64_t>(gridDim.y) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  for (int64_t e = first; e < n; e += stride) {
    U v;
    if (e < lo) {
      v = tab[e % du];
    } else if (e < hi) {
      v = mid[e - lo];
    } else {
      v = last[(e - hi) % du];
    }
    out[e] = v;
  }
}

// ---- backward: deterministic scatter-add as a gather over buckets ------------------------------
// One work item = (h, bucket b, chunk of DW consecutive d); blocks stride over the items. The
// block is (DW, BY) with DW * BY = kGatherBwdThreads: lane x owns d = d0 + x, and the BY slices
// split the (i, j) pairs of the bucket in a fixed way:
//   middle bucket (<= min(Lq, Lk) pairs, one per row): slice y takes the rows
//     bucket_rows(b).begin + y, + y + BY, + y + 2 BY, ...;
//   clamped bucket 0 or 2K (up to Lq * Lk pairs): in every row, slice y takes the keys
//     bucket_keys(i, b).begin + y, + y + BY, ...
// then a shared-memory tree over the slices, always pairing the same partial sums. The order of
// every addition depends only on (shape, blockDim), never on scheduling: bitwise reproducible.
// Buckets no pair reaches are written as zeros, so dtable is fully written.
constexpr int kGatherBwdThreads = 256;

template <typename T>
__global__ void rel_gather_backward_kernel(RelGatherBwdParams p) {
  using A = acc_t<T>;
  __shared__ A partial[kGatherBwdThreads];
  const int dw = blockDim.x, by = blockDim.y;
  const int x = threadIdx.x, y = threadIdx.y;
  const int64_t rows = num_buckets(p.max_distance);
  const int64_t chunks = (p.dim + dw - 1) / dw;
  const int64_t items = p.heads * rows * chunks;
  const T* grad = static_cast<const T*>(p.grad);
  T* dtable = static_cast<T*>(p.dtable);
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int64_t chunk = item % chunks, hb = item / chunks;  // hb = h * rows + b
    const int64_t b = hb % rows, h = hb / rows;
    const int64_t d = chunk * dw + x;
    const bool active = d < p.dim;
    const T* g = grad + h * p.q_len * p.k_len * p.dim + d;
    const RowSpan rs = bucket_rows(b, p.q_len, p.k_len, p.max_distance, p.q_offset, p.k_offset);
    A acc = 0;
    if (active) {
      if (b == 0 || b == rows - 1) {
        for (int64_t i = rs.begin; i < rs.end; ++i) {
          const KeySpan ks = bucket_keys(i, b, p.k_len, p.max_distance, p.q_offset, p.k_offset);
          for (int64_t j = ks.begin + y; j < ks.end; j += by) {
            acc += to_float(g[(i * p.k_len + j) * p.dim]);
          }
        }
      } else {
        for (int64_t i = rs.begin + y; i < rs.end; i += by) {
          const KeySpan ks = bucket_keys(i, b, p.k_len, p.max_distance, p.q_offset, p.k_offset);
          acc += to_float(g[(i * p.k_len + ks.begin) * p.dim]);  // exactly one key per row
        }
      }
    }
    partial[y * dw + x] = acc;
    __syncthreads();
    for (int s = by / 2; s > 0; s /= 2) {
      if (y < s) partial[y * dw + x] += partial[(y + s) * dw + x];
      __syncthreads();
    }
    if (y == 0 && active) dtable[hb * p.dim + d] = from_float<T>(partial[x]);
    __syncthreads();  // partial is rewritten by the next item
  }
}

}  // namespace relpos::cuda
