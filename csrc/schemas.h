// Every schema of the relpos library, in one place. csrc/ops.cpp defines them in the `relpos`
// namespace; the CUDA emulator used by the tests defines the same list in `relpos_emu` so that the
// emulated CUDA kernels are called with exactly the signatures of the real ops.
//
// Conventions (DESIGN.md §1): r = pos_k - pos_q, bucket = clamp(r, -K, K) + K, K = max_distance.
// Shapes: table [2K+1, D] (shared) or [H, 2K+1, D] (per head); q [B, H, Lq, D].
#pragma once

#define RELPOS_FOR_EACH_SCHEMA(X)                                                              \
  /* A[(h,) i, j, :] = table[(h,) bucket(i, j), :]  ->  [(H,) Lq, Lk, D] */                   \
  X("rel_gather(Tensor table, SymInt q_len, SymInt k_len, SymInt max_distance, "              \
    "SymInt q_offset=0, SymInt k_offset=0) -> Tensor")                                        \
  /* the deterministic scatter-add of grad [(H,) Lq, Lk, D] into a [(H,) 2K+1, D] table */    \
  X("rel_gather_backward(Tensor grad, SymInt max_distance, SymInt q_offset=0, "               \
    "SymInt k_offset=0) -> Tensor")                                                           \
  /* Music Transformer skew: x [..., Lq, Lq+Lk-1] -> [..., Lq, Lk]; causal: [..., L, L] */     \
  X("skew(Tensor x, bool causal=False) -> Tensor")                                            \
  /* the adjoint of skew (unskew): [..., Lq, Lk] -> [..., Lq, Lq+Lk-1] (causal: [..., L, L]) */ \
  X("skew_backward(Tensor grad, bool causal=False) -> Tensor")                                \
  /* S[b, h, i, j] = q[b, h, i, :] . table[(h,) bucket(i, j), :], the fused skewed matmul */   \
  X("rel_logits(Tensor q, Tensor table, SymInt max_distance, SymInt k_len, "                  \
    "SymInt q_offset=0, SymInt k_offset=0) -> Tensor")                                        \
  /* (dq [B, H, Lq, D], dtable like table) from grad [B, H, Lq, Lk] */                        \
  X("rel_logits_backward(Tensor grad, Tensor q, Tensor table, SymInt max_distance, "          \
    "SymInt q_offset=0, SymInt k_offset=0) -> (Tensor, Tensor)")                              \
  /* rotary position embedding (HF's apply_rotary_pos_emb): x [..., D] (up to 4 dims), cos   \
     and sin [..., R] broadcastable to x[..., :R] (cast to x's dtype): the first R features    \
     turn in pairs (f, f + R/2), or (2f, 2f+1) when interleaved, the rest pass through;       \
     inverse: the adjoint rotation (the backward) */                                          \
  X("rope(Tensor x, Tensor cos, Tensor sin, bool interleaved=False, bool inverse=False) "     \
    "-> Tensor")                                                                              \
  /* fused Shaw attention, O(L) memory: (out [B, H, Lq, D], logsumexp [B, H, Lq]); dropout on  \
     the probabilities from a counter-based hash of dropout_seed (common/dropout.h); segment   \
     ids [B, Lq] / [B, Lk]: query i sees key j only within its segment (packed documents); a  \
     local window: only keys with -window_left <= r <= window_right (-1: no bound); rel_bias   \
     [2K+1] / [H, 2K+1]: a scalar per bucket added to the scaled logits (T5, ALiBi); rel_q     \
     [2K+1, D] / [H, 2K+1, D]: the key-side table, k_j . rel_q[b] joins the logits before the  \
     scale (DeBERTa's position-to-content term) */                                            \
  X("rel_attention(Tensor q, Tensor k, Tensor v, Tensor? rel_k, Tensor? rel_v, "              \
    "SymInt max_distance, bool causal=False, float? scale=None, SymInt q_offset=0, "          \
    "SymInt k_offset=0, Tensor? key_padding_mask=None, float dropout_p=0.0, "                 \
    "Tensor? dropout_seed=None, Tensor? attn_mask=None, Tensor? q_segment_ids=None, "         \
    "Tensor? k_segment_ids=None, int window_left=-1, int window_right=-1, "                   \
    "Tensor? rel_bias=None, Tensor? rel_q=None) -> (Tensor, Tensor)")                         \
  /* (dq, dk, dv, drel_k, drel_v, drel_bias, drel_q); a table gradient is empty when it is    \
     None */                                                                                  \
  X("rel_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor? rel_k, "   \
    "Tensor? rel_v, Tensor out, Tensor logsumexp, SymInt max_distance, bool causal, "          \
    "float? scale, SymInt q_offset, SymInt k_offset, Tensor? key_padding_mask, "              \
    "float dropout_p=0.0, Tensor? dropout_seed=None, Tensor? attn_mask=None, "                \
    "Tensor? q_segment_ids=None, Tensor? k_segment_ids=None, int window_left=-1, "            \
    "int window_right=-1, Tensor? rel_bias=None, Tensor? rel_q=None) "                        \
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
