// Host entry points of the CUDA kernels: one per op kernel, implemented in csrc/cuda/*.cu without
// torch headers and called by the torch glue (register_cuda.cpp) with the current stream. Each
// picks the grid and the element type from the Params and launches through relpos::cuda::launch,
// so under RELPOS_CUDA_EMU the emulator runs this very code. Errors: std::runtime_error.
#pragma once

#include <cstddef>

#include "common/params.h"

#if !defined(RELPOS_CUDA_EMU)
struct CUstream_st;  // cudaStream_t is CUstream_st*; no CUDA header needed to name it
#endif

namespace relpos::cuda {

#if defined(RELPOS_CUDA_EMU)
using Stream = void*;
#else
using Stream = ::CUstream_st*;
#endif

void launch_rel_gather(const RelGatherParams& p, Stream stream);
void launch_rel_gather_backward(const RelGatherBwdParams& p, Stream stream);
void launch_skew(const SkewParams& p, Stream stream);
void launch_skew_backward(const SkewParams& p, Stream stream);
void launch_rel_logits(const RelLogitsParams& p, Stream stream);
void launch_bucket_sum(const BucketSumParams& p, Stream stream);
void launch_rope(const RopeParams& p, Stream stream);
void launch_rel_attention(const RelAttentionParams& p, Stream stream);
// The tensor-core forward (rel_attention_tc.cu): launches and returns true when it covers p
// (bfloat16/float16, head dim a multiple of 8 up to 128, up to 64 with rel_q, 16-byte aligned
// tensors, compute capability >= 8.0, its shared memory within the device's limit, RELPOS_CUDA_TC
// not 0); false, launching nothing, otherwise.
bool launch_rel_attention_tc(const RelAttentionParams& p, Stream stream);
// The backward needs rel_attention_backward_workspace_bytes(p) bytes of device scratch (per query
// row: D_i = dO_i . O_i and the clamped-bucket dots), allocated by the glue, uninitialised.
size_t rel_attention_backward_workspace_bytes(const RelAttentionBwdParams& p);
void launch_rel_attention_backward(const RelAttentionBwdParams& p, void* workspace, Stream stream);
// The tensor-core backward (rel_attention_tc.cu), after the rows kernel has filled the
// workspace: launches and returns true when it covers p (the tensor-core forward's cases);
// false, launching nothing, otherwise.
bool launch_rel_attention_backward_tc(const RelAttentionBwdParams& p, const void* workspace,
                                      Stream stream);

}  // namespace relpos::cuda
