// The torch-facing body of every op, written once and shared by the backends: argument checks,
// output allocation, packing a Params struct, and (for rel_logits_backward) the matmuls that
// finish the gradient. `Backend` supplies the kernels and the device rule:
//   static bool device_ok(const at::Tensor&);  static const char* device_name();
//   static void rel_gather(const RelGatherParams&);  static void rel_gather_backward(...);
//   static void skew(const SkewParams&);  static void skew_backward(const SkewParams&);
//   static void rel_logits(const RelLogitsParams&);  static void bucket_sum(const BucketSumParams&);
// csrc/cpu/register_cpu.cpp and csrc/cuda/register_cuda.cpp instantiate it.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "common/params.h"
#include "common/relpos_index.h"

namespace relpos {

inline DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::Float32;
    case at::kDouble: return DType::Float64;
    case at::kHalf: return DType::Float16;
    case at::kBFloat16: return DType::BFloat16;
    default: TORCH_CHECK(false, "unsupported dtype ", t.scalar_type());
  }
}

inline void check_float_dtype(const at::Tensor& t, const char* name) {
  const auto s = t.scalar_type();
  TORCH_CHECK(s == at::kFloat || s == at::kDouble || s == at::kHalf || s == at::kBFloat16, name,
              " must be float32, float64, float16 or bfloat16; got ", s);
}

// Offsets and clipping distances are at most 2^60 in magnitude, so that the index math of
// relpos_index.h (two offsets, K and an index, each below 2^60 or a tensor size, added) stays
// inside int64: beyond, key spans would wrap around and index out of bounds.
constexpr int64_t kMaxPosition = int64_t(1) << 60;

inline void check_max_distance(int64_t max_distance) {
  TORCH_CHECK(max_distance >= 0, "max_distance must be >= 0; got ", max_distance);
  TORCH_CHECK(max_distance <= kMaxPosition, "max_distance must be at most 2^60; got ",
              max_distance);
}

inline void check_offsets(int64_t q_offset, int64_t k_offset) {
  TORCH_CHECK(q_offset >= -kMaxPosition && q_offset <= kMaxPosition && k_offset >= -kMaxPosition &&
                  k_offset <= kMaxPosition,
              "q_offset and k_offset must be within [-2^60, 2^60]; got q_offset=", q_offset,
              ", k_offset=", k_offset);
}

inline void check_table_rows(const at::Tensor& table, int64_t max_distance, const char* name) {
  TORCH_CHECK(table.dim() == 2 || table.dim() == 3, name,
              " must be [2K+1, D] (shared) or [H, 2K+1, D] (per head); got ", table.dim(),
              " dims with shape ", table.sizes());
  TORCH_CHECK(table.size(-2) == num_buckets(max_distance), name, " must have 2*max_distance+1 = ",
              num_buckets(max_distance), " rows (max_distance=", max_distance, "); got shape ",
              table.sizes());
}

template <class Backend>
void check_device(const at::Tensor& t, const char* name) {
  TORCH_CHECK(Backend::device_ok(t), name, " must be on ", Backend::device_name(), "; got ",
              t.device());
}

template <class Backend>
struct OpsImpl {
  static at::Tensor rel_gather(const at::Tensor& table, int64_t q_len, int64_t k_len,
                               int64_t max_distance, int64_t q_offset, int64_t k_offset) {
    check_device<Backend>(table, "table");
    check_float_dtype(table, "table");
    check_max_distance(max_distance);
    check_offsets(q_offset, k_offset);
    check_table_rows(table, max_distance, "table");
    TORCH_CHECK(q_len >= 0 && k_len >= 0, "q_len and k_len must be >= 0; got q_len=", q_len,
                ", k_len=", k_len);
    const at::Tensor t = table.contiguous();
    const bool per_head = t.dim() == 3;
    const int64_t heads = per_head ? t.size(0) : 1;
    const int64_t dim = t.size(-1);
    at::Tensor out = per_head ? at::empty({heads, q_len, k_len, dim}, t.options())
                              : at::empty({q_len, k_len, dim}, t.options());
    if (out.numel() == 0) return out;
    Backend::rel_gather(RelGatherParams{t.data_ptr(), out.data_ptr(), heads, q_len, k_len, dim,
                                        max_distance, q_offset, k_offset, dtype_of(t)});
    return out;
  }

