// The torch-facing body of rel_attention / rel_attention_backward (fused Shaw attention), shared
// by the backends like common/ops_impl.h. `Backend` supplies device_ok/device_name and
//   static void rel_attention(const RelAttentionParams&);
//   static void rel_attention_backward(const RelAttentionBwdParams&);
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>

#include "common/ops_impl.h"
#include "common/params.h"

namespace relpos {

template <class Backend>
struct AttentionImpl {
  struct Checked {
    at::Tensor q, k, v, rel_k, rel_v, rel_bias, rel_q, mask;  // contiguous (k, v: see kv_stride); undefined when absent
    at::Tensor attn_mask;  // [1 or B, 1 or H, Lq, Lk], contiguous; undefined when absent
    int64_t attn_mask_b_stride = 0, attn_mask_h_stride = 0;  // 0 where broadcast
    at::Tensor q_seg, k_seg;  // [B, Lq], [B, Lk] int64, contiguous; undefined when absent
    int64_t batch, heads, kv_heads, q_len, k_len, dim;
    int64_t kv_stride;  // RelAttentionParams::kv_stride
    double scale;
  };

  static void check_table(const std::optional<at::Tensor>& t, const at::Tensor& q,
                          int64_t max_distance, const char* name) {
    if (!t.has_value()) return;
    check_device<Backend>(*t, name);
    check_table_rows(*t, max_distance, name);
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), name, " dtype must match q dtype (",
                q.scalar_type(), "); got ", t->scalar_type());
    TORCH_CHECK(t->size(-1) == q.size(3), name, "'s last dim must equal q's head dim D=", q.size(3),
                "; got shape ", t->sizes());
    TORCH_CHECK(t->dim() == 2 || t->size(0) == q.size(1), "a per-head ", name,
                " [H, 2K+1, D] must have H equal to q.size(1)=", q.size(1), "; got shape ",
                t->sizes());
  }

  // rel_bias: [2K+1] or [H, 2K+1], one scalar per bucket added to the scaled logits.
  static void check_bias(const std::optional<at::Tensor>& t, const at::Tensor& q,
                         int64_t max_distance, double scale) {
    if (!t.has_value()) return;
    check_device<Backend>(*t, "rel_bias");
    TORCH_CHECK((t->dim() == 1 || t->dim() == 2) && t->size(-1) == num_buckets(max_distance),
                "rel_bias must be [2K+1] (shared) or [H, 2K+1] (per head) with 2*max_distance+1 = ",
                num_buckets(max_distance), " buckets (max_distance=", max_distance, "); got shape ",
                t->sizes());
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), "rel_bias dtype must match q dtype (",
                q.scalar_type(), "); got ", t->scalar_type());
    TORCH_CHECK(t->dim() == 1 || t->size(0) == q.size(1),
                "a per-head rel_bias [H, 2K+1] must have H equal to q.size(1)=", q.size(1),
                "; got shape ", t->sizes());
    // the AVX2 backward recovers dbias from the scaled dS
    TORCH_CHECK(scale != 0.0 && std::isfinite(scale), "rel_bias needs a finite nonzero scale; got ",
                scale);
  }

  // The distance between the [Lk, D] slabs of a [B, Hkv, Lk, D] tensor whose slabs, in (b, head)
  // order, each hold Lk rows D apart: a packed tensor (Lk * D), or the first Lk rows of a
  // preallocated [B, Hkv, capacity, D] KV cache (capacity * D); 0 for any other layout.
  static int64_t slab_stride(const at::Tensor& t) {
    const int64_t b = t.size(0), h = t.size(1), l = t.size(2), d = t.size(3);
    if (t.numel() == 0) return 0;
    if ((d > 1 && t.stride(3) != 1) || (l > 1 && t.stride(2) != d)) return 0;
    const int64_t s = h > 1 ? t.stride(1) : (b > 1 ? t.stride(0) : l * d);
    if (s < l * d || (b > 1 && t.stride(0) != h * s)) return 0;
    return s;
  }

  // Segment ids [B, len] of any integer dtype, as contiguous int64.
  static at::Tensor segment_ids(const at::Tensor& t, int64_t batch, int64_t len, const char* name,
                                const char* len_name) {
    check_device<Backend>(t, name);
    TORCH_CHECK(at::isIntegralType(t.scalar_type(), /*includeBool=*/false), name,
                " must be an integer tensor (a segment id per position); got ", t.scalar_type());
    TORCH_CHECK(t.dim() == 2 && t.size(0) == batch && t.size(1) == len, name, " must be [B, ",
                len_name, "] = [", batch, ", ", len, "]; got ", t.sizes());
    return t.to(at::kLong).contiguous();
  }

  // kv_slabs: the forward reads k and v in place when both are such slabs (slab_stride) with
  // the same stride, so a decoding step on a cache view copies nothing; otherwise (and always
  // for the backward) they are made contiguous.
  static Checked check(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const std::optional<at::Tensor>& rel_k,
                       const std::optional<at::Tensor>& rel_v, int64_t max_distance,
                       std::optional<double> scale,
                       const std::optional<at::Tensor>& key_padding_mask,
                       const std::optional<at::Tensor>& attn_mask,
                       const std::optional<at::Tensor>& q_segment_ids,
                       const std::optional<at::Tensor>& k_segment_ids,
                       const std::optional<at::Tensor>& rel_bias,
                       const std::optional<at::Tensor>& rel_q, bool kv_slabs = false) {
    check_device<Backend>(q, "q");
    check_device<Backend>(k, "k");
    check_device<Backend>(v, "v");
    check_float_dtype(q, "q");
    TORCH_CHECK(q.dim() == 4, "q must be [B, H, Lq, D]; got shape ", q.sizes());
    TORCH_CHECK(k.dim() == 4, "k must be [B, Hkv, Lk, D]; got shape ", k.sizes());
    TORCH_CHECK(v.sizes() == k.sizes(), "v must have the shape of k ", k.sizes(), "; got ",
                v.sizes());
    TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
                "k and v dtypes must match q dtype (", q.scalar_type(), "); got ", k.scalar_type(),
                " and ", v.scalar_type());
    TORCH_CHECK(k.size(0) == q.size(0) && k.size(3) == q.size(3),
                "k must be [B, Hkv, Lk, D] with B and D of q ", q.sizes(), "; got ", k.sizes());
    TORCH_CHECK((k.size(1) > 0 && q.size(1) % k.size(1) == 0) || q.size(1) == 0,
                "k's head count must divide q's (grouped-query attention); got q heads ", q.size(1),
                ", k heads ", k.size(1));
    check_max_distance(max_distance);
    check_table(rel_k, q, max_distance, "rel_k");
    check_table(rel_v, q, max_distance, "rel_v");
    check_table(rel_q, q, max_distance, "rel_q");
    if (key_padding_mask.has_value()) {
      const at::Tensor& m = *key_padding_mask;
      check_device<Backend>(m, "key_padding_mask");
      TORCH_CHECK(m.scalar_type() == at::kBool, "key_padding_mask must be bool (true = ignore); got ",
                  m.scalar_type());
      TORCH_CHECK(m.dim() == 2 && m.size(0) == q.size(0) && m.size(1) == k.size(2),
                  "key_padding_mask must be [B, Lk] = [", q.size(0), ", ", k.size(2), "]; got ",
                  m.sizes());
    }
    Checked c;
    if (attn_mask.has_value()) {
      const at::Tensor& m = *attn_mask;
      check_device<Backend>(m, "attn_mask");
      TORCH_CHECK(m.scalar_type() == at::kBool, "attn_mask must be bool (true = ignore); got ",
                  m.scalar_type());
      const bool ok = (m.dim() == 2 || m.dim() == 4) && m.size(-2) == q.size(2) &&
                      m.size(-1) == k.size(2) &&
                      (m.dim() == 2 || ((m.size(0) == 1 || m.size(0) == q.size(0)) &&
                                        (m.size(1) == 1 || m.size(1) == q.size(1))));
      TORCH_CHECK(ok, "attn_mask must be [Lq, Lk] or [B or 1, H or 1, Lq, Lk] with Lq = ", q.size(2),
                  ", Lk = ", k.size(2), ", B = ", q.size(0), ", H = ", q.size(1), "; got ",
                  m.sizes());
      c.attn_mask = (m.dim() == 2 ? m.unsqueeze(0).unsqueeze(0) : m).contiguous();
      c.attn_mask_b_stride = c.attn_mask.size(0) == 1 ? 0 : c.attn_mask.stride(0);
      c.attn_mask_h_stride = c.attn_mask.size(1) == 1 ? 0 : c.attn_mask.stride(1);
    }
    TORCH_CHECK(q_segment_ids.has_value() == k_segment_ids.has_value(),
                "q_segment_ids and k_segment_ids go together (for self-attention pass the same "
                "[B, L] tensor twice); got only ", q_segment_ids.has_value() ? "q" : "k",
                "_segment_ids");
    if (q_segment_ids.has_value()) {
      c.q_seg = segment_ids(*q_segment_ids, q.size(0), q.size(2), "q_segment_ids", "Lq");
      c.k_seg = segment_ids(*k_segment_ids, q.size(0), k.size(2), "k_segment_ids", "Lk");
    }
    c.q = q.contiguous();
    const int64_t slabs = kv_slabs ? slab_stride(k) : 0;
    if (slabs > 0 && slab_stride(v) == slabs) {
      c.k = k;
      c.v = v;
      c.kv_stride = slabs;
    } else {
      c.k = k.contiguous();
      c.v = v.contiguous();
      c.kv_stride = k.size(2) * k.size(3);
    }
    if (rel_k.has_value()) c.rel_k = rel_k->contiguous();
    if (rel_v.has_value()) c.rel_v = rel_v->contiguous();
    if (rel_q.has_value()) c.rel_q = rel_q->contiguous();
    if (key_padding_mask.has_value()) c.mask = key_padding_mask->contiguous();
    c.batch = q.size(0);
    c.heads = q.size(1);
    c.kv_heads = k.size(1);
    c.q_len = q.size(2);
    c.k_len = k.size(2);
    c.dim = q.size(3);
    c.scale = scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(std::max<int64_t>(c.dim, 1)));
    // Below float64 the kernels take the scale (times log2 e) in float32: beyond 2^126 it would
    // be inf there, and every logit inf or NaN.
    const double scale_max = q.scalar_type() == at::kDouble ? 1e300 : 0x1p126;
    TORCH_CHECK(std::isfinite(c.scale) && std::abs(c.scale) <= scale_max,
                "scale must be finite and at most ", scale_max, " in magnitude for ",
                q.scalar_type(), " inputs; got ", c.scale);
    check_bias(rel_bias, q, max_distance, c.scale);
    if (rel_bias.has_value()) c.rel_bias = rel_bias->contiguous();
    return c;
  }

  static void check_positions(int64_t q_offset, int64_t k_offset, int64_t window_left,
                              int64_t window_right) {
    check_offsets(q_offset, k_offset);
    TORCH_CHECK(window_left >= -1 && window_right >= -1,
                "window_left and window_right must be >= 0, or -1 for no bound; got window_left=",
                window_left, ", window_right=", window_right);
  }

  static RelAttentionParams params(const Checked& c, int64_t max_distance, bool causal,
                                   int64_t q_offset, int64_t k_offset, int64_t window_left,
                                   int64_t window_right) {
    RelAttentionParams p{};
    p.q = c.q.data_ptr();
    p.k = c.k.data_ptr();
    p.v = c.v.data_ptr();
    p.rel_k = c.rel_k.defined() ? c.rel_k.data_ptr() : nullptr;
    p.rel_v = c.rel_v.defined() ? c.rel_v.data_ptr() : nullptr;
    p.rel_bias = c.rel_bias.defined() ? c.rel_bias.data_ptr() : nullptr;
    p.rel_q = c.rel_q.defined() ? c.rel_q.data_ptr() : nullptr;
    p.key_padding_mask = c.mask.defined() ? static_cast<const bool*>(c.mask.data_ptr()) : nullptr;
    p.attn_mask = c.attn_mask.defined() ? static_cast<const bool*>(c.attn_mask.data_ptr()) : nullptr;
    p.attn_mask_b_stride = c.attn_mask_b_stride;
    p.attn_mask_h_stride = c.attn_mask_h_stride;
    p.q_segment_ids = c.q_seg.defined() ? static_cast<const int64_t*>(c.q_seg.data_ptr()) : nullptr;
    p.k_segment_ids = c.k_seg.defined() ? static_cast<const int64_t*>(c.k_seg.data_ptr()) : nullptr;
    // No distance reaches 2^62 (offsets within 2^60, lengths far below): a wider window hides
    // nothing, and as no bound it keeps the window arithmetic inside int64.
    constexpr int64_t kNoBound = int64_t(1) << 62;
    p.window_left = window_left >= kNoBound ? -1 : window_left;
    p.window_right = window_right >= kNoBound ? -1 : window_right;
    p.batch = c.batch;
    p.heads = c.heads;
    p.kv_heads = c.kv_heads;
    p.q_len = c.q_len;
    p.k_len = c.k_len;
    p.dim = c.dim;
    p.max_distance = max_distance;
    p.kv_stride = c.kv_stride;
    p.q_offset = q_offset;
    p.k_offset = k_offset;
    p.rel_k_per_head = c.rel_k.defined() && c.rel_k.dim() == 3;
    p.rel_v_per_head = c.rel_v.defined() && c.rel_v.dim() == 3;
    p.rel_bias_per_head = c.rel_bias.defined() && c.rel_bias.dim() == 2;
    p.rel_q_per_head = c.rel_q.defined() && c.rel_q.dim() == 3;
    p.causal = causal;
    p.scale = c.scale;
    p.dtype = dtype_of(c.q);
    return p;
  }

  // dropout_p in [0, 1]; above 0 it needs the seed: a CPU int64 tensor of one element, read
  // here (the ops take it as a tensor so that torch.compile traces its drawing).
  static DropoutParams dropout(double dropout_p, const std::optional<at::Tensor>& seed) {
    TORCH_CHECK(dropout_p >= 0.0 && dropout_p <= 1.0, "dropout_p must be in [0, 1]; got ",
                dropout_p);
    DropoutParams d;
    if (dropout_p == 0.0) return d;
    TORCH_CHECK(seed.has_value(), "dropout_p > 0 needs dropout_seed, an int64 tensor of one "
                "element (relpos_ext.rel_attention draws one from torch's generator)");
    TORCH_CHECK(seed->scalar_type() == at::kLong && seed->numel() == 1 && seed->device().is_cpu(),
                "dropout_seed must be a CPU int64 tensor of one element; got ",
                seed->scalar_type(), " ", seed->sizes(), " on ", seed->device());
    d.on = true;
    d.seed = static_cast<uint64_t>(seed->item<int64_t>());
    const double t = std::floor(dropout_p * 2147483648.0);  // p * 2^31
    d.threshold = static_cast<uint32_t>(std::min(t, 2147483647.0));
    d.keep_scale = dropout_p < 1.0 ? 1.0 / (1.0 - dropout_p) : 0.0;
    return d;
  }

  static at::ScalarType acc_type(const at::Tensor& q) {
    return q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  }

  static std::tuple<at::Tensor, at::Tensor> rel_attention(
      const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
      const std::optional<at::Tensor>& rel_k, const std::optional<at::Tensor>& rel_v,
      int64_t max_distance, bool causal, std::optional<double> scale, int64_t q_offset,
      int64_t k_offset, const std::optional<at::Tensor>& key_padding_mask, double dropout_p,
      const std::optional<at::Tensor>& dropout_seed, const std::optional<at::Tensor>& attn_mask,
      const std::optional<at::Tensor>& q_segment_ids,
      const std::optional<at::Tensor>& k_segment_ids, int64_t window_left, int64_t window_right,
      const std::optional<at::Tensor>& rel_bias, const std::optional<at::Tensor>& rel_q) {
    const Checked c = check(q, k, v, rel_k, rel_v, max_distance, scale, key_padding_mask,
                            attn_mask, q_segment_ids, k_segment_ids, rel_bias, rel_q,
                            /*kv_slabs=*/true);
    check_positions(q_offset, k_offset, window_left, window_right);
    const DropoutParams drop = dropout(dropout_p, dropout_seed);
    at::Tensor out = at::empty({c.batch, c.heads, c.q_len, c.dim}, c.q.options());
    at::Tensor lse = at::empty({c.batch, c.heads, c.q_len}, c.q.options().dtype(acc_type(c.q)));
    if (lse.numel() == 0) return {out, lse};
    RelAttentionParams p = params(c, max_distance, causal, q_offset, k_offset, window_left,
                                  window_right);
    p.dropout = drop;
    p.out = out.data_ptr();
    p.lse = lse.data_ptr();
    Backend::rel_attention(p);
    return {out, lse};
  }

  static std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                    at::Tensor>
  rel_attention_backward(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                         const at::Tensor& v, const std::optional<at::Tensor>& rel_k,
                         const std::optional<at::Tensor>& rel_v, const at::Tensor& out,
                         const at::Tensor& logsumexp, int64_t max_distance, bool causal,
                         std::optional<double> scale, int64_t q_offset, int64_t k_offset,
                         const std::optional<at::Tensor>& key_padding_mask, double dropout_p,
                         const std::optional<at::Tensor>& dropout_seed,
                         const std::optional<at::Tensor>& attn_mask,
                         const std::optional<at::Tensor>& q_segment_ids,
                         const std::optional<at::Tensor>& k_segment_ids, int64_t window_left,
                         int64_t window_right, const std::optional<at::Tensor>& rel_bias,
                         const std::optional<at::Tensor>& rel_q) {
    const Checked c = check(q, k, v, rel_k, rel_v, max_distance, scale, key_padding_mask,
                            attn_mask, q_segment_ids, k_segment_ids, rel_bias, rel_q);
    check_positions(q_offset, k_offset, window_left, window_right);
    const DropoutParams drop = dropout(dropout_p, dropout_seed);
    TORCH_CHECK(grad_out.sizes() == c.q.sizes() && out.sizes() == c.q.sizes(),
                "grad_out and out must have the shape of q ", c.q.sizes(), "; got ",
                grad_out.sizes(), " and ", out.sizes());
    TORCH_CHECK(grad_out.scalar_type() == c.q.scalar_type() && out.scalar_type() == c.q.scalar_type(),
                "grad_out and out dtypes must match q dtype");
    TORCH_CHECK(logsumexp.dim() == 3 && logsumexp.size(0) == c.batch &&
                    logsumexp.size(1) == c.heads && logsumexp.size(2) == c.q_len &&
                    logsumexp.scalar_type() == acc_type(c.q),
                "logsumexp must be the [B, H, Lq] ", acc_type(c.q), " tensor rel_attention returned; got ",
                logsumexp.sizes(), " ", logsumexp.scalar_type());
    check_device<Backend>(grad_out, "grad_out");
    const at::Tensor go = grad_out.contiguous(), o = out.contiguous(), l = logsumexp.contiguous();
    at::Tensor dq = at::zeros_like(c.q);
    at::Tensor dk = at::zeros_like(c.k);
    at::Tensor dv = at::zeros_like(c.v);
    // The table gradients are summed from [B, H, rows, D] partials. When max_distance exceeds
    // every distance in the problem, only the rows [K - K', K + K'] of the tables are read
    // (used_max_distance): the kernels then run with K' on that slice, and the partials hold
    // 2K' + 1 rows, not 2K + 1 (B = H = 8, L = 512, D = 64, K = 4096: the partials, zero-filled
    // and summed on every call, 2 x 128 -> 2 x 16 MiB; the backward on 2 threads 211 -> 133-138 ms,
    // on one 389 -> 253-269 ms, as at K = 512).
    const int64_t used = used_max_distance(c.q_len, c.k_len, max_distance, q_offset, k_offset);
    Checked cu = c;
    auto slice = [&](const at::Tensor& t, int64_t bucket_dim) {  // a table's rows, a bias's columns
      if (!t.defined() || used == max_distance) return t;  // (the whole table: no ATen calls)
      return t.narrow(bucket_dim, max_distance - used, num_buckets(used)).contiguous();
    };
    cu.rel_k = slice(c.rel_k, -2);
    cu.rel_v = slice(c.rel_v, -2);
    cu.rel_bias = slice(c.rel_bias, -1);
    cu.rel_q = slice(c.rel_q, -2);
    const int64_t rows = num_buckets(used);
    const auto acc_opts = c.q.options().dtype(acc_type(c.q));
    at::Tensor pk = c.rel_k.defined() ? at::zeros({c.batch, c.heads, rows, c.dim}, acc_opts) : at::Tensor();
    at::Tensor pv = c.rel_v.defined() ? at::zeros({c.batch, c.heads, rows, c.dim}, acc_opts) : at::Tensor();
    at::Tensor pb = c.rel_bias.defined() ? at::zeros({c.batch, c.heads, rows}, acc_opts) : at::Tensor();
    at::Tensor pq = c.rel_q.defined() ? at::zeros({c.batch, c.heads, rows, c.dim}, acc_opts) : at::Tensor();
    if (c.batch * c.heads * c.q_len * c.k_len * c.dim > 0) {
      RelAttentionBwdParams p{};
      p.fwd = params(cu, used, causal, q_offset, k_offset, window_left, window_right);
      p.fwd.dropout = drop;
      p.fwd.out = o.data_ptr();
      p.fwd.lse = l.data_ptr();
      p.grad_out = go.data_ptr();
      p.dq = dq.data_ptr();
      p.dk = dk.data_ptr();
      p.dv = dv.data_ptr();
      p.drel_k_partial = pk.defined() ? pk.data_ptr() : nullptr;
      p.drel_v_partial = pv.defined() ? pv.data_ptr() : nullptr;
      p.drel_bias_partial = pb.defined() ? pb.data_ptr() : nullptr;
      p.drel_q_partial = pq.defined() ? pq.data_ptr() : nullptr;
      Backend::rel_attention_backward(p);
    }
    auto finish = [&](const at::Tensor& partial, const at::Tensor& table) {
      if (!table.defined()) return at::empty({0}, c.q.options());
      at::Tensor g = partial.sum(0);  // over the batch, in a fixed order
      // a shared table (or bias) also sums over heads
      if (table.dim() == partial.dim() - 2) g = g.sum(0);
      const int64_t bucket_dim = partial.dim() == 4 ? -2 : -1;  // a table's rows, a bias's columns
      if (used < max_distance) {  // rows outside the slice get no gradient
        at::Tensor full = at::zeros(table.sizes(), g.options());
        full.narrow(bucket_dim, max_distance - used, rows).copy_(g);
        g = full;
      }
      return g.to(table.scalar_type());
    };
    return {dq,
            dk,
            dv,
            finish(pk, c.rel_k),
            finish(pv, c.rel_v),
            finish(pb, c.rel_bias),
            finish(pq, c.rel_q)};
  }
};

}  // namespace relpos
