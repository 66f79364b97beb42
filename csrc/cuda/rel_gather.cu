// Launchers of rel_gather and rel_gather_backward (kernels: rel_gather.cuh).
#include <cstdint>

#include "cuda/launch_util.h"
#include "cuda/launchers.h"
#include "cuda/rel_gather.cuh"

namespace relpos::cuda {

namespace {

// The widest copy unit (16, 8, 4 or 2 bytes) that divides a table row and keeps both base
// pointers aligned.
int64_t gather_unit_bytes(const RelGatherParams& p) {
  const int64_t row_bytes = p.dim * dtype_size(p.dtype);
  const auto addr_bits = reinterpret_cast<uintptr_t>(p.table) | reinterpret_cast<uintptr_t>(p.out);
  for (int64_t u = 16; u > 2; u /= 2) {
    if (row_bytes % u == 0 && addr_bits % u == 0) return u;
  }
  return 2;
}

template <typename U>
void launch_gather_as(const RelGatherParams& p, Stream stream) {
  const int64_t units_per_row = p.dim * dtype_size(p.dtype) / static_cast<int64_t>(sizeof(U));
  const RowGrid g = row_grid(p.heads * p.q_len, p.k_len * units_per_row, "rel_gather");
  launch(rel_gather_kernel<U>, g.grid, g.block, 0, stream, p, units_per_row);
}

}  // namespace

void launch_rel_gather(const RelGatherParams& p, Stream stream) {
  if (p.heads * p.q_len * p.k_len * p.dim == 0) return;
  switch (gather_unit_bytes(p)) {
    case 16: launch_gather_as<Bits16>(p, stream); break;
    case 8: launch_gather_as<uint64_t>(p, stream); break;
    case 4: launch_gather_as<uint32_t>(p, stream); break;
    default: launch_gather_as<uint16_t>(p, stream); break;
  }
}

void launch_rel_gather_backward(const RelGatherBwdParams& p, Stream stream) {
  if (p.heads * p.dim == 0) return;
  // DW lanes over d (a power of two up to a warp, so small D does not idle lanes), the rest of
  // the 256 threads split the (i, j) pairs of the bucket.
  const int64_t dw = pow2_at_least(p.dim, 32);
  const int64_t by = kGatherBwdThreads / dw;
  const int64_t items = p.heads * num_buckets(p.max_distance) * cdiv(p.dim, dw);
  const int64_t blocks = items < kMaxGridX ? items : kMaxGridX;  // the kernel strides over items
  const dim3 grid(static_cast<unsigned>(blocks), 1, 1);
  const dim3 block(static_cast<unsigned>(dw), static_cast<unsigned>(by), 1);
  dispatch_dtype(p.dtype, [&]<typename T>() {
    launch(rel_gather_backward_kernel<T>, grid, block, 0, stream, p);
  });
}

}  // namespace relpos::cuda