  static at::Tensor rel_gather_backward(const at::Tensor& grad, int64_t max_distance,
                                        int64_t q_offset, int64_t k_offset) {
    check_device<Backend>(grad, "grad");
    check_float_dtype(grad, "grad");
    check_max_distance(max_distance);
    check_offsets(q_offset, k_offset);
    TORCH_CHECK(grad.dim() == 3 || grad.dim() == 4,
                "grad must be [Lq, Lk, D] or [H, Lq, Lk, D]; got shape ", grad.sizes());
    const at::Tensor g = grad.contiguous();
    const bool per_head = g.dim() == 4;
    const int64_t heads = per_head ? g.size(0) : 1;
    const int64_t q_len = g.size(-3), k_len = g.size(-2), dim = g.size(-1);
    const int64_t rows = num_buckets(max_distance);
    at::Tensor dtable = per_head ? at::zeros({heads, rows, dim}, g.options())
                                 : at::zeros({rows, dim}, g.options());
    if (g.numel() == 0) return dtable;
    Backend::rel_gather_backward(RelGatherBwdParams{g.data_ptr(), dtable.data_ptr(), heads, q_len,
                                                    k_len, dim, max_distance, q_offset, k_offset,
                                                    dtype_of(g)});
    return dtable;
  }

  static at::Tensor skew(const at::Tensor& x, bool causal) {
    check_device<Backend>(x, "x");
    check_float_dtype(x, "x");
    TORCH_CHECK(x.dim() >= 2, "x must have at least 2 dims [..., Lq, Lq+Lk-1]; got shape ",
                x.sizes());
    const int64_t q_len = x.size(-2), width = x.size(-1);
    int64_t k_len;
    if (causal) {
      TORCH_CHECK(width == q_len, "causal skew needs a square x [..., L, L]; got shape ", x.sizes());
      k_len = q_len;
    } else {
      k_len = width - q_len + 1;
      TORCH_CHECK(k_len >= 0, "x must be [..., Lq, Lq+Lk-1] with Lk >= 0; got shape ", x.sizes());
    }
    const at::Tensor xc = x.contiguous();
    auto sizes = xc.sizes().vec();
    sizes.back() = k_len;
    at::Tensor out = at::empty(sizes, xc.options());
    if (out.numel() == 0) return out;
    const int64_t batch = out.numel() / (q_len * k_len);
    Backend::skew(SkewParams{xc.data_ptr(), out.data_ptr(), batch, q_len, k_len, causal,
                             dtype_of(xc)});
    return out;
  }

  static at::Tensor skew_backward(const at::Tensor& grad, bool causal) {
    check_device<Backend>(grad, "grad");
    check_float_dtype(grad, "grad");
    TORCH_CHECK(grad.dim() >= 2, "grad must have at least 2 dims [..., Lq, Lk]; got shape ",
                grad.sizes());
    const int64_t q_len = grad.size(-2), k_len = grad.size(-1);
    TORCH_CHECK(!causal || q_len == k_len, "causal skew_backward needs a square grad; got shape ",
                grad.sizes());
    const at::Tensor g = grad.contiguous();
    auto sizes = g.sizes().vec();
    const int64_t width = causal ? k_len : std::max<int64_t>(skew_width(q_len, k_len), 0);
    sizes.back() = width;
    at::Tensor dx = at::empty(sizes, g.options());  // the kernels write the zeros too
    if (g.numel() == 0) return dx.zero_();
    const int64_t batch = g.numel() / (q_len * k_len);
    Backend::skew_backward(SkewParams{g.data_ptr(), dx.data_ptr(), batch, q_len, k_len, causal,
                                      dtype_of(g)});
    return dx;
  }

  static void check_q_table(const at::Tensor& q, const at::Tensor& table, int64_t max_distance) {
    check_device<Backend>(q, "q");
    check_device<Backend>(table, "table");
    check_float_dtype(q, "q");
    TORCH_CHECK(table.scalar_type() == q.scalar_type(), "table dtype must match q dtype (",
                q.scalar_type(), "); got ", table.scalar_type());
    TORCH_CHECK(table.device() == q.device(), "table must be on the device of q (", q.device(),
                "); got ", table.device());
    TORCH_CHECK(q.dim() == 4, "q must be [B, H, Lq, D]; got shape ", q.sizes());
    check_max_distance(max_distance);
    check_table_rows(table, max_distance, "table");
    TORCH_CHECK(table.size(-1) == q.size(3), "table's last dim must equal q's head dim D=",
                q.size(3), "; got table shape ", table.sizes());
    TORCH_CHECK(table.dim() == 2 || table.size(0) == q.size(1),
                "a per-head table [H, 2K+1, D] must have H equal to q.size(1)=", q.size(1),
                "; got table shape ", table.sizes());
  }

