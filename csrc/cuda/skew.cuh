// Music Transformer skew and its adjoint (Huang et al. 2018; tensor2tensor's
// _relative_position_to_absolute_position_{unmasked,masked}), as row-wise gathers:
//   skew:          y[n, i, j]  = x[n, i, skew_col(i, j)]          (causal: 0 where j > i)
//   skew_backward: dx[n, i, c] = dy[n, i, c - skew_col(i, 0)]     when that key exists and is
//                                visible, else 0 (every output element is written)
// Pure data movement, so the kernels are templated on the element's bit pattern U (2, 4 or 8
// bytes), not on the dtype. Tiling: blockDim = (bx, by); row n * Lq + i = blockIdx.x * by +
// threadIdx.y, and the bx threads of the row with the blockIdx.y chunks stride over its columns.
#pragma once

#include "common/params.h"
#include "common/relpos_index.h"
#include "cuda/device.cuh"

namespace relpos::cuda {

template <typename U, bool kBackward>
__global__ void skew_kernel(SkewParams p) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (row >= p.batch * p.q_len) return;
  const int64_t i = row % p.q_len;
  const int64_t width = p.causal ? p.k_len : skew_width(p.q_len, p.k_len);
  const int64_t in_cols = kBackward ? p.k_len : width;
  const int64_t out_cols = kBackward ? width : p.k_len;
  const U* in = static_cast<const U*>(p.in) + row * in_cols;
  U* out = static_cast<U*>(p.out) + row * out_cols;
  const int64_t shift = skew_col(i, 0, p.q_len);  // skew_col(i, j) = j + shift
  const int64_t stride = static_cast<int64_t>(gridDim.y) * blockDim.x;
  for (int64_t c = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x; c < out_cols;
       c += stride) {
    const int64_t j = kBackward ? c - shift : c;  // the key of this element
    const bool valid = (j >= 0 && j < p.k_len) && (!p.causal || causal_visible(i, j));
    out[c] = valid ? in[kBackward ? j : skew_col(i, j, p.q_len)] : zero_bits<U>();
  }
}

}  // namespace relpos::cuda
