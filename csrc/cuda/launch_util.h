// Host helpers of the launchers (csrc/cuda/*.cu): DType dispatch, the row-wise grid of the copy
// kernels, and CUDA's grid-size limits (gridDim.x < 2^31, gridDim.y and gridDim.z <= 65535).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "common/params.h"
#include "cuda/device.cuh"

namespace relpos::cuda {

// Calls f.template operator()<T>() with the element type of `d` (host side, in launchers).
template <typename F>
inline void dispatch_dtype(DType d, F&& f) {
  switch (d) {
    case DType::Float32: f.template operator()<float>(); return;
    case DType::Float64: f.template operator()<double>(); return;
    case DType::Float16: f.template operator()<__half>(); return;
    case DType::BFloat16: f.template operator()<__nv_bfloat16>(); return;
  }
}

inline int64_t dtype_size(DType d) {
  switch (d) {
    case DType::Float32: return 4;
    case DType::Float64: return 8;
    case DType::Float16:
    case DType::BFloat16: return 2;
  }
  return 0;
}

constexpr int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Smallest power of two >= n (n >= 1), capped at `cap`.
constexpr int64_t pow2_at_least(int64_t n, int64_t cap) {
  int64_t p = 1;
  while (p < n && p < cap) p *= 2;
  return p;
}

constexpr int64_t kMaxGridX = 2147483647;
constexpr int64_t kMaxGridYZ = 65535;

inline unsigned grid_x(int64_t blocks, const char* what) {
  if (blocks > kMaxGridX) {
    throw std::runtime_error(std::string("relpos CUDA: ") + what + " needs " +
                             std::to_string(blocks) + " blocks, more than gridDim.x allows");
  }
  return static_cast<unsigned>(blocks);
}

// `rows` independent rows of `row_len` elements each, a 256-thread block: blockDim.x threads
// per row (a power of two, 256 or down to 32 for short rows) and blockDim.y = 256 / blockDim.x
// rows per block; blockIdx.y splits long rows into chunks of about 4 elements per thread.
struct RowGrid {
  dim3 grid, block;
};

inline RowGrid row_grid(int64_t rows, int64_t row_len, const char* what) {
  constexpr int64_t kThreads = 256, kPerThread = 4;
  const int64_t bx = pow2_at_least(row_len < 32 ? 32 : row_len, kThreads);
  const int64_t by = kThreads / bx;
  int64_t chunks = cdiv(row_len, bx * kPerThread);
  if (chunks > kMaxGridYZ) chunks = kMaxGridYZ;  // the kernels stride over the rest
  if (chunks < 1) chunks = 1;
  RowGrid g;
  g.grid = dim3(grid_x(cdiv(rows, by), what), static_cast<unsigned>(chunks), 1);
  g.block = dim3(static_cast<unsigned>(bx), static_cast<unsigned>(by), 1);
  return g;
}

}  // namespace relpos::cuda
