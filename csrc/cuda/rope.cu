// Launcher of rope (kernel: rope.cuh): one row-wise grid over the rows of x, dispatched on the
// dtype.
#include <cstdint>

#include "cuda/launch_util.h"
#include "cuda/launchers.h"
#include "cuda/rope.cuh"

namespace relpos::cuda {

void launch_rope(const RopeParams& p, Stream stream) {
  const int64_t rows = p.n0 * p.n1 * p.n2;
  const int64_t units = p.rot / 2 + (p.dim - p.rot);
  if (rows == 0 || units == 0) return;
  const RowGrid g = row_grid(rows, units, "rope");
  dispatch_dtype(p.dtype, [&]<typename T>() { launch(rope_kernel<T>, g.grid, g.block, 0, stream, p); });
}

}  // namespace relpos::cuda
