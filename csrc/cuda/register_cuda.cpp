// CUDA backend of the relpos ops: the shared op bodies (common/ops_impl.h) with the launchers of
// csrc/cuda/*.cu as kernels. Host C++ only. With RELPOS_CUDA_EMU the same file is built into the
// test-only emulator library: CPU tensors, ops registered as relpos_emu::* (glue_config.h), no
// stream and no device guard; everything else is identical.
#include <ATen/Context.h>
#include <torch/library.h>

#include <stdexcept>

#include "common/attention_impl.h"
#include "common/ops_impl.h"
#include "cuda/glue_config.h"
#include "cuda/launchers.h"

#if !defined(RELPOS_CUDA_EMU)
// c10's stream and guard rather than <ATen/cuda/CUDAContext.h>, which also pulls in cuBLAS and
// cuSPARSE headers that a minimal CUDA toolkit does not ship (the case on the build machines).
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace relpos::cuda {
namespace {

Stream current_stream() {
#if defined(RELPOS_CUDA_EMU)
  return nullptr;
#else
  return c10::cuda::getCurrentCUDAStream().stream();
#endif
}

// Runs a launcher on the current stream; launch failures become torch errors.
template <typename Params>
void run(void (*launcher)(const Params&, Stream), const Params& p) {
  try {
    launcher(p, current_stream());
  } catch (const std::runtime_error& e) {
    TORCH_CHECK(false, e.what());
  }
}

struct CudaBackend {
  static bool device_ok(const at::Tensor& t) { return RELPOS_CUDA_DEVICE_OK(t); }
  static const char* device_name() { return RELPOS_CUDA_DEVICE_NAME; }

  static void rel_gather(const RelGatherParams& p) { run(launch_rel_gather, p); }
  static void rel_gather_backward(const RelGatherBwdParams& p) {
    run(launch_rel_gather_backward, p);
  }
  static void skew(const SkewParams& p) { run(launch_skew, p); }
  static void skew_backward(const SkewParams& p) { run(launch_skew_backward, p); }
  static void rel_logits(const RelLogitsParams& p) { run(launch_rel_logits, p); }
  static void bucket_sum(const BucketSumParams& p) { run(launch_bucket_sum, p); }
  static void rope(const RopeParams& p) { run(launch_rope, p); }
  static void rel_attention(const RelAttentionParams& p) {
    run(launch_rel_attention, p);
  }
  static void rel_attention_backward(const RelAttentionBwdParams& params) {
    // The dq kernel adds the table gradients of its query tile to the per-(b, h) partials with
    // float atomics, in whatever order the tiles run (and the dk/dv kernel drel_q, from its key
    // tiles): not bitwise reproducible. Under torch.use_deterministic_algorithms they run one
    // block per (b, h) over its query tiles (per (b, kv head) over its key tiles) in order
    // instead (serial_q_tiles): the same sums in a fixed order, with far fewer blocks.
    RelAttentionBwdParams p = params;
    p.serial_q_tiles = (p.drel_k_partial != nullptr || p.drel_v_partial != nullptr ||
                        p.drel_bias_partial != nullptr || p.drel_q_partial != nullptr) &&
                       at::globalContext().deterministicAlgorithms();
    // Scratch of the backward (per-row terms), on the op's device; the caching allocator makes
    // this cheap and keeps it ordered on the current stream.
    const size_t bytes = rel_attention_backward_workspace_bytes(p);
#if defined(RELPOS_CUDA_EMU)
    const at::Device device(at::kCPU);
#else
    const at::Device device(at::kCUDA, c10::cuda::current_device());
#endif
    const at::Tensor ws =
        at::empty({static_cast<int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte).device(device));
    try {
      launch_rel_attention_backward(p, ws.data_ptr(), current_stream());
    } catch (const std::runtime_error& e) {
      TORCH_CHECK(false, e.what());
    }
  }
};

using Impl = OpsImpl<CudaBackend>;
using Attention = AttentionImpl<CudaBackend>;

// Every op's first argument is a tensor: make its device current (so allocations, the current
// stream and the launches all go to it) for the duration of the op.
template <auto Fn>
struct OnDeviceOf;

template <typename R, typename... Args, R (*Fn)(const at::Tensor&, Args...)>
struct OnDeviceOf<Fn> {
  static R call(const at::Tensor& first, Args... args) {
#if !defined(RELPOS_CUDA_EMU)
    const c10::cuda::OptionalCUDAGuard guard(first.device().is_cuda()
                                                 ? std::optional<c10::Device>(first.device())
                                                 : std::nullopt);
#endif
    return Fn(first, args...);
  }
};

}  // namespace
}  // namespace relpos::cuda

TORCH_LIBRARY_IMPL(RELPOS_CUDA_NAMESPACE, RELPOS_CUDA_DISPATCH_KEY, m) {
  using relpos::cuda::Impl;
  using relpos::cuda::OnDeviceOf;
  m.impl("rel_gather", &OnDeviceOf<&Impl::rel_gather>::call);
  m.impl("rel_gather_backward", &OnDeviceOf<&Impl::rel_gather_backward>::call);
  m.impl("skew", &OnDeviceOf<&Impl::skew>::call);
  m.impl("skew_backward", &OnDeviceOf<&Impl::skew_backward>::call);
  m.impl("rel_logits", &OnDeviceOf<&Impl::rel_logits>::call);
  m.impl("rel_logits_backward", &OnDeviceOf<&Impl::rel_logits_backward>::call);
  m.impl("rope", &OnDeviceOf<&Impl::rope>::call);
  using relpos::cuda::Attention;
  m.impl("rel_attention", &OnDeviceOf<&Attention::rel_attention>::call);
  m.impl("rel_attention_backward", &OnDeviceOf<&Attention::rel_attention_backward>::call);
}
