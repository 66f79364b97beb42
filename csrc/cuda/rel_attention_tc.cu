// Launchers of the tensor-core forward and backward of the fused Shaw attention
// (rel_attention_tc.cuh, rel_attention_tc_bwd.cuh): they take the cases those kernels cover and
// leave the rest to the SIMT kernels (rel_attention.cu).
#include <cstdint>

#include "common/env.h"
#include "cuda/launch_util.h"
#include "cuda/launchers.h"
#include "cuda/rel_attention_tc.cuh"
#include "cuda/rel_attention_tc_bwd.cuh"

namespace relpos::cuda {
namespace {

bool aligned16(const void* ptr) {
  return ptr == nullptr || reinterpret_cast<uintptr_t>(ptr) % 16 == 0;
}

// RELPOS_CUDA_TC=0 keeps the SIMT kernel (read at every call: A/B timings, tests of both).
bool tc_enabled() { return env_choice("RELPOS_CUDA_TC", {"0", "1"}) != "0"; }

// mma.sync with bfloat16 operands needs compute capability 8.0, and a kernel's shared memory
// must fit the device's per-block limit (opt-in; the emulator's is sm_80's 163 KB).
bool tc_device(size_t smem_bytes) {
#if defined(RELPOS_CUDA_EMU)
  return smem_bytes <= 163 * 1024;
#else
  int dev = 0, major = 0, smem_max = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&smem_max, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) !=
          cudaSuccess) {
    return false;
  }
  return major >= 8 && smem_bytes <= static_cast<size_t>(smem_max);
#endif
}

// What both directions need: bfloat16/float16, a head dim that is a multiple of 8 up to 128,
// packed rows of 16 bytes.
bool tc_shape(const RelAttentionParams& p) {
  if (p.dtype != DType::BFloat16 && p.dtype != DType::Float16) return false;
  if (p.dim % 8 != 0 || p.dim < 8 || p.dim > 128) return false;
  return p.kv_stride % 8 == 0;
}

// Calls f.template operator()<T, kD>() with the operand type and the padded head dim.
template <typename F>
void dispatch_tc(const RelAttentionParams& p, F&& f) {
  auto go = [&]<int kD>() {
    p.dtype == DType::BFloat16 ? f.template operator()<__nv_bfloat16, kD>()
                               : f.template operator()<__half, kD>();
  };
  if (p.dim <= 32) {
    go.template operator()<32>();
  } else if (p.dim <= 64) {
    go.template operator()<64>();
  } else if (p.dim <= 96) {
    go.template operator()<96>();
  } else {
    go.template operator()<128>();
  }
}

template <typename T, int kD, bool kRelQ>
void launch_tc(const RelAttentionParams& p, Stream stream) {
  using Tl = TcTile<kD>;
  const int64_t blocks = p.batch * p.heads * cdiv(p.q_len, Tl::kRows);
  launch(rel_attention_tc_fwd_kernel<T, kD, kRelQ>, dim3(grid_x(blocks, "rel_attention"), 1, 1),
         dim3(Tl::kThreads, 1, 1), Tl::smem_bytes(kRelQ), stream, p);
}

}  // namespace

bool launch_rel_attention_tc(const RelAttentionParams& p, Stream stream) {
  if (!tc_enabled() || !tc_shape(p)) return false;
  const bool rel_q = p.rel_q != nullptr;
  if (rel_q && p.dim > 64) return false;  // shared memory: 196 KB at D = 128
  const void* tensors[] = {p.q, p.k, p.v, p.rel_k, p.rel_v, p.rel_q, p.out};
  for (const void* t : tensors) {
    if (!aligned16(t)) return false;
  }
  size_t smem = 0;
  dispatch_tc(p, [&]<typename T, int kD>() { smem = TcTile<kD>::smem_bytes(rel_q); });
  if (!tc_device(smem)) return false;
  if (p.batch * p.heads * p.q_len == 0) return true;
  dispatch_tc(p, [&]<typename T, int kD>() {
    if constexpr (kD <= 64) {
      rel_q ? launch_tc<T, kD, true>(p, stream) : launch_tc<T, kD, false>(p, stream);
    } else {
      launch_tc<T, kD, false>(p, stream);
    }
  });
  return true;
}

bool launch_rel_attention_backward_tc(const RelAttentionBwdParams& bp, const void* workspace,
                                      Stream stream) {
  const RelAttentionParams& p = bp.fwd;
  const bool rel_q = p.rel_q != nullptr;
  if (!tc_enabled() || !tc_shape(p) || (rel_q && p.dim > 64)) return false;  // as the forward
  const void* tensors[] = {p.q,     p.k,         p.v,   p.rel_k, p.rel_v, p.rel_q,
                           p.out,   bp.grad_out, bp.dq, bp.dk,   bp.dv};
  for (const void* t : tensors) {
    if (!aligned16(t)) return false;
  }
  size_t smem = 0;
  dispatch_tc(p, [&]<typename T, int kD>() {
    const size_t a = TcBwdTile<kD>::dq_smem(rel_q), b = TcBwdKvTile<kD>::smem(rel_q);
    smem = a > b ? a : b;
  });
  if (!tc_device(smem)) return false;
  const float* ws = static_cast<const float*>(workspace);
  dispatch_tc(p, [&]<typename T, int kD>() {
    using Tl = TcBwdTile<kD>;    // the dq kernel's tiles
    using Kv = TcBwdKvTile<kD>;  // the dk/dv kernel's
    // Deterministic mode (serial_q_tiles): the dq kernel once per query tile, in order, one
    // block per (b, h) each time; with rel_q (drel_q from every key tile) the dk/dv kernel too.
    const bool serial = bp.serial_q_tiles, kv_serial = serial && rel_q;
    const int64_t q_tiles = cdiv(p.q_len, Tl::kRows), k_tiles = cdiv(p.k_len, Kv::kKeys);
    auto go = [&]<bool kRelQ>() {
      for (int64_t t = serial ? 0 : -1; t < (serial ? q_tiles : 0); ++t) {
        launch(rel_attention_tc_bwd_dq_kernel<T, kD, kRelQ>,
               dim3(grid_x(p.batch * p.heads * (t < 0 ? q_tiles : 1), "rel_attention_backward"),
                    1, 1),
               dim3(Tl::kThreads, 1, 1), Tl::dq_smem(kRelQ), stream, bp, ws, t);
      }
      for (int64_t t = kv_serial ? 0 : -1; t < (kv_serial ? k_tiles : 0); ++t) {
        launch(rel_attention_tc_bwd_dkdv_kernel<T, kD, kRelQ>,
               dim3(grid_x(p.batch * p.kv_heads * (t < 0 ? k_tiles : 1), "rel_attention_backward"),
                    1, 1),
               dim3(Kv::kThreads, 1, 1), Kv::smem(kRelQ), stream, bp, ws, t);
      }
    };
    if constexpr (kD <= 64) {
      rel_q ? go.template operator()<true>() : go.template operator()<false>();
    } else {
      go.template operator()<false>();
    }
  });
  return true;
}

}  // namespace relpos::cuda
