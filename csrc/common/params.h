// Plain-old-data descriptions of one op call, passed from the torch glue to kernels that must not
// include torch headers: the AVX2 translation units (compiled with -mavx2, where inline torch code
// would leak AVX2 instructions into the scalar path) and the CUDA launchers (where torch headers
// cost a minute of nvcc time per file). All tensors are contiguous; sizes are in elements.
#pragma once

#include <cstdint>

#include "common/dropout.h"

namespace relpos {

enum class DType : int { Float32 = 0, Float64 = 1, Float16 = 2, BFloat16 = 3 };

// rel_gather: out[h, i, j, :] = table[h, b(i, j), :]   (h ranges over `heads`, 1 for a shared table)
struct RelGatherParams {
  const void* table;  // [heads, 2K+1, dim]
  void* out;          // [heads, q_len, k_len, dim]
  int64_t heads, q_len, k_len, dim, max_distance, q_offset, k_offset;
  DType dtype;
};

// rel_gather_backward: dtable[h, b, :] = sum_{(i, j): b(i, j) = b} grad[h, i, j, :]
struct RelGatherBwdParams {
  const void* grad;  // [heads, q_len, k_len, dim]
  void* dtable;      // [heads, 2K+1, dim], fully written (zeros where no (i, j) maps)
  int64_t heads, q_len, k_len, dim, max_distance, q_offset, k_offset;
  DType dtype;
};

// skew: y[n, i, j] = x[n, i, skew_col(i, j)]; causal: x is [n, L, L], zeros above the diagonal.
// skew_backward (unskew) is the adjoint: dx[n, i, skew_col(i, j)] = dy[n, i, j], zero elsewhere.
struct SkewParams {
  const void* in;
  void* out;
  int64_t batch;  // product of the leading dimensions
  int64_t q_len, k_len;
  bool causal;
  DType dtype;
};

// rope (rotary position embedding, Su et al. 2021; HF transformers' apply_rotary_pos_emb): on
// each row of x, the first `rot` features turn in pairs (a, b) = (rope_first(f), rope_second(f))
// (relpos_index.h) and the rest are copied. With c = cos, s = sin of the row:
//   forward:  y[a] = x[a] c[a] - x[b] s[a],  y[b] = x[b] c[b] + x[a] s[b]
//             (HF's x * cos + rotate_half(x) * sin, or rotate_every_two when interleaved)
//   inverse:  y[a] = x[a] c[a] + x[b] s[b],  y[b] = x[b] c[b] - x[a] s[a]   (the adjoint)
// Row r = (i0, i1, i2) of x [n0, n1, n2, dim] reads cos/sin at i0 * cs0 + i1 * cs1 + i2 * cs2
// (a stride is 0 where cos/sin broadcast over that dim); their last dim is contiguous.
struct RopeParams {
  const void* x;    // [n0, n1, n2, dim]
  const void* cos;  // rows of `rot` elements, strides cs0, cs1, cs2
  const void* sin;  // same layout as cos
  void* out;        // [n0, n1, n2, dim]
  int64_t n0, n1, n2, dim, rot;
  int64_t cs0, cs1, cs2;
  bool interleaved, inverse;
  DType dtype;
};

// rel_logits: out[b, h, i, j] = q[b, h, i, :] . table[h?, b(i, j), :]
struct RelLogitsParams {
  const void* q;      // [batch, heads, q_len, dim]
  const void* table;  // [2K+1, dim] or [heads, 2K+1, dim]
  void* out;          // [batch, heads, q_len, k_len]
  int64_t batch, heads, q_len, k_len, dim, max_distance, q_offset, k_offset;
  bool table_per_head;
  DType dtype;
};

// rel_logits_backward, first stage: per query row, the gradient mass of each reachable bucket,
//   wsum[b, h, i, c] = sum_{j: b(i, j) = bucket0 + c} grad[b, h, i, j]
// accumulated in float32 (float64 for float64 input), with bucket0 = first_bucket(...) and
// num_cols = last_bucket - bucket0 + 1 <= q_len + k_len - 1 columns (the glue takes a group of
// heads, or a block of rows, at a time, within a fixed budget whatever K is). The glue finishes
// with two matmuls:
//   dq = wsum @ table[bucket0 : bucket0 + num_cols],  dtable[bucket0 : ...] = sum wsum^T @ q.
struct BucketSumParams {
  const void* grad;  // [batch, heads, q_len, k_len]
  void* wsum;  // [batch, heads, q_len, num_cols]: float32, or float64 when dtype is Float64
  int64_t batch, heads, q_len, k_len, max_distance, q_offset, k_offset;
  int64_t bucket0, num_cols;
  DType dtype;
};

}  // namespace relpos

