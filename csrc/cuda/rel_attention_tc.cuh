// Fused Shaw attention forward on tensor cores (bfloat16 / float16, float32 accumulation), the
// FlashAttention-2 scheme (Dao 2023) with the relative terms of rel_attention.cuh done as matrix
// products too. The maths and the op's contract are rel_attention.cuh's; the launcher
// (rel_attention_tc.cu) takes this kernel only for what it covers (head dims that are multiples of
// 8 up to 128, zero-padded to kD = 32, 64, 96 or 128; up to 64 with rel_q; 16-byte aligned
// tensors; compute capability >= 8.0) and the SIMT kernel for the rest; the backward is
// rel_attention_tc_bwd.cuh's on the same cases (rel_q included, up to 64), else the SIMT one.
//
// A block of 4 warps owns 64 query rows (16 per warp, as the A operand of mma_16816, whose
// fragments of Q stay in registers up to kD = 64, and are read from shared memory at each use
// beyond, to stay within 255 registers without spilling) and walks key tiles of 64: S = Q K^T
// and O += P V on tensor cores, the online softmax on the S accumulators (a thread holds two
// rows, g and g + 8, and the four lanes of a row combine with two shuffles), P reused from
// registers as the A operand, V's fragments by ldmatrix .trans from V as stored ([key][d]).
// K and V reach shared memory by cp.async (tc_stage_async), so that their loads overlap: a tile's
// V, and its K unless the tile before prefetched it, are issued at its start, S waits for K
// alone, and once every warp has its S the next tile's K is issued, to land during P V. (The
// first version loaded each 16 bytes into a register and stored them, several times a tile, and
// timed at about 18 TFLOP/s on an H100.)
//
// Relative terms. For a (query tile, key tile) pair, with c = (j - j0) - (i - i0) + 63 in
// [0, 127), the distance is (k_offset + j0) - (q_offset + i0) - 63 + c: the bucket of every (i, j)
// is a function of c alone, clamped or not. So a pair that the band reaches stages the table rows
// of its 128 values of c (sRk, and rel_v transposed in sRvt; at kD = 128, and with rel_q, in sRk's
// space once the key term is done, TcTile::share_band), and then, per warp (its 16 rows meet the
// 80 values c in [48 - 16 w, 128 - 16 w)):
//   keys:   S_rel = Q sRk^T [16 x 80] on tensor cores, through the warp's scratch, and
//           s_ij += S_rel[i][c(i, j)] (the skew as a gather);
//   values: P scattered along the skew into the scratch (P'[i][c(i, j)] = p_ij, zero elsewhere),
//           O += P' sRv [80 x D] on tensor cores.
// A pair wholly beyond the band (every distance <= -K, or >= K) has one bucket: its key term is
// the row's q_i . rel_k[0] (or [2K]), and its probability mass goes to a per-row running sum
// applied as w rel_v[0] (or [2K]) at the end, as in the SIMT kernel. A rel_bias is one more
// function of c: staged per pair (sBias, times log2 e) and added after the scale, or one constant
// for a pair beyond the band. Dropout zeroes the probabilities that P V, P' rel_v and the
// clamped masses take (not the normaliser l) by the mask of common/dropout.h, and its factor
// 1 / (1 - p) multiplies their float32 sums at the end: P stays within [0, 1] where it is
// rounded to the dtype for the products (times the factor, float16 overflowed beyond
// p = 1 - 1/65504).
//
// The key-side table rel_q (kRelQ, s_ij += k_j . rel_q[b(i, j)] before the scale) is a function of
// (j, c): a pair the band reaches stages its 128 rows (sRq), warp w computes KR = K_w sRq^T for
// its 16 keys of the tile and their 80 values of c (c in [16 w, 16 w + 80)) into sKR, and after a
// barrier every (i, j) reads KR[j][c(i, j)]; beyond the band, k_j . rel_q[0] (or [2K]) per key,
// from the staged K tile (tc_key_side_clamped, as the backward).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cuda/mma.cuh"
#include "cuda/rel_attention.cuh"