  static at::Tensor rel_logits(const at::Tensor& q, const at::Tensor& table, int64_t max_distance,
                               int64_t k_len, int64_t q_offset, int64_t k_offset) {
    check_q_table(q, table, max_distance);
    check_offsets(q_offset, k_offset);
    TORCH_CHECK(k_len >= 0, "k_len must be >= 0; got ", k_len);
    const at::Tensor qc = q.contiguous(), tc = table.contiguous();
    const int64_t batch = qc.size(0), heads = qc.size(1), q_len = qc.size(2), dim = qc.size(3);
    at::Tensor out = at::empty({batch, heads, q_len, k_len}, qc.options());
    if (out.numel() == 0) return out;
    if (dim == 0) return out.zero_();
    Backend::rel_logits(RelLogitsParams{qc.data_ptr(), tc.data_ptr(), out.data_ptr(), batch, heads,
                                        q_len, k_len, dim, max_distance, q_offset, k_offset,
                                        tc.dim() == 3, dtype_of(qc)});
    return out;
  }

  // dq[i] = sum_j g[i, j] table[b(i, j)] and dtable[b] = sum_{i, j: b(i, j) = b} g[i, j] q[i], both
  // through wsum (the per-row bucket mass of g, see BucketSumParams), never [Lq, Lk, D]. wsum is
  // [Lq, C] per (b, h), C up to Lq + Lk - 1 buckets when unclipped, so it is built for a group of
  // heads of one batch entry at a time, at most about kWsumChunkBytes; a head beyond that goes by
  // blocks of rows, each with the band of buckets its rows reach (nr + Lk - 1 when unclipped).
  static constexpr int64_t kWsumChunkBytes = int64_t(32) << 20;

