// The SIMT launchers of the fused Shaw attention for __half (rel_attention_simt.h).
#include "cuda/rel_attention_simt.cuh"

namespace relpos::cuda {
template void launch_rel_attention_simt<__half>(const RelAttentionParams&, Stream);
template void launch_rel_attention_backward_simt<__half>(const RelAttentionBwdParams&, void*, Stream);
}  // namespace relpos::cuda
