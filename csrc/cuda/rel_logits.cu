// Launchers of rel_logits and bucket_sum, the first stage of rel_logits_backward (kernels:
// rel_logits.cuh).
#include <cstdint>

#include "cuda/launch_util.h"
#include "cuda/launchers.h"
#include "cuda/rel_logits.cuh"

namespace relpos::cuda {

void launch_rel_logits(const RelLogitsParams& p, Stream stream) {
  if (p.batch * p.heads * p.q_len * p.k_len * p.dim == 0) return;
  const int64_t tiles = p.batch * p.heads * cdiv(p.q_len, RelLogitsTile::kTI) *
                        cdiv(p.k_len, RelLogitsTile::kTJ);
  const dim3 grid(grid_x(tiles, "rel_logits"), 1, 1);
  const dim3 block(RelLogitsTile::kThreads, 1, 1);
  dispatch_dtype(p.dtype, [&]<typename T>() {
    launch(rel_logits_kernel<T>, grid, block, 0, stream, p);
  });
}

void launch_bucket_sum(const BucketSumParams& p, Stream stream) {
  const int64_t rows = p.batch * p.heads * p.q_len;
  if (rows == 0 || p.num_cols <= 0) return;
  const dim3 grid(grid_x(cdiv(rows, kBucketSumWarps), "bucket_sum"), 1, 1);
  const dim3 block(32 * kBucketSumWarps, 1, 1);
  dispatch_dtype(p.dtype, [&]<typename T>() {
    launch(bucket_sum_kernel<T>, grid, block, 0, stream, p);
  });
}

}  // namespace relpos::cuda
