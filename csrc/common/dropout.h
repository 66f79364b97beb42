// Attention dropout: which probabilities p_ij of rel_attention are kept. One definition for the
// scalar, AVX2 and CUDA kernels (and the emulator); relpos_ext.reference.dropout_keep is the
// same function in PyTorch.
//
// A counter-based hash of (seed, b * H + h, i, j), so the forward and the backward draw the same
// mask without storing it, in any tiling and thread order:
//   head = mix(mix(seed_hi ^ (b * H + h)) + seed_lo)
//   row  = mix(head ^ (i * 0x9E3779B9))
//   u    = mix(row + j * 0x85EBCA6B)                      (all in uint32 arithmetic)
//   kept  <=>  (u >> 1) >= threshold,  threshold = min(floor(p * 2^31), 2^31 - 1)
// mix is a 32-bit integer finaliser with full avalanche (the "lowbias32" constants, C. Wellons).
// i and j are the row and key indices of the call (not positions: q_offset / k_offset do not
// move the mask). Kept probabilities are multiplied by 1 / (1 - p) (0 for p = 1); the
// normaliser of the softmax and the log-sum-exp are those without dropout, as in
// flash-attention and F.scaled_dot_product_attention.
#pragma once

#include <cstdint>

#include "macros.h"

namespace relpos {

constexpr uint32_t kDropoutRowMul = 0x9E3779B9u;
constexpr uint32_t kDropoutKeyMul = 0x85EBCA6Bu;

RELPOS_HD uint32_t dropout_mix(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

// The key of row i of (b, h), bh = b * H + h: `row` above (`head` folded in).
RELPOS_HD uint32_t dropout_row_key(uint64_t seed, int64_t bh, int64_t i) {
  const uint32_t lo = static_cast<uint32_t>(seed), hi = static_cast<uint32_t>(seed >> 32);
  const uint32_t head = dropout_mix(dropout_mix(hi ^ static_cast<uint32_t>(bh)) + lo);
  return dropout_mix(head ^ (static_cast<uint32_t>(i) * kDropoutRowMul));
}

RELPOS_HD bool dropout_kept(uint32_t row_key, int64_t j, uint32_t threshold) {
  return (dropout_mix(row_key + static_cast<uint32_t>(j) * kDropoutKeyMul) >> 1) >= threshold;
}

// What a kernel needs: off when p = 0 (threshold 0 keeps everything, and the kernels skip the
// hash). Built by the glue from dropout_p and the seed tensor.
struct DropoutParams {
  uint64_t seed = 0;
  uint32_t threshold = 0;   // in [0, 2^31 - 1]
  double keep_scale = 1.0;  // 1 / (1 - p), or 0 for p = 1 (kernels cast it to their acc type)
  bool on = false;          // p > 0
};

}  // namespace relpos