namespace relpos {

// rel_attention (Shaw et al. 2018 with relative keys and values), per (b, h, i):
//   s_ij = (q_i . k_j + q_i . rel_k[b(i, j)] + k_j . rel_q[b(i, j)]) * scale,  masked where
//   causal / key padding / attention mask
//   (+ rel_bias[b(i, j)] after the scale when given)
//   p_ij = softmax_j(s_ij),  out_i = sum_j p_ij (v_j + rel_v[b(i, j)]),  lse_i = log sum_j e^s_ij
// k and v may have fewer heads (grouped-query attention): query head h reads kv head
// h / (heads / kv_heads). Rows with no visible key get out = 0 and lse = +inf (so that the
// backward's exp(s - lse) is 0, not NaN).
//
// The CUDA kernels keep the logits in base 2 (exp2 needs no scaling of its argument): they scale
// by scale * log2(e) and return lse = m * ln(2) + ln(l) in base e. The AVX2 kernels keep them in
// natural units and take log2(e) into their exponential's range reduction (expv in
// cpu/rel_attention_avx2.cpp says why). The constants, for both (each casts them to its
// accumulation type):
constexpr double kLog2e = 1.4426950408889634;
constexpr double kLn2 = 0.6931471805599453;

struct RelAttentionParams {
  const void* q;                  // [batch, heads, q_len, dim]
  const void* k;                  // [batch, kv_heads, k_len, dim], slabs kv_stride apart
  const void* v;                  // [batch, kv_heads, k_len, dim], slabs kv_stride apart
  const void* rel_k;              // [2K+1, dim] or [heads, 2K+1, dim]; null: no key term
  const void* rel_v;              // same; null: no value term
  // [2K+1] or [heads, 2K+1]: a scalar per bucket added to the logits after the scale,
  //   s_ij = (q_i . k_j + q_i . rel_k[b]) * scale + rel_bias[b]   (T5 buckets, ALiBi slopes);
  // null: none. The glue requires scale != 0 with it: the AVX2 backward sums the scaled dS per
  // bucket and divides by the scale.
  const void* rel_bias;
  // [2K+1, dim] or [heads, 2K+1, dim]: the key-side table, k_j . rel_q[b] (DeBERTa's
  // position-to-content term; query head h reads rel_q[h]); null: none
  const void* rel_q;
  const bool* key_padding_mask;   // [batch, k_len], true = ignore that key; null: none
  // [batch or 1, heads or 1, q_len, k_len], true = query i of head h ignores key j; null: none.
  // A broadcast dimension has stride 0: attn_mask_hides below is the one place that reads it.
  const bool* attn_mask;
  int64_t attn_mask_b_stride, attn_mask_h_stride;
  // [batch, q_len] and [batch, k_len] int64, both or neither: query i sees key j only when
  // q_segment_ids[b, i] == k_segment_ids[b, j] (packed documents, O(L) where an attention mask
  // is O(L^2)); null: none
  const int64_t* q_segment_ids;
  const int64_t* k_segment_ids;
  // A local window: key j is visible to query i only when -window_left <= r <= window_right,
  // r = (k_offset + j) - (q_offset + i); a negative bound is no bound.
  int64_t window_left, window_right;
  void* out;                      // [batch, heads, q_len, dim]
  void* lse;                      // [batch, heads, q_len]: float32, float64 for Float64
  int64_t batch, heads, kv_heads, q_len, k_len, dim, max_distance, q_offset, k_offset;
  // Elements from one (b, kv head) slab of k and v to the next: k_len * dim when packed; a
  // preallocated KV cache [B, Hkv, capacity, D] read up to k_len passes capacity * dim. Rows in
  // a slab are dim apart. The forward reads any kv_stride >= k_len * dim; the backward is
  // always given packed k and v.
  int64_t kv_stride;
  bool rel_k_per_head, rel_v_per_head, rel_bias_per_head, rel_q_per_head, causal;
  double scale;
  DType dtype;
  // Attention dropout (common/dropout.h): out_i = sum_j p_ij keep_ij / (1 - p) (v_j + rel_v[b]),
  // lse without dropout. The backward reads the same mask: dv_j and drel_v take p_ij keep_ij /
  // (1 - p), and dp_ij = keep_ij / (1 - p) dout_i . (v_j + rel_v[b]) in ds_ij.
  DropoutParams dropout;
};

// rel_attention_backward: gradients of all five inputs, recomputing p from lse.
//   dp_ij = dout_i . (v_j + rel_v[b]),  ds_ij = p_ij (dp_ij - dout_i . out_i)
//   dq_i = scale sum_j ds_ij (k_j + rel_k[b]),  dk_j = scale sum_i ds_ij (q_i + rel_q[b]),
//   dv_j = sum_i p_ij dout_i
//   drel_k[b] = scale sum_{b(i,j)=b} ds_ij q_i,  drel_v[b] = sum_{b(i,j)=b} p_ij dout_i
//   drel_bias[b] = sum_{b(i,j)=b} ds_ij,  drel_q[b] = scale sum_{b(i,j)=b} ds_ij k_j
// Work items are (b, kv head) so that dk/dv of a kv head have one writer. The table gradients
// are written per (b, h) into drel_*_partial (acc type) and summed by the glue in a fixed order.
RELPOS_HD bool attn_mask_hides(const RelAttentionParams& p, int64_t b, int64_t h, int64_t i,
                                int64_t j) {
  return p.attn_mask != nullptr &&
         p.attn_mask[b * p.attn_mask_b_stride + h * p.attn_mask_h_stride + i * p.k_len + j];
}

RELPOS_HD bool segment_hides(const RelAttentionParams& p, int64_t b, int64_t i, int64_t j) {
  return p.q_segment_ids != nullptr &&
         p.q_segment_ids[b * p.q_len + i] != p.k_segment_ids[b * p.k_len + j];
}

RELPOS_HD bool window_hides(const RelAttentionParams& p, int64_t i, int64_t j) {
  const int64_t r = (p.k_offset + j) - (p.q_offset + i);
  return (p.window_left >= 0 && r < -p.window_left) || (p.window_right >= 0 && r > p.window_right);
}

// Whether the attention mask, the segment ids or the window hide key j from query i of head h
// (batch b); the causal limit and the key padding are checked apart.
RELPOS_HD bool masks_hide(const RelAttentionParams& p, int64_t b, int64_t h, int64_t i, int64_t j) {
  return attn_mask_hides(p, b, h, i, j) || segment_hides(p, b, i, j) || window_hides(p, i, j);
}

struct RelAttentionBwdParams {
  RelAttentionParams fwd;         // inputs as in the forward (fwd.out and fwd.lse are read)
  const void* grad_out;           // [batch, heads, q_len, dim]
  void* dq;                       // [batch, heads, q_len, dim]
  void* dk;                       // [batch, kv_heads, k_len, dim]
  void* dv;                       // [batch, kv_heads, k_len, dim]
  void* drel_k_partial;           // [batch, heads, 2K+1, dim] acc type, or null
  void* drel_v_partial;           // [batch, heads, 2K+1, dim] acc type, or null
  void* drel_bias_partial;        // [batch, heads, 2K+1] acc type, or null
  void* drel_q_partial;           // [batch, heads, 2K+1, dim] acc type, or null
  // CUDA only: one dq block per (b, h) over its query tiles in order (and, with rel_q, one dk/dv
  // block per (b, kv head) over its key tiles in order), so that the table-gradient atomics add in
  // a fixed order (set under torch.use_deterministic_algorithms; CPU ignores it)
  bool serial_q_tiles = false;
};

}  // namespace relpos
