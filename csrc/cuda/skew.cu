// Launchers of skew and skew_backward (kernels: skew.cuh). Pure data movement: dispatched on
// the element size only.
#include <cstdint>

#include "cuda/launch_util.h"
#include "cuda/launchers.h"
#include "cuda/skew.cuh"

namespace relpos::cuda {

namespace {

template <bool kBackward>
void launch_skew_impl(const SkewParams& p, Stream stream) {
  const int64_t width = p.causal ? p.k_len : skew_width(p.q_len, p.k_len);
  const int64_t out_cols = kBackward ? width : p.k_len;
  if (p.batch * p.q_len * p.k_len == 0 || out_cols <= 0) return;
  const RowGrid g = row_grid(p.batch * p.q_len, out_cols, kBackward ? "skew_backward" : "skew");
  switch (dtype_size(p.dtype)) {
    case 8: launch(skew_kernel<uint64_t, kBackward>, g.grid, g.block, 0, stream, p); break;
    case 4: launch(skew_kernel<uint32_t, kBackward>, g.grid, g.block, 0, stream, p); break;
    default: launch(skew_kernel<uint16_t, kBackward>, g.grid, g.block, 0, stream, p); break;
  }
}

}  // namespace

void launch_skew(const SkewParams& p, Stream stream) { launch_skew_impl<false>(p, stream); }
void launch_skew_backward(const SkewParams& p, Stream stream) { launch_skew_impl<true>(p, stream); }

}  // namespace relpos::cuda