namespace relpos::cuda {

// Every tensor-core kernel's block: 4 warps (tc_stage and the staging helpers stride by it).
inline constexpr int kTcThreads = 128;

template <int kD>
struct TcTile {
  static_assert(kD % 32 == 0 && kD <= 128, "head dims padded to 32, 64, 96 or 128");
  static constexpr int kThreads = kTcThreads, kWarps = 4;
  static constexpr int kRows = 64;       // query rows of a block, 16 per warp
  static constexpr int kKeys = 64;       // keys of a tile
  static_assert(kRows == kKeys, "c = (j - j0) - (i - i0) + 63 spans [0, 127) for 64 x 64 pairs");
  static constexpr int kBand = 128;      // staged table rows of a pair: c in [0, 128)
  static constexpr int kWarpBand = 80;   // a warp's values of c (79), five k-steps of 16
  // Row strides (elements) with 16 bytes of padding: the 8 rows x 4 words of a fragment load fall
  // in 32 different banks.
  static constexpr int kLdK = kD + 8;           // sQ, sK, sV, sRk: [row][d]
  static constexpr int kLdRvt = kBand + 8;      // sRvt: [d][c]
  static constexpr int kLdScr = kWarpBand + 4;  // a warp's float scratch [16][kLdScr]
  static constexpr int kLdP = kWarpBand + 8;    // the same scratch as P' [16][kLdP] elements
  static constexpr size_t kScrBytes = size_t(kWarps) * 16 * kLdScr * 4;
  static_assert(size_t(kRows) * kLdK * 2 <= kScrBytes, "sQ lives in the scratch before the loop");
  // Q's fragments in registers (else sQ keeps its own shared memory, after everything else).
  static constexpr bool kQRegs = kD <= 64;
  static constexpr size_t kRkBytes = 2 * size_t(kBand) * kLdK, kRvtBytes = 2 * size_t(kD) * kLdRvt;
  static constexpr int kLdKR = kBand + 4;  // sKR: [key][c] floats
  // kRelQ: sRq [kBand][kLdK] elements, sKR [kKeys][kLdKR] floats, sKq [kKeys] floats.
  static constexpr size_t kRelQBytes =
      2 * size_t(kBand) * kLdK + 4 * (size_t(kKeys) * kLdKR + kKeys);
  // Shared memory but sRk, sRvt: the scratch, sK, sV, sBias, rel_q's, and sQ beyond kQRegs.
  static constexpr size_t other_bytes(bool rel_q) {
    return kScrBytes + 4 * size_t(kKeys) * kLdK + kBand * 4 + (rel_q ? kRelQBytes : 0) +
           (kQRegs ? 0 : 2 * size_t(kRows) * kLdK);
  }
  // share_band: sRvt in sRk's space, staged once every warp is done with the key term (on band
  // pairs a staging after the softmax and one more barrier), where that is what lets two blocks
  // share a multiprocessor of sm_90 (228 KiB, of which 1 KiB a block is reserved); the registers
  // allow two at most. At kD = 128 it takes a block from 140.5 to 106.5 KiB, with rel_q at
  // kD = 64 from 125.8 to 108.8 KiB.
  static constexpr size_t kTwoBlocksBytes = 113 * 1024;
  static constexpr bool share_band(bool rel_q) {
    return other_bytes(rel_q) + kRkBytes + kRvtBytes > kTwoBlocksBytes;
  }
  static constexpr size_t band_bytes(bool rel_q) {
    return share_band(rel_q) ? (kRkBytes > kRvtBytes ? kRkBytes : kRvtBytes)
                             : kRkBytes + kRvtBytes;
  }
  // Layout: the scratch | sK | sV | sRk | sRvt (unless shared) | sBias | rel_q's | sQ.
  static constexpr size_t bias_offset(bool rel_q) {
    return kScrBytes + 4 * size_t(kKeys) * kLdK + band_bytes(rel_q);
  }
  static constexpr size_t q_offset(bool rel_q) {
    return bias_offset(rel_q) + kBand * 4 + (rel_q ? kRelQBytes : 0);
  }
  static constexpr size_t smem_bytes(bool rel_q) {
    return q_offset(rel_q) + (kQRegs ? 0 : 2 * size_t(kRows) * kLdK);
  }
};

// dst[r][c] (row stride ld elements) = row(r)[c] for r < rows, c < dim (a multiple of 8), and
// zero for dim <= c < kD, 16 bytes at a time; a null row(r) is zeros. row(r) must be 16-byte
// aligned. kTransposed: dst[c][r] instead, with
// consecutive threads on consecutive rows r, so that a warp's 16-bit stores to one dst row fill
// consecutive words (no bank conflicts).
template <typename T, int kD, bool kTransposed, typename RowFn>
RELPOS_DEVICE void tc_stage(T* dst, int ld, int rows, RowFn row, int dim) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(T)), kPerRow = kD / kVec;
  for (int idx = threadIdx.x; idx < rows * kPerRow; idx += kTcThreads) {
    const int r = kTransposed ? idx % rows : idx / kPerRow;
    const int c = (kTransposed ? idx / rows : idx % kPerRow) * kVec;
    const T* src = row(r);
    const Bits16 v = src == nullptr || c >= dim ? zero_bits<Bits16>()
                                                : *reinterpret_cast<const Bits16*>(src + c);
    if constexpr (kTransposed) {
      uint16_t e[kVec];
      std::memcpy(e, &v, sizeof(v));
      RELPOS_UNROLL
      for (int x = 0; x < kVec; ++x) dst[(c + x) * ld + r] = from_bits16<T>(e[x]);
    } else {
      *reinterpret_cast<Bits16*>(dst + r * ld + c) = v;
    }
  }
}

