// Launchers of the fused Shaw attention: the tensor-core kernels (rel_attention_tc.cu) where they
// cover the call, else the SIMT ones (rel_attention_simt.h), whose four element types are compiled
// in rel_attention_simt_*.cu, one translation unit each.
#include <cstddef>
#include <cstdint>

#include "cuda/launch_util.h"
#include "cuda/launchers.h"
#include "cuda/rel_attention.cuh"  // kRowTerms; its kernels are instantiated elsewhere
#include "cuda/rel_attention_simt.h"

namespace relpos::cuda {
namespace {

// Bytes of one accumulator (acc_t) of the backward's workspace.
int64_t acc_size(DType d) { return d == DType::Float64 ? 8 : 4; }

}  // namespace

void launch_rel_attention(const RelAttentionParams& p, Stream stream) {
  if (p.batch * p.heads * p.q_len == 0) return;
  if (launch_rel_attention_tc(p, stream)) return;
  dispatch_dtype(p.dtype, [&]<typename T>() { launch_rel_attention_simt<T>(p, stream); });
}

size_t rel_attention_backward_workspace_bytes(const RelAttentionBwdParams& p) {
  const RelAttentionParams& f = p.fwd;
  return static_cast<size_t>(f.batch * f.heads * f.q_len * kRowTerms * acc_size(f.dtype));
}

void launch_rel_attention_backward(const RelAttentionBwdParams& p, void* workspace,
                                   Stream stream) {
  const RelAttentionParams& f = p.fwd;
  if (f.batch * f.heads * f.q_len * f.k_len * f.dim == 0) return;
  dispatch_dtype(f.dtype,
                 [&]<typename T>() { launch_rel_attention_backward_simt<T>(p, workspace, stream); });
}

}  // namespace relpos::cuda