  static std::tuple<at::Tensor, at::Tensor> rel_logits_backward(
      const at::Tensor& grad, const at::Tensor& q, const at::Tensor& table, int64_t max_distance,
      int64_t q_offset, int64_t k_offset) {
    check_q_table(q, table, max_distance);
    check_offsets(q_offset, k_offset);
    check_device<Backend>(grad, "grad");
    TORCH_CHECK(grad.scalar_type() == q.scalar_type(), "grad dtype must match q dtype (",
                q.scalar_type(), "); got ", grad.scalar_type());
    TORCH_CHECK(grad.dim() == 4 && grad.size(0) == q.size(0) && grad.size(1) == q.size(1) &&
                    grad.size(2) == q.size(2),
                "grad must be [B, H, Lq, Lk] matching q ", q.sizes(), "; got ", grad.sizes());
    const int64_t batch = q.size(0), heads = q.size(1), q_len = q.size(2), k_len = grad.size(3);
    if (grad.numel() == 0 || q.size(3) == 0) {
      return {at::zeros_like(q, at::MemoryFormat::Contiguous),
              at::zeros_like(table, at::MemoryFormat::Contiguous)};
    }
    // The matmuls below are part of this kernel, not of the autograd graph, and run in the
    // accumulation type whatever autocast region the backward runs in.
    const at::NoGradGuard no_grad;
    const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const at::Tensor g = grad.contiguous();
    const int64_t bucket0 = first_bucket(q_len, max_distance, q_offset, k_offset);
    const int64_t num_cols = last_bucket(k_len, max_distance, q_offset, k_offset) - bucket0 + 1;
    const auto acc_type = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    const bool per_head = table.dim() == 3;
    const at::Tensor rows = table.narrow(-2, bucket0, num_cols).to(acc_type);  // [(H,) C, D]
    const at::Tensor qa = q.to(acc_type);
    at::Tensor dq = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
    // [H, C, D] per head, summed over the batch (and over the heads below for a shared table)
    at::Tensor dtab = at::zeros({heads, num_cols, q.size(3)}, q.options().dtype(acc_type));
    const int64_t row_bytes = num_cols * static_cast<int64_t>(acc_type == at::kDouble ? 8 : 4);
    const int64_t group =
        std::max<int64_t>(1, std::min<int64_t>(heads, kWsumChunkBytes / (q_len * row_bytes)));
    const int64_t block_rows =
        group > 1 ? q_len : std::clamp<int64_t>(kWsumChunkBytes / row_bytes, 1, q_len);
    at::Tensor wsum = at::empty({group * block_rows * num_cols}, g.options().dtype(acc_type));
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t h0 = 0; h0 < heads; h0 += group) {
        const int64_t nh = std::min(group, heads - h0);
        for (int64_t r0 = 0; r0 < q_len; r0 += block_rows) {
          // rows r0 .. r0 + nr - 1 reach the buckets bucket0 + c0 .. bucket0 + c0 + nc - 1
          const int64_t nr = std::min(block_rows, q_len - r0);
          const int64_t c0 = first_bucket(nr, max_distance, q_offset + r0, k_offset) - bucket0;
          const int64_t nc =
              last_bucket(k_len, max_distance, q_offset + r0, k_offset) - bucket0 - c0 + 1;
          // [nh, nr, Lk]: whole heads (nr = Lq) or rows of one head, contiguous either way
          const at::Tensor g_bh = g.select(0, b).narrow(0, h0, nh).narrow(1, r0, nr);
          TORCH_INTERNAL_ASSERT(g_bh.is_contiguous());
          const at::Tensor w = wsum.narrow(0, 0, nh * nr * nc).view({nh, nr, nc});
          Backend::bucket_sum(BucketSumParams{g_bh.data_ptr(), w.data_ptr(), 1, nh, nr, k_len,
                                              max_distance, q_offset + r0, k_offset, bucket0 + c0,
                                              nc, dtype_of(g)});
          const at::Tensor r = (per_head ? rows.narrow(0, h0, nh) : rows).narrow(-2, c0, nc);
          dq.select(0, b).narrow(0, h0, nh).narrow(1, r0, nr).copy_(at::matmul(w, r));
          dtab.narrow(0, h0, nh).narrow(1, c0, nc).add_(
              at::matmul(w.transpose(-1, -2), qa.select(0, b).narrow(0, h0, nh).narrow(1, r0, nr)));
        }
      }
    }
    at::Tensor dtable = at::zeros(table.sizes(), table.options().dtype(acc_type));
    dtable.narrow(-2, bucket0, num_cols).copy_(per_head ? dtab : dtab.sum(0));
    return {dq, dtable.to(table.scalar_type())};
  }

  // rope: x [..., D] with 1 to 4 dims; cos and sin [..., R] broadcastable to x[..., :R], cast
  // to x's dtype (as HF's apply_rotary_pos_emb does), R even and <= D.
  static at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                         bool interleaved, bool inverse) {
    check_device<Backend>(x, "x");
    check_device<Backend>(cos, "cos");
    check_device<Backend>(sin, "sin");
    TORCH_CHECK(cos.device() == x.device() && sin.device() == x.device(),
                "cos and sin must be on x's device (", x.device(), "); got ", cos.device(), " and ",
                sin.device());
    check_float_dtype(x, "x");
    check_float_dtype(cos, "cos");
    check_float_dtype(sin, "sin");
    TORCH_CHECK(x.dim() >= 1 && x.dim() <= 4, "x must have 1 to 4 dims [..., D]; got shape ",
                x.sizes());
    TORCH_CHECK(cos.sizes() == sin.sizes(), "cos and sin must have the same shape; got ",
                cos.sizes(), " and ", sin.sizes());
    TORCH_CHECK(cos.dim() >= 1 && cos.dim() <= x.dim(), "cos and sin must have 1 to x.dim() = ",
                x.dim(), " dims [..., R]; got shape ", cos.sizes());
    const int64_t dim = x.size(-1), rot = cos.size(-1);
    TORCH_CHECK(rot % 2 == 0 && rot <= dim, "the rotary dim R = cos.size(-1) must be even and at most ",
                "x.size(-1) = ", dim, "; got R = ", rot);
    for (int64_t d = 2; d <= cos.dim(); ++d) {
      TORCH_CHECK(cos.size(-d) == 1 || cos.size(-d) == x.size(-d), "cos and sin of shape ",
                  cos.sizes(), " do not broadcast to x of shape ", x.sizes());
    }
    at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
    if (out.numel() == 0) return out;
    // x as [n0, n1, n2, D]; cos and sin expanded to [n0, n1, n2, R] (stride 0 where broadcast)
    const auto as_4d = [&](const at::Tensor& t) {
      at::Tensor t4 = t.to(x.scalar_type()).contiguous();
      while (t4.dim() < 4) t4 = t4.unsqueeze(0);
      return t4;
    };
    const at::Tensor x4 = as_4d(x);
    at::Tensor c4 = as_4d(cos);
    at::Tensor s4 = as_4d(sin);
    const std::vector<int64_t> shape{x4.size(0), x4.size(1), x4.size(2), rot};
    c4 = c4.expand(shape);
    s4 = s4.expand(shape);
    Backend::rope(RopeParams{x4.data_ptr(), c4.data_ptr(), s4.data_ptr(), out.data_ptr(),
                             x4.size(0), x4.size(1), x4.size(2), dim, rot, c4.stride(0),
                             c4.stride(1), c4.stride(2), interleaved, inverse, dtype_of(x)});
    return out;
  }
};

}  // namespace relpos