// dst[r][c] (row stride ld elements) = row(r)[c] for r < kRowsT, c < dim (a multiple of 8), and
// zero for dim <= c < kD, by cp_async16: issued, not awaited (the caller commits and waits); a
// null row(r) is zeros. row(r) and dst 16-byte aligned; `base`, a global address, is what the
// copies of zeros name as their source (cp.async reads nothing there).
template <typename T, int kD, int kRowsT, typename RowFn>
RELPOS_DEVICE void tc_stage_rows_async(T* dst, int ld, RowFn row, int dim, const T* base) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(T)), kPerRow = kD / kVec;
  static_assert(kRowsT * kPerRow % kTcThreads == 0, "whole rounds of 16-byte copies");
  RELPOS_NO_UNROLL
  for (int it = 0; it < kRowsT * kPerRow / kTcThreads; ++it) {
    const int idx = threadIdx.x + it * kTcThreads;
    const int r = idx / kPerRow, c = idx % kPerRow * kVec;
    const T* src = row(r);
    const bool ok = src != nullptr && c < dim;
    cp_async16(dst + r * ld + c, ok ? src + c : base, ok);
  }
}
// dst[r][c] = src[r * dim + c] for r < rows, zeros for the rest of kRowsT x kD.
template <typename T, int kD, int kRowsT>
RELPOS_DEVICE void tc_stage_async(T* dst, int ld, const T* src, int rows, int dim) {
  tc_stage_rows_async<T, kD, kRowsT>(
      dst, ld, [&](int r) { return r < rows ? src + r * dim : nullptr; }, dim, src);
}

// Rows c < rows of a band pair's table slice: dst[c] = table row b(dbase + c) (clamped to
// [0, 2K]), as tc_stage lays them out.
template <typename T, int kD, bool kTransposed = false>
RELPOS_DEVICE void tc_stage_band(T* dst, int ld, int rows, const T* table, int64_t dbase,
                                 int64_t K, int dim) {
  tc_stage<T, kD, kTransposed>(
      dst, ld, rows, [&](int c) { return table + clamp_bucket(dbase + c, K) * dim; }, dim);
}
// The same, kRowsT rows, by cp.async (tc_stage_rows_async), for a staging in the middle of a pair,
// where tc_stage's loads in flight, held in registers beside the accumulators, made ptxas spill
// (the backward's share_tables at kD = 128).
template <typename T, int kD, int kRowsT>
RELPOS_DEVICE void tc_stage_band_async(T* dst, int ld, const T* table, int64_t dbase, int64_t K,
                                       int dim) {
  tc_stage_rows_async<T, kD, kRowsT>(
      dst, ld, [&](int c) { return table + clamp_bucket(dbase + c, K) * dim; }, dim, table);
}
// The same for rel_bias, in base 2 (times log2 e, as the logits): dst[c] = bias[b(dbase + c)].
template <typename T>
RELPOS_DEVICE void tc_stage_band_bias(float* dst, int rows, const T* bias, int64_t dbase,
                                      int64_t K) {
  for (int c = threadIdx.x; c < rows; c += kTcThreads) {
    dst[c] = to_float(bias[clamp_bucket(dbase + c, K)]) * static_cast<float>(kLog2e);
  }
}

// Beyond the band, the key-side table rel_q's term of a tile's 64 keys: dst[j] = k_j . e (e:
// rel_q[0] or rel_q[2K], its dim elements in shared or global memory) from the staged key tile sk
// [key][d] (rows ld elements apart, zero beyond dim and beyond the tile's keys, which so get 0).
// Two threads a key, each half of kD, then one shuffle; every load is issued at once. (It read
// the keys from global memory in a scalar loop once, and made the rel_q forward 2.7x slower.)
template <typename T, int kD>
RELPOS_DEVICE void tc_key_side_clamped(float* dst, const T* sk, int ld, const T* e, int dim) {
  static_assert(kTcThreads == 2 * 64, "two threads a key");
  const int jj = threadIdx.x / 2, half = threadIdx.x % 2 * (kD / 2);
  const T* kr = sk + jj * ld + half;
  float x = 0;
  RELPOS_UNROLL
  for (int d = 0; d < kD / 2; ++d) {
    if (half + d < dim) x += to_float(kr[d]) * to_float(e[half + d]);
  }
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  if (threadIdx.x % 2 == 0) dst[jj] = x;
}

// Where a tile pair (query rows [i0, i0 + Tl::kRows), keys [j0, j0 + Tl::kKeys)) stands against
// the band: dbase is the distance of c = 0 (row i0 + kRows - 1, key j0), c = (j - j0) - (i - i0) +
// kRows - 1 adds one a step up to kRows + kKeys - 2; all_lo: every distance <= -K (bucket 0),
// all_hi: every one >= K (bucket 2K); band: neither.
struct TcPair {
  int64_t dbase;
  bool all_lo, all_hi, band;
};
template <typename Tl>
RELPOS_DEVICE TcPair tc_pair(const RelAttentionParams& p, int64_t i0, int64_t j0, int64_t K) {
  const int64_t dbase = rel_distance(i0 + Tl::kRows - 1, j0, p.q_offset, p.k_offset);
  const bool all_lo = dbase + Tl::kRows + Tl::kKeys - 2 <= -K;
  const bool all_hi = dbase >= K;
  return {dbase, all_lo, all_hi, !all_lo && !all_hi};
}

