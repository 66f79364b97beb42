// Definitions of the SIMT launchers declared in rel_attention_simt.h (kernels and tiling:
// rel_attention.cuh). The head dim picks the instantiation (kDC = ceil(D / 32) rounded up to 1, 2,
// 4 or 8: D <= 256). Included only by rel_attention_simt_*.cu, one per element type.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "cuda/launch_util.h"
#include "cuda/launchers.h"
#include "cuda/rel_attention.cuh"
#include "cuda/rel_attention_simt.h"

namespace relpos::cuda {

inline constexpr int64_t kMaxHeadDim = 256;

// Calls f.template operator()<kDC>() with the smallest instantiated kDC >= ceil(dim / 32).
template <typename F>
void dispatch_head_dim(int64_t dim, F&& f) {
  if (dim <= 32) {
    f.template operator()<1>();
  } else if (dim <= 64) {
    f.template operator()<2>();
  } else if (dim <= 128) {
    f.template operator()<4>();
  } else if (dim <= kMaxHeadDim) {
    f.template operator()<8>();
  } else {
    throw std::runtime_error("relpos CUDA rel_attention: head dim D must be <= " +
                             std::to_string(kMaxHeadDim) + "; got " + std::to_string(dim));
  }
}

template <typename T>
void launch_rel_attention_simt(const RelAttentionParams& p, Stream stream) {
  dispatch_head_dim(p.dim, [&]<int kDC>() {
    using Tl = AttnTile<acc_t<T>, kDC>;
    const int64_t blocks = p.batch * p.heads * cdiv(p.q_len, Tl::kOwn);
    const bool rel_q = p.rel_q != nullptr;  // the kernel's kRelQ
    launch(rel_q ? rel_attention_fwd_kernel<T, kDC, true> : rel_attention_fwd_kernel<T, kDC, false>,
           dim3(grid_x(blocks, "rel_attention"), 1, 1), dim3(Tl::kThreads, 1, 1),
           Tl::fwd_smem(p.rel_bias != nullptr, rel_q) * sizeof(acc_t<T>), stream, p);
  });
}

template <typename T>
void launch_rel_attention_backward_simt(const RelAttentionBwdParams& p, void* workspace,
                                        Stream stream) {
  const RelAttentionParams& f = p.fwd;
  using A = acc_t<T>;
  A* ws = static_cast<A*>(workspace);
  const int64_t rows = f.batch * f.heads * f.q_len;
  launch(rel_attention_bwd_rows_kernel<T>,
         dim3(grid_x(cdiv(rows, kRowsWarps), "rel_attention_backward"), 1, 1),
         dim3(32 * kRowsWarps, 1, 1), 0, stream, p, ws);
  if (launch_rel_attention_backward_tc(p, ws, stream)) return;
  dispatch_head_dim(f.dim, [&]<int kDC>() {
    using Tl = AttnTile<A, kDC>;
    const int64_t q_blocks = f.batch * f.heads * (p.serial_q_tiles ? 1 : cdiv(f.q_len, Tl::kOwn));
    // The kernels' kBias and kRelQ; the rel_q kernels are the bias ones too (kBias, the bias
    // checked at run time), which saves instantiations (and nvcc time) at a few registers.
    const bool bias = f.rel_bias != nullptr, rel_q = f.rel_q != nullptr;
    const bool serial = p.serial_q_tiles;
    auto dq = rel_q    ? (serial ? rel_attention_bwd_dq_kernel<T, kDC, true, true, true>
                                 : rel_attention_bwd_dq_kernel<T, kDC, false, true, true>)
              : bias   ? (serial ? rel_attention_bwd_dq_kernel<T, kDC, true, true, false>
                                 : rel_attention_bwd_dq_kernel<T, kDC, false, true, false>)
                       : (serial ? rel_attention_bwd_dq_kernel<T, kDC, true, false, false>
                                 : rel_attention_bwd_dq_kernel<T, kDC, false, false, false>);
    launch(dq, dim3(grid_x(q_blocks, "rel_attention_backward"), 1, 1), dim3(Tl::kThreads, 1, 1),
           Tl::dq_smem(bias, rel_q) * sizeof(A), stream, p, static_cast<const A*>(ws));
    // Only the rel_q kernels add to a table gradient from several key tiles: their serial form
    // takes one block per (b, kv head) over its key tiles in order (deterministic mode).
    const bool dkdv_serial = serial && rel_q;
    const int64_t k_blocks = f.batch * f.kv_heads * (dkdv_serial ? 1 : cdiv(f.k_len, Tl::kOwn));
    auto dkdv = rel_q  ? (dkdv_serial ? rel_attention_bwd_dkdv_kernel<T, kDC, true, true, true>
                                      : rel_attention_bwd_dkdv_kernel<T, kDC, false, true, true>)
                : bias ? rel_attention_bwd_dkdv_kernel<T, kDC, false, true, false>
                       : rel_attention_bwd_dkdv_kernel<T, kDC, false, false, false>;
    launch(dkdv, dim3(grid_x(k_blocks, "rel_attention_backward"), 1, 1), dim3(Tl::kThreads, 1, 1),
           Tl::dkdv_smem(bias, rel_q) * sizeof(A), stream, p, static_cast<const A*>(ws));
  });
}

}  // namespace relpos::cuda
