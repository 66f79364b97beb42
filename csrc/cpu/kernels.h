// CPU kernels: one function per op and ISA, each computing a range [begin, end) of independent
// work items so the caller can split them with at::parallel_for. The work items:
//   rel_gather            rows (h, i)            of heads * q_len
//   rel_gather_backward   (h, 16-wide d block)   of heads * ceil(dim / 16)   (deterministic)
//   skew, skew_backward   rows (n, i)            of batch * q_len
//   rel_logits            rows (b, h, i)         of batch * heads * q_len
//   bucket_sum            rows (b, h, i)         of batch * heads * q_len
// scalar:: handles every dtype (float64 included) and any CPU; avx2:: handles float32, float16
// and bfloat16 (float32 arithmetic) and lives in *_avx2.cpp, compiled with -mavx2 -mfma -mf16c,
// which therefore include no torch headers.
#pragma once

#include <cstdint>

#include "common/params.h"

namespace relpos::cpu {

constexpr int64_t kGatherBwdDBlock = 16;

inline int64_t gather_bwd_items(const RelGatherBwdParams& p) {
  return p.heads * ((p.dim + kGatherBwdDBlock - 1) / kGatherBwdDBlock);
}

namespace avx2 {
void rel_gather(const RelGatherParams& p, int64_t begin, int64_t end);
void rel_gather_backward(const RelGatherBwdParams& p, int64_t begin, int64_t end);
void skew(const SkewParams& p, int64_t begin, int64_t end);
void skew_backward(const SkewParams& p, int64_t begin, int64_t end);
void rel_logits(const RelLogitsParams& p, int64_t begin, int64_t end);
void bucket_sum(const BucketSumParams& p, int64_t begin, int64_t end);
// Fused attention; work items differ from the scalar kernels (rel_attention_avx2.cpp):
//   rel_attention: (b, h, tile of kAttentionTileQ query rows); backward: (b, kv head).
void rel_attention(const RelAttentionParams& p, int64_t begin, int64_t end);
void rel_attention_backward(const RelAttentionBwdParams& p, int64_t begin, int64_t end);
}  // namespace avx2

constexpr int64_t kAttentionTileQ = 64;

}  // namespace relpos::cpu
