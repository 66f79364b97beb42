// Launcher of the tensor-core forward of the fused Shaw attention (rel_attention_tc.cuh): it
// takes the cases that kernel covers and leaves the rest to the SIMT kernel (rel_attention.cu).
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "cuda/launch_util.h"
#include "cuda/launchers.h"
#include "cuda/rel_attention_tc.cuh"

namespace relpos::cuda {
namespace {

bool aligned16(const void* ptr) {
  return ptr == nullptr || reinterpret_cast<uintptr_t>(ptr) % 16 == 0;
}

// RELPOS_CUDA_TC=0 keeps the SIMT kernel (read at every call: A/B timings, tests of both).
bool tc_enabled() {
  const char* e = std::getenv("RELPOS_CUDA_TC");
  return e == nullptr || std::strcmp(e, "0") != 0;
}

#if !defined(RELPOS_CUDA_EMU)
// mma.sync with bfloat16 operands needs compute capability 8.0.
bool tc_device() {
  int dev = 0, major = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
    return false;
  }
  return major >= 8;
}
#endif

template <typename T, int kD, bool kRelQ>
void launch_tc(const RelAttentionParams& p, Stream stream) {
  using Tl = TcTile<kD>;
  const int64_t blocks = p.batch * p.heads * cdiv(p.q_len, Tl::kRows);
  launch(rel_attention_tc_fwd_kernel<T, kD, kRelQ>, dim3(grid_x(blocks, "rel_attention"), 1, 1),
         dim3(Tl::kThreads, 1, 1), Tl::smem_bytes(kRelQ), stream, p);
}

}  // namespace

bool launch_rel_attention_tc(const RelAttentionParams& p, Stream stream) {
  const bool bf16 = p.dtype == DType::BFloat16;
  if (!bf16 && p.dtype != DType::Float16) return false;
  // Head dims that are multiples of 8 up to 128, zero-padded to 32, 64, 96 or 128.
  if (p.dim % 8 != 0 || p.dim < 8 || p.dim > 128) return false;
  const bool rel_q = p.rel_q != nullptr;
  if (rel_q && p.dim > 64) return false;  // shared memory: 196 KB at D = 128
  if (p.kv_stride % 8 != 0) return false;
  const void* tensors[] = {p.q, p.k, p.v, p.rel_k, p.rel_v, p.rel_q, p.out};
  for (const void* t : tensors) {
    if (!aligned16(t)) return false;
  }
  if (!tc_enabled()) return false;
#if !defined(RELPOS_CUDA_EMU)
  if (!tc_device()) return false;
#endif
  if (p.batch * p.heads * p.q_len == 0) return true;
  auto go = [&]<int kD, bool kRelQ>() {
    bf16 ? launch_tc<__nv_bfloat16, kD, kRelQ>(p, stream) : launch_tc<__half, kD, kRelQ>(p, stream);
  };
  if (p.dim <= 32) {
    rel_q ? go.template operator()<32, true>() : go.template operator()<32, false>();
  } else if (p.dim <= 64) {
    rel_q ? go.template operator()<64, true>() : go.template operator()<64, false>();
  } else if (p.dim <= 96) {
    go.template operator()<96, false>();
  } else {
    go.template operator()<128, false>();
  }
  return true;
}

}  // namespace relpos::cuda
