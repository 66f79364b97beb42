// Rotary position embedding (RopeParams in common/params.h): each thread takes "units" of a row,
// a unit being one rotation pair (rope_first/rope_second, relpos_index.h) or, past the rot / 2
// pairs, one pass-through feature. Tiling: blockDim = (bx, by); row = blockIdx.x * by +
// threadIdx.y, and the bx threads of the row with the blockIdx.y chunks stride over its units.
#pragma once

#include "common/params.h"
#include "common/relpos_index.h"
#include "cuda/device.cuh"
#include "cuda/dtype.cuh"

namespace relpos::cuda {

template <typename T>
__global__ void rope_kernel(RopeParams p) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (row >= p.n0 * p.n1 * p.n2) return;
  const T* x = static_cast<const T*>(p.x) + row * p.dim;
  T* y = static_cast<T*>(p.out) + row * p.dim;
  const int64_t co = rope_cos_offset(row, p.n1, p.n2, p.cs0, p.cs1, p.cs2);
  const T* c = static_cast<const T*>(p.cos) + co;
  const T* s = static_cast<const T*>(p.sin) + co;
  const int64_t pairs = p.rot / 2;
  const int64_t units = pairs + (p.dim - p.rot);
  const int64_t stride = static_cast<int64_t>(gridDim.y) * blockDim.x;
  for (int64_t u = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x; u < units;
       u += stride) {
    if (u < pairs) {
      const int64_t a = rope_first(u, p.interleaved), b = rope_second(u, p.rot, p.interleaved);
      acc_t<T> ya, yb;
      rope_rotate<acc_t<T>>(to_float(x[a]), to_float(x[b]), to_float(c[a]), to_float(c[b]),
                            to_float(s[a]), to_float(s[b]), p.inverse, ya, yb);
      y[a] = from_float<T>(ya);
      y[b] = from_float<T>(yb);
    } else {
      const int64_t k = p.rot + (u - pairs);
      y[k] = x[k];
    }
  }
}

}  // namespace relpos::cuda
