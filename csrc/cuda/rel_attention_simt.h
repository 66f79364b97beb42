// The SIMT launchers of the fused Shaw attention, one explicit instantiation per element type
// (rel_attention_simt_*.cu), so that nvcc compiles the four sets of kernels as separate, parallel
// translation units. rel_attention.cu picks T from the Params; the definitions are in
// rel_attention_simt.cuh.
#pragma once

#include "common/params.h"
#include "cuda/launchers.h"

namespace relpos::cuda {

// The forward's kernels for element type T (p.dtype), after the tensor-core launcher declined p.
template <typename T>
void launch_rel_attention_simt(const RelAttentionParams& p, Stream stream);

// The backward for element type T: the rows kernel fills `workspace`, then the tensor-core
// kernels take p where they cover it, else the SIMT dq and dk/dv kernels.
template <typename T>
void launch_rel_attention_backward_simt(const RelAttentionBwdParams& p, void* workspace,
                                        Stream stream);

}  // namespace relpos::cuda