// Masks checked per element; the causal limit and the key range are checked per tile pair
// (tc_pair_full).
RELPOS_DEVICE bool tc_elem_masks(const RelAttentionParams& p) {
  return p.key_padding_mask != nullptr || p.attn_mask != nullptr || p.q_segment_ids != nullptr ||
         p.window_left >= 0 || p.window_right >= 0;
}
// Whether every (i, j) of the pair is visible with no check per element: a whole key tile, no
// per-element masks, and (causal) its last key at or before the first row's position.
template <typename Tl>
RELPOS_DEVICE bool tc_pair_full(const RelAttentionParams& p, bool elem_masks, int64_t i0,
                                int64_t j0) {
  return j0 + Tl::kKeys <= p.k_len && !elem_masks &&
         (!p.causal || p.k_offset + j0 + Tl::kKeys - 1 <= p.q_offset + i0);
}

// NaN-propagating maximum (a NaN logit makes its row NaN, as in the SIMT kernel).
RELPOS_DEVICE float tc_max(float a, float b) { return b > a || b != b ? b : a; }

// Bit 4 nt + e of the result: pred(nt, e), for element e of n-tile nt of a thread's mma_16816
// accumulators (kNT n-tiles, at most 8). The key loops take per-element masks and dropout as
// such bits, worked out before their unrolled element loops and outside them: inlined there,
// attn_visible and the dropout hash were copied once per element and made the kernels long
// enough that ncu on the H200 found "no instruction" (instruction-cache misses) their top stall.
// kUnroll = false: a loop that is not unrolled, one copy of pred (attn_visible, too long to copy
// 32 times); true: unrolled (the dropout hash, short, and taken on every pair when it is on).
template <int kNT, bool kUnroll, typename Pred>
RELPOS_DEVICE uint32_t tc_elem_bits(Pred pred) {
  static_assert(kNT * 4 <= 32, "a bit per element: at most 8 n-tiles");
  uint32_t bits = 0;
  if constexpr (kUnroll) {
    RELPOS_UNROLL
    for (int x = 0; x < kNT * 4; ++x) bits |= static_cast<uint32_t>(pred(x / 4, x % 4)) << x;
  } else {
    RELPOS_NO_UNROLL
    for (int x = 0; x < kNT * 4; ++x) bits |= static_cast<uint32_t>(pred(x / 4, x % 4)) << x;
  }
  return bits;
}
RELPOS_DEVICE bool tc_bit(uint32_t bits, int nt, int e) { return (bits >> (4 * nt + e)) & 1u; }
// Dropout's kept elements as tc_elem_bits, for a thread whose rows g and g + 8 have the row keys
// drop_key and whose element (nt, e) has key j_lane + 8 nt + e % 2 (the forward's and dq's S).
template <int kNT>
RELPOS_DEVICE uint32_t tc_row_kept_bits(const RelAttentionParams& p, const uint32_t (&drop_key)[2],
                                        int64_t j_lane) {
  return tc_elem_bits<kNT, true>([&](int nt, int e) {
    return dropout_kept(drop_key[e / 2], j_lane + nt * 8 + e % 2, p.dropout.threshold);
  });
}
// Dropout's factor of element (nt, e) from its kept bits: attn_dropout's keep_scale, or 0.
RELPOS_DEVICE float tc_drop_factor(const RelAttentionParams& p, uint32_t kept, int nt, int e) {
  return tc_bit(kept, nt, e) ? static_cast<float>(p.dropout.keep_scale) : 0.f;
}
// The element loops' first passes, each run only where it has work, so that a full tile pair
// without a bias takes the scale alone before its exponentials.
// s <- s * scale2 + bias(nt, e) (with_bias) or s * scale2: each product rounded before its add
// (__fmul_rn, no FMA), the rounding of the loops that added the bias after the scale.
template <int kNT, typename Bias>
RELPOS_DEVICE void tc_scale_logits(float (&s)[kNT][4], float scale2, bool with_bias, Bias&& bias) {
  if (with_bias) {
    RELPOS_UNROLL
    for (int nt = 0; nt < kNT; ++nt) {
      RELPOS_UNROLL
      for (int e = 0; e < 4; ++e) s[nt][e] = __fmul_rn(s[nt][e], scale2) + bias(nt, e);
    }
  } else {
    RELPOS_UNROLL
    for (int nt = 0; nt < kNT; ++nt) {
      RELPOS_UNROLL
      for (int e = 0; e < 4; ++e) s[nt][e] = __fmul_rn(s[nt][e], scale2);
    }
  }
}
// s <- -inf where hides(nt, e) (as tc_elem_bits), unless the pair is full (tc_pair_full).
template <int kNT, typename Hides>
RELPOS_DEVICE void tc_hide_elems(float (&s)[kNT][4], bool full, Hides&& hides) {
  if (full) return;
  const uint32_t hidden = tc_elem_bits<kNT, false>(hides);
  RELPOS_UNROLL
  for (int nt = 0; nt < kNT; ++nt) {
    RELPOS_UNROLL
    for (int e = 0; e < 4; ++e) {
      if (tc_bit(hidden, nt, e)) s[nt][e] = -INFINITY;
    }
  }
}
// f(std::true_type{}) when dropout is on, else f(std::false_type{}): an element loop compiled with
// and without dropout's factor (1 without it: the same values, two multiplies fewer).
template <typename F>
RELPOS_DEVICE void tc_with_dropout(const RelAttentionParams& p, F&& f) {
  if (p.dropout.on) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

// (At least 1 block a multiprocessor, which is also the default: spelt out, it keeps ptxas from
// holding the D = 32 rel_q build to 168 registers on sm_80, where it spilled.)
template <typename T, int kD, bool kRelQ>
__global__ void __launch_bounds__(TcTile<kD>::kThreads, 1)
    rel_attention_tc_fwd_kernel(RelAttentionParams p) {
  using Tl = TcTile<kD>;
  constexpr int kNT = Tl::kKeys / 8;  // n-tiles of S
  constexpr int kDT = kD / 8;         // n-tiles of O
  constexpr int kDK = kD / 16;        // k-steps over the head dim
  constexpr int kCT = Tl::kWarpBand / 8, kCK = Tl::kWarpBand / 16;  // n-tiles, k-steps over c
  static_assert(kCT % 2 == 0);
  RELPOS_DYNAMIC_SMEM(unsigned char, smem);
  float* scr_all = reinterpret_cast<float*>(smem);
  // The scratch before the key loop, or (not kQRegs) its own space.
  T* sQ = reinterpret_cast<T*>(smem + (Tl::kQRegs ? 0 : Tl::q_offset(kRelQ)));
  T* sK = reinterpret_cast<T*>(smem + Tl::kScrBytes);
  T* sV = sK + Tl::kKeys * Tl::kLdK;
  T* sRk = sV + Tl::kKeys * Tl::kLdK;
  constexpr bool kShareBand = Tl::share_band(kRelQ);
  T* sRvt = kShareBand ? sRk : sRk + Tl::kBand * Tl::kLdK;
  float* sBias = reinterpret_cast<float*>(smem + Tl::bias_offset(kRelQ));  // [kBand]
  T* sRq = reinterpret_cast<T*>(sBias + Tl::kBand);               // kRelQ only
  float* sKR = reinterpret_cast<float*>(sRq + Tl::kBand * Tl::kLdK);
  float* sKq = sKR + Tl::kKeys * Tl::kLdKR;

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t4 = lane % 4;
  const int64_t q_tiles = (p.q_len + Tl::kRows - 1) / Tl::kRows;
  const int64_t bh = blockIdx.x / q_tiles, h = bh % p.heads, b = bh / p.heads;
  const int64_t i0 = (blockIdx.x % q_tiles) * Tl::kRows;
  const int nq = static_cast<int>(p.q_len - i0 < Tl::kRows ? p.q_len - i0 : Tl::kRows);
  const int64_t K = p.max_distance, table_rows = num_buckets(K);
  const int D = static_cast<int>(p.dim);  // a multiple of 8, at most kD: zero-padded to kD
  const int64_t kvh = b * p.kv_heads + h / (p.heads / p.kv_heads);
  const T* q = static_cast<const T*>(p.q) + (bh * p.q_len + i0) * D;
  const T* k = static_cast<const T*>(p.k) + kvh * p.kv_stride;
  const T* v = static_cast<const T*>(p.v) + kvh * p.kv_stride;
  const T* ek = head_table<T>(p.rel_k, p.rel_k_per_head, h, table_rows * D);
  const T* ev = head_table<T>(p.rel_v, p.rel_v_per_head, h, table_rows * D);
  const T* eq = kRelQ ? head_table<T>(p.rel_q, p.rel_q_per_head, h, table_rows * D) : nullptr;
  const T* eb = head_table<T>(p.rel_bias, p.rel_bias_per_head, h, table_rows);
  const float scale2 = static_cast<float>(p.scale * kLog2e);  // logits in base 2
  // A bias beyond the band on either side, in base 2.
  const float blo = eb == nullptr ? 0.f : to_float(eb[0]) * static_cast<float>(kLog2e);
  const float bhi = eb == nullptr ? 0.f : to_float(eb[table_rows - 1]) * static_cast<float>(kLog2e);
  uint32_t drop_key[2] = {0, 0};  // the dropout row keys of rows g and g + 8
  RELPOS_UNROLL
  for (int r = 0; r < 2; ++r) drop_key[r] = attn_dropout_key(p, bh, i0 + warp * 16 + g + 8 * r);

  tc_stage<T, kD, false>(sQ, Tl::kLdK, Tl::kRows,
                         [&](int r) { return r < nq ? q + static_cast<int64_t>(r) * D : nullptr; },
                         D);
  __syncthreads();
  const T* qw = sQ + warp * 16 * Tl::kLdK;  // the warp's rows
  // The A fragment of k-step kk of the warp's 16 rows of Q.
  uint32_t qf[Tl::kQRegs ? kDK : 1][4];
  if constexpr (Tl::kQRegs) {
    RELPOS_UNROLL
    for (int kk = 0; kk < kDK; ++kk) load_a_frag(qf[kk], qw + kk * 16, Tl::kLdK, lane);
  }
  auto q_frag = [&](int kk, uint32_t (&a)[4]) {
    if constexpr (Tl::kQRegs) {
      a[0] = qf[kk][0];
      a[1] = qf[kk][1];
      a[2] = qf[kk][2];
      a[3] = qf[kk][3];
    } else {
      load_a_frag(a, qw + kk * 16, Tl::kLdK, lane);
    }
  };
  // q_i . rel_k[0] and q_i . rel_k[2K] of this thread's rows g and g + 8 ([0] and [1]): lane
  // 2 r + x computes row r's dot with rel_k[x ? 2K : 0].
  float qlo[2] = {0, 0}, qhi[2] = {0, 0};
  if (ek != nullptr) {
    const T* qr = qw + (lane / 2) * Tl::kLdK;
    const T* e = ek + (lane % 2 ? (table_rows - 1) * D : 0);
    float s = 0;
    for (int d = 0; d < D; ++d) s += to_float(qr[d]) * to_float(e[d]);
    RELPOS_UNROLL
    for (int r = 0; r < 2; ++r) {
      qlo[r] = __shfl_sync(0xffffffffu, s, 2 * (g + 8 * r));
      qhi[r] = __shfl_sync(0xffffffffu, s, 2 * (g + 8 * r) + 1);
    }
  }

  float o[kDT][4], m[2], l[2], wlo[2], whi[2];
  zero_acc(o);
  RELPOS_UNROLL
  for (int r = 0; r < 2; ++r) {
    m[r] = -INFINITY;
    l[r] = wlo[r] = whi[r] = 0;
  }
  const bool elem_masks = tc_elem_masks(p);
  float* scr = scr_all + warp * 16 * Tl::kLdScr;
  T* pw = reinterpret_cast<T*>(scr);
  const int cw = Tl::kKeys - 16 - 16 * warp;  // the warp's first c: 63 - (16 w + 15)

  // K and V go to shared memory by cp.async: a tile's V, and K unless the previous tile prefetched
  // it, are issued at its start; S waits for K only, P V for V; once every warp has its S, the
  // next tile's K is issued into sK, to land during this tile's P V. k_next: the tile whose K is
  // in sK or on its way there.
  const int64_t key_end = attn_key_end(p, i0, nq);
  int64_t k_next = -1;
  for (int64_t j0 = attn_key_begin(p, i0) / Tl::kKeys * Tl::kKeys; j0 < key_end; j0 += Tl::kKeys) {
    const int nk = static_cast<int>(p.k_len - j0 < Tl::kKeys ? p.k_len - j0 : Tl::kKeys);
    if (has_tile_masks(p) && attn_tile_hidden<Tl>(p, b, h, i0, nq, j0, nk)) {
      cp_async_wait<0>();  // a K prefetched for this tile lands before the next one's overwrites it
      continue;
    }
    const TcPair pair = tc_pair<Tl>(p, i0, j0, K);
    const int64_t dbase = pair.dbase;
    const bool all_lo = pair.all_lo, all_hi = pair.all_hi, band = pair.band;
    __syncthreads();  // the previous tile's readers of sV, sRk, sRvt and the scratch are done
    if (k_next != j0) tc_stage_async<T, kD, Tl::kKeys>(sK, Tl::kLdK, k + j0 * D, nk, D);
    cp_async_commit();  // K's group (empty if prefetched: that group came before)
    tc_stage_async<T, kD, Tl::kKeys>(sV, Tl::kLdK, v + j0 * D, nk, D);
    cp_async_commit();
    if (band && ek != nullptr) tc_stage_band<T, kD>(sRk, Tl::kLdK, Tl::kBand, ek, dbase, K, D);
    // With kShareBand and a key table, rel_v's rows wait until the key term is done (below).
    const bool late_rv = kShareBand && band && ev != nullptr && ek != nullptr;
    if (band && ev != nullptr && !late_rv) {
      tc_stage_band<T, kD, true>(sRvt, Tl::kLdRvt, Tl::kBand, ev, dbase, K, D);
    }
    if (band && eb != nullptr) tc_stage_band_bias(sBias, Tl::kBand, eb, dbase, K);
    if constexpr (kRelQ) {
      if (band) tc_stage_band<T, kD>(sRq, Tl::kLdK, Tl::kBand, eq, dbase, K, D);
    }
    cp_async_wait<1>();  // K (every group but V's)
    __syncthreads();

    // S = Q K^T
    float s[kNT][4];
    zero_acc(s);
    warp_mma_bt<T, kNT, kDK>(s, q_frag, sK, Tl::kLdK, lane);
    // + k_j . rel_q[b(i, j)]: KR for the warp's 16 keys and 80 values of c, then (after every
    // warp's) the gather along the skew; one value per key beyond the band.
    if constexpr (kRelQ) {
      if (!band) {
        tc_key_side_clamped<T, kD>(sKq, sK, Tl::kLdK, eq + (all_lo ? 0 : (table_rows - 1) * D), D);
      } else {
        constexpr int kHalf = kCT / 2;
        RELPOS_UNROLL
        for (int half = 0; half < 2; ++half) {
          const int c0 = 16 * warp + half * kHalf * 8;  // the half's first c
          float kr[kHalf][4];
          zero_acc(kr);
          warp_mma_bt<T, kHalf, kDK>(
              kr,
              [&](int kk, uint32_t (&a)[4]) {
                load_a_frag(a, sK + 16 * warp * Tl::kLdK + kk * 16, Tl::kLdK, lane);
              },
              sRq + c0 * Tl::kLdK, Tl::kLdK, lane);
          store_acc(sKR + 16 * warp * Tl::kLdKR + c0, Tl::kLdKR, kr, lane);
        }
      }
      __syncthreads();  // sKR rows, or sKq, come from every warp
      RELPOS_UNROLL
      for (int nt = 0; nt < kNT; ++nt) {
        RELPOS_UNROLL
        for (int e = 0; e < 4; ++e) {
          const int jj = nt * 8 + 2 * t4 + e % 2, i = 16 * warp + g + (e / 2) * 8;
          s[nt][e] += band ? sKR[jj * Tl::kLdKR + jj - i + Tl::kKeys - 1] : sKq[jj];
        }
      }
    }
    // + q_i . rel_k[b(i, j)]
    if (ek != nullptr && band) {
      // S_rel in two halves of the warp's c (fewer live registers), each through the scratch.
      constexpr int kHalf = kCT / 2;
      RELPOS_UNROLL
      for (int half = 0; half < 2; ++half) {
        float sr[kHalf][4];
        zero_acc(sr);
        warp_mma_bt<T, kHalf, kDK>(sr, q_frag, sRk + (cw + half * kHalf * 8) * Tl::kLdK,
                                   Tl::kLdK, lane);
        store_acc(scr + half * kHalf * 8, Tl::kLdScr, sr, lane);
      }
      __syncwarp();
      RELPOS_UNROLL
      for (int nt = 0; nt < kNT; ++nt) {
        RELPOS_UNROLL
        for (int e = 0; e < 4; ++e) {
          const int r = g + (e / 2) * 8, jj = nt * 8 + 2 * t4 + e % 2;
          s[nt][e] += scr[r * Tl::kLdScr + jj - r + 15];
        }
      }
      __syncwarp();  // the scratch is read before P' overwrites it
    } else if (ek != nullptr) {
      RELPOS_UNROLL
      for (int nt = 0; nt < kNT; ++nt) {
        RELPOS_UNROLL
        for (int e = 0; e < 4; ++e) s[nt][e] += all_lo ? qlo[e / 2] : qhi[e / 2];
      }
    }

    // Scale to base 2 (+ rel_bias[b] * log2 e after the scale), mask, online softmax. Each pass
    // over the elements runs only where it has work (the bias, the masks, dropout), so that the
    // common pair, a whole tile with none of them, takes the scale, the maximum and the
    // exponentials alone.
    tc_scale_logits<kNT>(s, scale2, eb != nullptr, [&](int nt, int e) {
      const int r = g + (e / 2) * 8, jj = nt * 8 + 2 * t4 + e % 2;
      return band ? sBias[cw + jj - r + 15] : (all_lo ? blo : bhi);
    });
    tc_hide_elems<kNT>(s, tc_pair_full<Tl>(p, elem_masks, i0, j0), [&](int nt, int e) {
      const int64_t i = i0 + warp * 16 + g + (e / 2) * 8, j = j0 + nt * 8 + 2 * t4 + e % 2;
      return !attn_visible(p, b, h, i, j);
    });
    float mt[2] = {-INFINITY, -INFINITY};
    RELPOS_UNROLL
    for (int nt = 0; nt < kNT; ++nt) {
      RELPOS_UNROLL
      for (int e = 0; e < 4; ++e) mt[e / 2] = tc_max(mt[e / 2], s[nt][e]);
    }
    float alpha[2], mz[2];
    RELPOS_UNROLL
    for (int r = 0; r < 2; ++r) {
      mt[r] = tc_max(mt[r], __shfl_xor_sync(0xffffffffu, mt[r], 1));
      mt[r] = tc_max(mt[r], __shfl_xor_sync(0xffffffffu, mt[r], 2));
      const float mn = tc_max(m[r], mt[r]);
      alpha[r] = mn == -INFINITY ? 1.f : exp2_acc(m[r] - mn);
      m[r] = mn;
      // A row with no visible key yet has every s at -inf: 2^(s - 0) = 0, where s - m is NaN.
      mz[r] = mn == -INFINITY ? 0.f : mn;
    }
    // rs: the row sums for l; rd: of the kept elements, for the clamped masses (s keeps the
    // latter).
    float rs[2] = {0, 0}, rd[2];
    RELPOS_UNROLL
    for (int nt = 0; nt < kNT; ++nt) {
      RELPOS_UNROLL
      for (int e = 0; e < 4; ++e) {
        s[nt][e] = exp2_acc(s[nt][e] - mz[e / 2]);
        rs[e / 2] += s[nt][e];
      }
    }
    if (p.dropout.on) {
      const uint32_t kept = tc_row_kept_bits<kNT>(p, drop_key, j0 + 2 * t4);
      rd[0] = rd[1] = 0;
      RELPOS_UNROLL
      for (int nt = 0; nt < kNT; ++nt) {
        RELPOS_UNROLL
        for (int e = 0; e < 4; ++e) {
          if (!tc_bit(kept, nt, e)) s[nt][e] = 0.f;
          rd[e / 2] += s[nt][e];
        }
      }
    } else {
      rd[0] = rs[0];
      rd[1] = rs[1];
    }
    RELPOS_UNROLL
    for (int r = 0; r < 2; ++r) {
      l[r] = l[r] * alpha[r] + rs[r];
      wlo[r] = wlo[r] * alpha[r] + (all_lo ? rd[r] : 0.f);
      whi[r] = whi[r] * alpha[r] + (all_hi ? rd[r] : 0.f);
    }
    RELPOS_UNROLL
    for (int nt = 0; nt < kDT; ++nt) {
      o[nt][0] *= alpha[0];
      o[nt][1] *= alpha[0];
      o[nt][2] *= alpha[1];
      o[nt][3] *= alpha[1];
    }

    cp_async_wait<0>();  // V
    __syncthreads();     // V visible; every warp is done with sK (and sRk)
    if (j0 + Tl::kKeys < key_end) {
      const int64_t jn = j0 + Tl::kKeys;
      const int nkn = static_cast<int>(p.k_len - jn < Tl::kKeys ? p.k_len - jn : Tl::kKeys);
      tc_stage_async<T, kD, Tl::kKeys>(sK, Tl::kLdK, k + jn * D, nkn, D);
      k_next = jn;
    }
    cp_async_commit();
    if (late_rv) tc_stage_band<T, kD, true>(sRvt, Tl::kLdRvt, Tl::kBand, ev, dbase, K, D);

    // O += P V, P from the S registers, V's fragments by ldmatrix .trans.
    warp_mma_kn_x4<T, kDT, Tl::kKeys / 16>(
        o, [&](int kk, uint32_t (&a)[4]) { acc_a_frag<T>(a, s, kk); }, sV, Tl::kLdK, lane);
    if (late_rv) __syncthreads();  // sRvt from every thread
    // + P' rel_v[b(i, j)]: P along the skew in the scratch, then one more product.
    if (ev != nullptr && band) {
      for (int idx = lane; idx < 16 * Tl::kLdP / 2; idx += 32) st32(pw + 2 * idx, 0u);
      __syncwarp();
      RELPOS_UNROLL
      for (int nt = 0; nt < kNT; ++nt) {
        RELPOS_UNROLL
        for (int e = 0; e < 4; ++e) {
          const int r = g + (e / 2) * 8, jj = nt * 8 + 2 * t4 + e % 2;
          pw[r * Tl::kLdP + jj - r + 15] = from_float<T>(s[nt][e]);
        }
      }
      __syncwarp();
      warp_mma_bt<T, kDT, kCK>(
          o, [&](int kk, uint32_t (&a)[4]) { load_a_frag(a, pw + kk * 16, Tl::kLdP, lane); },
          sRvt + cw, Tl::kLdRvt, lane);
    }
  }

  // out = f (O + w_lo rel_v[0] + w_hi rel_v[2K]) / l, with dropout's factor f (else 1); rows
  // without a visible key: 0 and lse = +inf.
  const float drop_scale = static_cast<float>(p.dropout.keep_scale);  // 1 without dropout
  T* out = static_cast<T*>(p.out) + (bh * p.q_len + i0) * D;
  float* lse = static_cast<float*>(p.lse) + bh * p.q_len + i0;
  RELPOS_UNROLL
  for (int r = 0; r < 2; ++r) {
    RELPOS_UNROLL
    for (int x = 1; x <= 2; x *= 2) {
      l[r] += __shfl_xor_sync(0xffffffffu, l[r], x);
      wlo[r] += __shfl_xor_sync(0xffffffffu, wlo[r], x);
      whi[r] += __shfl_xor_sync(0xffffffffu, whi[r], x);
    }
    const int row = warp * 16 + g + 8 * r;
    if (row >= nq) continue;
    const bool empty = m[r] == -INFINITY || l[r] == 0.f;
    const float inv = empty ? 0.f : drop_scale / l[r];
    RELPOS_UNROLL
    for (int nt = 0; nt < kDT; ++nt) {
      if (nt * 8 >= D) break;  // the zero padding of D up to kD
      const int d = nt * 8 + 2 * t4;
      float o0 = o[nt][2 * r], o1 = o[nt][2 * r + 1];
      if (ev != nullptr) {
        const T* e0 = ev;
        const T* e1 = ev + (table_rows - 1) * D;
        o0 += wlo[r] * to_float(e0[d]) + whi[r] * to_float(e1[d]);
        o1 += wlo[r] * to_float(e0[d + 1]) + whi[r] * to_float(e1[d + 1]);
      }
      st32(out + row * D + d, empty ? 0u : pack2<T>(o0 * inv, o1 * inv));
    }
    if (t4 == 0) lse[row] = empty ? INFINITY : m[r] * static_cast<float>(kLn2) + logf(l[r]);
  }
}

}  // namespace relpos::cuda
