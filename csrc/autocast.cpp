// Automatic mixed precision: kernels for the AutocastCPU and AutocastCUDA dispatch keys.
//
// Under torch.autocast the projections of a model come out in the autocast dtype (bfloat16 or
// float16) while the relative-position tables stay float32 parameters, and the kernels require
// one dtype for all their floating inputs. The ops that take several floating tensors therefore
// follow torch's lower_precision_fp policy, as F.scaled_dot_product_attention and matmul do:
// their floating inputs are cast to the autocast dtype (torch.get_autocast_dtype of the device;
// float64 tensors and tensors on another device are left alone, as torch does), then the op runs
// with autocast off. The casts are ordinary differentiable ops, so the float32 tables receive
// float32 gradients; torch caches the casts of leaf parameters within one autocast region.
// The other ops (one floating input, or the backward ops, whose inputs are already the forward's
// casts and whose log-sum-exp must stay float32) keep the default fallthrough: no cast.
#include <ATen/autocast_mode.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

namespace {

using at::Tensor;

// The lower_precision_fp policy for the relpos op kName with C++ signature Ret(Args...):
// SymInt arguments stay c10::SymInt, so this also traces under torch.compile with dynamic shapes.
template <c10::DeviceType kDevice, const char* kName, class Sig>
struct LowerPrecision;

template <c10::DeviceType kDevice, const char* kName, class Ret, class... Args>
struct LowerPrecision<kDevice, kName, Ret(Args...)> {
  static Ret call(Args... args) {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(
        at::autocast::get_autocast_dispatch_key_from_device_type(kDevice));
    static const auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow(kName, "").template typed<Ret(Args...)>();
    const at::ScalarType to = at::autocast::get_lower_precision_fp_from_device_type(kDevice);
    return op.call(at::autocast::cached_cast(to, args, kDevice)...);
  }
};

constexpr char kRelLogits[] = "relpos::rel_logits";
using RelLogitsSig = Tensor(const Tensor& q, const Tensor& table, c10::SymInt max_distance,
                            c10::SymInt k_len, c10::SymInt q_offset, c10::SymInt k_offset);

constexpr char kRelAttention[] = "relpos::rel_attention";
using RelAttentionSig = std::tuple<Tensor, Tensor>(
    const Tensor& q, const Tensor& k, const Tensor& v, const std::optional<Tensor>& rel_k,
    const std::optional<Tensor>& rel_v, c10::SymInt max_distance, bool causal,
    std::optional<double> scale, c10::SymInt q_offset, c10::SymInt k_offset,
    const std::optional<Tensor>& key_padding_mask, double dropout_p,
    const std::optional<Tensor>& dropout_seed, const std::optional<Tensor>& attn_mask,
    const std::optional<Tensor>& q_segment_ids, const std::optional<Tensor>& k_segment_ids,
    int64_t window_left, int64_t window_right, const std::optional<Tensor>& rel_bias,
    const std::optional<Tensor>& rel_q);

template <c10::DeviceType kDevice>
void register_autocast(torch::Library& m) {
  m.impl("rel_logits", &LowerPrecision<kDevice, kRelLogits, RelLogitsSig>::call);
  m.impl("rel_attention", &LowerPrecision<kDevice, kRelAttention, RelAttentionSig>::call);
}

}  // namespace

TORCH_LIBRARY_IMPL(relpos, AutocastCPU, m) { register_autocast<c10::DeviceType::CPU>(m); }
TORCH_LIBRARY_IMPL(relpos, AutocastCUDA, m) { register_autocast<c10::DeviceType::CUDA>(m); }
