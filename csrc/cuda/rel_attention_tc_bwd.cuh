// Fused Shaw attention backward on tensor cores (bfloat16 / float16 operands, float32
// accumulation), from the forward's out and lse: FlashAttention-2's backward (Dao 2023) with the
// relative terms as matrix products along the skew, as the tensor-core forward
// (rel_attention_tc.cuh) does them. The maths: RelAttentionBwdParams (common/params.h); the per-row
// terms D_i = dO_i . O_i and the four clamped dots come from the SIMT rows kernel
// (rel_attention.cuh, the workspace ws). The launcher (rel_attention_tc.cu) takes these kernels for
// what they cover (as the forward's) and the SIMT kernels for the rest.
//
// Two kernels, each recomputing the probabilities of its tile pairs. Their tiles are sized so that
// the fragments of a pair (S and dP, 16 or 32 floats a thread each) fit in registers beside the
// accumulators (dq, or dk and dv: up to 64 floats each) with no spills on sm_80 and sm_90:
//   dq kernel    per query tile of 64 rows (4 warps x 16 rows), over key tiles of 64 keys (32 at
//                kD = 128; TcBwdTile):
//                S = Q K^T, dP = dO V^T, P = exp2(S - lse), dS = P (dP - D_i), dq += dS K;
//                with the relative terms of the pairs the band reaches, per warp:
//                  S += gather(Q Rk^T), dP += gather(dO Rv^T) (the skew, through a scratch),
//                  dq += dS' Rk (dS' = dS scattered along the skew, c = (j - j0) - (i - i0) + 63),
//                and per block, into the table-gradient partials (atomicAdd per bucket of c):
//                  drel_k += dS'^T Q, drel_v += P'^T dO, drel_bias += column sums of dS',
//                for the inner buckets; the (i, j) of the clamped buckets 0 and 2K (the pairs
//                beyond the band, and those parts of the others) add per-row dS and P masses,
//                applied at the end (dq += scale m rel_k[0 or 2K], drel_k[0 or 2K] += scale
//                sum_i m_i q_i, ...).
//   dkdv kernel  per key tile of 64 keys of a kv head (4 warps x 16 keys), over the group's query
//                heads and their query tiles of 32 rows (TcBwdKvTile): first, for a band pair,
//                the relative logits (Rk Q^T) and (Rv dO^T) per block for the 95 values of c
//                (c = (j - j0) - (i - i0) + 31); then S^T = K Q^T and dP^T = V dO^T, each with
//                its relative term gathered along the skew, dv += P^T dO, dk += dS^T Q; with
//                rel_q also dk += dS' Rq and drel_q (tc_bwd_dkdv_tile).
// Under dropout dS = p (f dP - D_i), and P in dv, drel_v and the P masses is p where the key is
// kept (else 0), their float32 sums times f = 1 / (1 - p) at the end: P stays within [0, 1] where
// it is rounded to the dtype (times f, float16 overflowed beyond p = 1 - 1/65504).
#pragma once

#include <cstdint>

#include "cuda/mma.cuh"
#include "cuda/rel_attention.cuh"
#include "cuda/rel_attention_tc.cuh"

namespace relpos::cuda {

// The dq kernel's tile pair (the dk/dv kernel's: TcBwdKvTile): 64 query rows (4 warps x 16)
// against 64 keys, or 32 at kD = 128, where S and dP of 64 keys beside dq spill on sm_80.
// c = (j - j0) - (i - i0) + kRows - 1.
template <int kD>
struct TcBwdTile {
  static_assert(kD % 32 == 0 && kD <= 128, "head dims padded to 32, 64, 96 or 128");
  static constexpr int kThreads = kTcThreads, kWarps = 4;
  static constexpr int kRows = 64, kKeys = kD > 96 ? 32 : 64;
  static constexpr int kBand = kRows + kKeys;   // c in [0, kBand - 1) (and one zero row)
  static constexpr int kWarpBand = 16 + kKeys;  // c of a warp's 16 rows: [cw, cw + kWarpBand - 1)
  static constexpr int kLdK = kD + 8;           // [row][d] tiles (T), 16 bytes of padding
  static constexpr int kLdT = kRows + 8;        // sDSt, sPt: [c][row] (T)
  static constexpr int kLdScr = kWarpBand + 4;  // a warp's float scratch [16][kLdScr]
  static constexpr size_t kTable = size_t(kBand) * kLdK * 2;  // one [kBand][kLdK] table slice
  // sQ sG [kRows][kLdK] | sK sV [kKeys][kLdK] | sRk | sRv (unless shared), the warps' scratch
  // (which sDSt, sPt overlay once dP is complete) | sBias [kBand] | sMass [kRows][4] | sDots
  // [kRows][4] | rel_q's
  static constexpr size_t kScr = size_t(kWarps) * 16 * kLdScr * 4;
  static constexpr size_t kDsPt = 2 * size_t(kBand) * kLdT * 2;
  static constexpr size_t overlay(bool share) {
    const size_t tables_scr = (share ? 0 : kTable) + kScr;  // sRv (unless shared), the scratch
    return tables_scr > kDsPt ? tables_scr : kDsPt;
  }
  // kRelQ (up to kD = 64, as the forward: kKeys = 64): sRq [kBand][kLdK] | sKR [kKeys][kLdKR]
  // floats (k_j . rel_q[c], as the forward's) | sKq [kKeys] floats (k_j . rel_q[0 or 2K] beyond
  // the band)
  static constexpr int kLdKR = kBand + 4;
  static constexpr size_t kDqRelQ = kTable + size_t(kKeys) * kLdKR * 4 + kKeys * 4;
  static constexpr size_t dq_bytes(bool share, bool rel_q) {
    return size_t(2 * kRows + 2 * kKeys) * kLdK * 2 + kTable + overlay(share) + kBand * 4 +
           2 * kRows * 4 * 4 + (rel_q ? kDqRelQ : 0);
  }
  // share_tables: rel_k's and rel_v's band slices take turns in one buffer (rel_v's first, for
  // dP; then rel_k's, for S and dq += dS' Rk: on band pairs one more staging and two more
  // barriers) where that is what lets two blocks share a multiprocessor of sm_90
  // (TcTile::kTwoBlocksBytes; the registers allow two at most), as the forward's share_band: at
  // kD = 128 from 117.4 to 105.9 KiB (at kD = 96 it would take 127.5 to 116.5 KiB, still one).
  static constexpr bool share_tables(bool rel_q) {
    return dq_bytes(false, rel_q) > TcTile<kD>::kTwoBlocksBytes &&
           dq_bytes(true, rel_q) <= TcTile<kD>::kTwoBlocksBytes;
  }
  static constexpr size_t dq_smem(bool rel_q) { return dq_bytes(share_tables(rel_q), rel_q); }
  static constexpr size_t dq_base(bool rel_q) { return dq_smem(rel_q) - (rel_q ? kDqRelQ : 0); }
};

// The dk/dv kernel's tile pair: 64 keys (4 warps x 16) against 32 query rows, so that S^T and
// dP^T (16 floats a thread each) fit beside dk and dv (64 each at kD = 128) without spills, and
// both tables' relative logits can be computed up front. c = (j - j0) - (i - i0) + kRows - 1.
template <int kD>
struct TcBwdKvTile {
  static_assert(kD % 32 == 0 && kD <= 128, "head dims padded to 32, 64, 96 or 128");
  static constexpr int kThreads = kTcThreads, kWarps = 4;
  static constexpr int kRows = 32, kKeys = 64;
  static constexpr int kBand = kRows + kKeys;  // c in [0, 95) (and one zero row)
  static constexpr int kWarpBand = 48;         // c of a warp's 16 keys: [16 w, 16 w + 47)
  static constexpr int kLdK = kD + 8;          // [row][d] tiles (T), 16 bytes of padding
  static_assert(kLdK == TcBwdTile<kD>::kLdK, "tc_key_side_band reads sK, sRq with this stride");
  static constexpr int kLdS = kRows + 4;       // sSk, sSv: [c][row] floats
  static constexpr int kLdT = kKeys + 8;       // sDSk: [c][key] (T)
  static constexpr int kLdScr = kWarpBand + 4;  // a warp's float scratch [16][kLdScr]
  static constexpr int kRowCols = 7;  // lse2, D_i, qlo, qhi, dlo, dhi, dropout row key
  static constexpr size_t kTable = size_t(kBand) * kLdK * 2;  // one [kBand][kLdK] table slice
  // kRelQ: sRq [kBand][kLdK] | sDSk [kBand][kLdT] (dS' key-major) | the warps' scratch
  // [16][kLdScr] floats | sKm [kKeys][2] floats (the keys' clamped dS masses of a head) | sKq
  // [2][kKeys] floats (k_j . rel_q[0], k_j . rel_q[2K] of a head, for the pairs beyond the band)
  static constexpr size_t kRelQBytes =
      kTable + size_t(kBand) * kLdT * 2 + size_t(kWarps) * 16 * kLdScr * 4 + kKeys * 4 * 4;
  // Shared memory but sRk and sRv: sQ sG [kRows][kLdK] | sK sV [kKeys][kLdK] | sSk sSv
  // [kBand][kLdS] | sBias [kBand] | sRow [kRowCols][kRows], and rel_q's
  static constexpr size_t other_bytes(bool rel_q) {
    return size_t(2 * kRows + 2 * kKeys) * kLdK * 2 + size_t(2 * kBand) * kLdS * 4 + kBand * 4 +
           kRowCols * kRows * 4 + (rel_q ? kRelQBytes : 0);
  }
  // share_tables: rel_v's band slice in rel_k's buffer, staged once sSk is done (on band pairs
  // one more staging and two more barriers), where that is what lets two blocks share a
  // multiprocessor of sm_90 (TcTile::kTwoBlocksBytes; the registers allow two at most), as the
  // forward's share_band: at kD = 128 from 130.2 to 104.8 KiB, with rel_q at kD = 64 from 123.2 to
  // 109.8 KiB.
  static constexpr bool share_tables(bool rel_q) {
    return other_bytes(rel_q) + 2 * kTable > TcTile<kD>::kTwoBlocksBytes &&
           other_bytes(rel_q) + kTable <= TcTile<kD>::kTwoBlocksBytes;
  }
  // Layout: sQ | sG | sK | sV | sRk | sRv (unless shared) | sSk | sSv | sBias | sRow | rel_q's
  static constexpr size_t base(bool rel_q) {
    return other_bytes(false) + (share_tables(rel_q) ? 1 : 2) * kTable;
  }
  static constexpr size_t smem(bool rel_q) { return base(rel_q) + (rel_q ? kRelQBytes : 0); }
};

// The key-side table rel_q (s_ij += k_j . rel_q[b(i, j)], before the scale) of a band pair, as
// the forward computes it: warp w, KR[r][c - 16 w] = k_{16 w + r} . rel_q[c] for its 16 keys of
// the tile (sK [key][d]) and their kWarpBand values of c, c in [16 w, 16 w + kWarpBand) (sRq
// [c][d]), into dst (rows ld floats apart). Key j of the tile meets row i of a tile pair at
// c = j - i + (rows of the query tile) - 1: kWarpBand = 80 for 64 rows, 48 for 32.
template <typename T, int kD, int kWarpBand>
RELPOS_DEVICE void tc_key_side_band(float* dst, int ld, const T* sK, const T* sRq, int warp,
                                    int lane) {
  using Tl = TcBwdTile<kD>;
  constexpr int kHalf = kWarpBand / 16;  // n-tiles of a half of the warp's c
  RELPOS_UNROLL
  for (int half = 0; half < 2; ++half) {
    float kr[kHalf][4];
    zero_acc(kr);
    warp_mma_bt<T, kHalf, kD / 16>(
        kr,
        [&](int kk, uint32_t (&a)[4]) {
          load_a_frag(a, sK + 16 * warp * Tl::kLdK + kk * 16, Tl::kLdK, lane);
        },
        sRq + (16 * warp + half * kHalf * 8) * Tl::kLdK, Tl::kLdK, lane);
    store_acc(dst + half * kHalf * 8, ld, kr, lane);
  }
}

// ---- dq, and the table gradients ----------------------------------------------------------------
// Query tile `tile` of (b, h) = bh. Every address of the table-gradient partials gets at most one
// atomicAdd per tile pair (the inner buckets of a pair are distinct values of c, each warp's c
// distinct) and one at the end per bucket 0 / 2K, from one thread: one block per (b, h) at a
// time adds in a fixed order (the kernel's `tile` argument).
template <typename T, int kD, bool kRelQ>
__device__ void tc_bwd_dq_tile(const RelAttentionBwdParams& bp, const float* ws, int64_t bh,
                               int64_t tile) {
  using Tl = TcBwdTile<kD>;
  static_assert(!kRelQ || Tl::kKeys == 64, "rel_q (up to kD = 64): four warps of 16 keys");
  constexpr int kNT = Tl::kKeys / 8;  // n-tiles of S
  constexpr int kDT = kD / 8;         // n-tiles of dq
  constexpr int kDK = kD / 16;        // k-steps over the head dim
  constexpr int kCT = Tl::kWarpBand / 8, kCK = Tl::kWarpBand / 16;
  constexpr int kHalf = kCT / 2;
  const RelAttentionParams& p = bp.fwd;
  RELPOS_DYNAMIC_SMEM(unsigned char, smem);
  T* sQ = reinterpret_cast<T*>(smem);
  T* sG = sQ + Tl::kRows * Tl::kLdK;
  T* sK = sG + Tl::kRows * Tl::kLdK;
  T* sV = sK + Tl::kKeys * Tl::kLdK;
  T* sRk = sV + Tl::kKeys * Tl::kLdK;
  constexpr bool kShareTables = Tl::share_tables(kRelQ);
  T* sRv = kShareTables ? sRk : sRk + Tl::kBand * Tl::kLdK;
  float* scr_all = reinterpret_cast<float*>(sRv + Tl::kBand * Tl::kLdK);
  // overlays sRv (unless shared) and the scratch after dP: [kBand][kLdT]
  T* sDSt = kShareTables ? reinterpret_cast<T*>(scr_all) : sRv;
  T* sPt = sDSt + Tl::kBand * Tl::kLdT;
  float* sBias = reinterpret_cast<float*>(smem + Tl::dq_base(kRelQ) - Tl::kBand * 4 -
                                          2 * Tl::kRows * 4 * 4);
  float* sMass = sBias + Tl::kBand;  // [kRows][4]: the rows' clamped dS lo / hi, P lo / hi
  float* sDots = sMass + Tl::kRows * 4;  // [kRows][4]: the rows' clamped dots (kRowQeLo ...)
  T* sRq = reinterpret_cast<T*>(smem + Tl::dq_base(kRelQ));  // kRelQ only
  float* sKR = reinterpret_cast<float*>(sRq + Tl::kBand * Tl::kLdK);
  float* sKq = sKR + Tl::kKeys * Tl::kLdKR;

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t4 = lane % 4;
  const int64_t h = bh % p.heads, b = bh / p.heads;
  const int64_t i0 = tile * Tl::kRows;
  const int nq = static_cast<int>(p.q_len - i0 < Tl::kRows ? p.q_len - i0 : Tl::kRows);
  const int64_t K = p.max_distance, table_rows = num_buckets(K);
  const int D = static_cast<int>(p.dim);  // a multiple of 8, at most kD: zero-padded to kD
  const int64_t kvh = b * p.kv_heads + h / (p.heads / p.kv_heads);
  const T* q = static_cast<const T*>(p.q) + (bh * p.q_len + i0) * D;
  const T* go = static_cast<const T*>(bp.grad_out) + (bh * p.q_len + i0) * D;
  const T* k = static_cast<const T*>(p.k) + kvh * p.kv_stride;
  const T* v = static_cast<const T*>(p.v) + kvh * p.kv_stride;
  const T* ek = head_table<T>(p.rel_k, p.rel_k_per_head, h, table_rows * D);
  const T* ev = head_table<T>(p.rel_v, p.rel_v_per_head, h, table_rows * D);
  const T* eb = head_table<T>(p.rel_bias, p.rel_bias_per_head, h, table_rows);
  const T* eq = kRelQ ? head_table<T>(p.rel_q, p.rel_q_per_head, h, table_rows * D) : nullptr;
  float* pk = ek == nullptr || bp.drel_k_partial == nullptr
                  ? nullptr : static_cast<float*>(bp.drel_k_partial) + bh * table_rows * D;
  float* pv = ev == nullptr || bp.drel_v_partial == nullptr
                  ? nullptr : static_cast<float*>(bp.drel_v_partial) + bh * table_rows * D;
  float* pb = eb == nullptr || bp.drel_bias_partial == nullptr
                  ? nullptr : static_cast<float*>(bp.drel_bias_partial) + bh * table_rows;
  const float scale = static_cast<float>(p.scale);
  const float drop_scale = static_cast<float>(p.dropout.keep_scale);  // 1 without dropout
  const float scale2 = static_cast<float>(p.scale * kLog2e);
  const float blo = eb == nullptr ? 0.f : to_float(eb[0]) * static_cast<float>(kLog2e);
  const float bhi = eb == nullptr ? 0.f : to_float(eb[table_rows - 1]) * static_cast<float>(kLog2e);

  // This thread's rows g and g + 8 of the warp: lse in base 2 (+inf past the last row: p = 0),
  // the workspace's D_i, the dropout row keys; the rows' clamped dots into sDots (read for the
  // pairs beyond the band only: in registers they would crowd dq, S and dP).
  float lse2[2], di[2];
  uint32_t drop_key[2];
  RELPOS_UNROLL
  for (int r = 0; r < 2; ++r) {
    const int row = warp * 16 + g + 8 * r;
    const int64_t gi = bh * p.q_len + i0 + row;
    const bool valid = row < nq;
    lse2[r] = valid ? static_cast<const float*>(p.lse)[gi] * static_cast<float>(kLog2e) : INFINITY;
    di[r] = valid ? ws[gi * kRowTerms + kRowDi] : 0.f;
    static_assert(kRowTerms == kRowQeLo + 4, "four clamped dots, one per lane of the row");
    sDots[row * 4 + t4] = valid ? ws[gi * kRowTerms + kRowQeLo + t4] : 0.f;
    drop_key[r] = attn_dropout_key(p, bh, i0 + row);
  }

  tc_stage<T, kD, false>(sQ, Tl::kLdK, Tl::kRows,
                         [&](int r) { return r < nq ? q + static_cast<int64_t>(r) * D : nullptr; },
                         D);
  tc_stage<T, kD, false>(sG, Tl::kLdK, Tl::kRows,
                         [&](int r) { return r < nq ? go + static_cast<int64_t>(r) * D : nullptr; },
                         D);
  __syncthreads();
  const T* qw = sQ + warp * 16 * Tl::kLdK;
  const T* gw = sG + warp * 16 * Tl::kLdK;
  auto q_frag = [&](int kk, uint32_t (&a)[4]) { load_a_frag(a, qw + kk * 16, Tl::kLdK, lane); };
  auto g_frag = [&](int kk, uint32_t (&a)[4]) { load_a_frag(a, gw + kk * 16, Tl::kLdK, lane); };

  float dq[kDT][4];
  zero_acc(dq);
  // Per row (g, g + 8): the dS and kept P masses of the pairs beyond the band, lo and hi side.
  float mds_lo[2] = {0, 0}, mds_hi[2] = {0, 0}, mp_lo[2] = {0, 0}, mp_hi[2] = {0, 0};
  bool any_lo = false, any_hi = false;  // block-uniform
  const bool elem_masks = tc_elem_masks(p);
  float* scr = scr_all + warp * 16 * Tl::kLdScr;
  const int cw = Tl::kRows - 16 - 16 * warp;  // the warp's first c: 63 - (16 w + 15)

  // With kShareTables and both tables, rel_k's rows wait until dP's term is done (below).
  const bool late_rk = kShareTables && ek != nullptr && ev != nullptr;
  const int64_t key_end = attn_key_end(p, i0, nq);
  for (int64_t j0 = attn_key_begin(p, i0) / Tl::kKeys * Tl::kKeys; j0 < key_end; j0 += Tl::kKeys) {
    const int nk = static_cast<int>(p.k_len - j0 < Tl::kKeys ? p.k_len - j0 : Tl::kKeys);
    if (has_tile_masks(p) && attn_tile_hidden<Tl>(p, b, h, i0, nq, j0, nk)) continue;
    const TcPair pair = tc_pair<Tl>(p, i0, j0, K);
    const int64_t dbase = pair.dbase;
    const bool all_lo = pair.all_lo, band = pair.band;
    any_lo |= dbase <= -K;                    // some pair (i, j) in bucket 0
    any_hi |= dbase + Tl::kBand - 2 >= K;     // some in bucket 2K
    __syncthreads();  // the previous pair's readers of every staged tile and overlay are done
    // K and V by cp.async, in flight while the tables are staged.
    tc_stage_async<T, kD, Tl::kKeys>(sK, Tl::kLdK, k + j0 * D, nk, D);
    tc_stage_async<T, kD, Tl::kKeys>(sV, Tl::kLdK, v + j0 * D, nk, D);
    cp_async_commit();
    if (band && ek != nullptr && !late_rk) {
      tc_stage_band<T, kD>(sRk, Tl::kLdK, Tl::kBand, ek, dbase, K, D);
    }
    if (band && ev != nullptr) tc_stage_band<T, kD>(sRv, Tl::kLdK, Tl::kBand, ev, dbase, K, D);
    if (band && eb != nullptr) tc_stage_band_bias(sBias, Tl::kBand, eb, dbase, K);
    if constexpr (kRelQ) {
      if (band) tc_stage_band<T, kD>(sRq, Tl::kLdK, Tl::kBand, eq, dbase, K, D);
    }
    cp_async_wait<0>();
    __syncthreads();
    // + k_j . rel_q[b(i, j)]: as the forward (KR for the warp's 16 keys and 80 values of c, then
    // after every warp's the gather along the skew; one value per key beyond the band)
    if constexpr (kRelQ) {
      if (band) {  // sKR [key][c]: the warp's rows from c = 16 w
        tc_key_side_band<T, kD, Tl::kWarpBand>(sKR + 16 * warp * Tl::kLdKR + 16 * warp, Tl::kLdKR,
                                               sK, sRq, warp, lane);
      } else {
        tc_key_side_clamped<T, kD>(sKq, sK, Tl::kLdK,
                                        eq + (all_lo ? 0 : (table_rows - 1) * D), D);
      }
      __syncthreads();
    }

    // S = Q K^T, dP = dO V^T
    float s[kNT][4], dp[kNT][4];
    zero_acc(s);
    zero_acc(dp);
    warp_mma_bt<T, kNT, kDK>(s, q_frag, sK, Tl::kLdK, lane);
    warp_mma_bt<T, kNT, kDK>(dp, g_frag, sV, Tl::kLdK, lane);
    if constexpr (kRelQ) {
      RELPOS_UNROLL
      for (int nt = 0; nt < kNT; ++nt) {
        RELPOS_UNROLL
        for (int e = 0; e < 4; ++e) {
          const int jj = nt * 8 + 2 * t4 + e % 2, i = 16 * warp + g + (e / 2) * 8;
          s[nt][e] += band ? sKR[jj * Tl::kLdKR + jj - i + Tl::kRows - 1] : sKq[jj];
        }
      }
    }
    // + the relative terms: Q Rk^T and dO Rv^T along the skew (through the scratch), or the
    // rows' clamped dots beyond the band.
    // (A generic lambda's auto parameter here crashes nvcc 13.0's front end: a flag instead.)
    auto add_skewed = [&](float (&acc)[kNT][4], bool dout, const T* table) {
      RELPOS_UNROLL
      for (int half = 0; half < 2; ++half) {
        float sr[kHalf][4];
        zero_acc(sr);
        warp_mma_bt<T, kHalf, kDK>(
            sr, [&](int kk, uint32_t (&a)[4]) { dout ? g_frag(kk, a) : q_frag(kk, a); },
            table + (cw + half * kHalf * 8) * Tl::kLdK, Tl::kLdK, lane);
        store_acc(scr + half * kHalf * 8, Tl::kLdScr, sr, lane);
      }
      __syncwarp();
      RELPOS_UNROLL
      for (int nt = 0; nt < kNT; ++nt) {
        RELPOS_UNROLL
        for (int e = 0; e < 4; ++e) {
          const int r = g + (e / 2) * 8, jj = nt * 8 + 2 * t4 + e % 2;
          acc[nt][e] += scr[r * Tl::kLdScr + jj - r + 15];
        }
      }
      __syncwarp();  // read before the next product overwrites the scratch
    };
    if (band) {
      if (late_rk) {
        add_skewed(dp, true, sRv);
        __syncthreads();  // every warp's reads of rel_v's rows are done
        tc_stage_band_async<T, kD, Tl::kBand>(sRk, Tl::kLdK, ek, dbase, K, D);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
        add_skewed(s, false, sRk);
      } else {
        if (ek != nullptr) add_skewed(s, false, sRk);
        if (ev != nullptr) add_skewed(dp, true, sRv);
      }
    } else {
      RELPOS_UNROLL
      for (int nt = 0; nt < kNT; ++nt) {
        RELPOS_UNROLL
        for (int e = 0; e < 4; ++e) {
          const float* w = sDots + (warp * 16 + g + (e / 2) * 8) * 4 - kRowQeLo;
          if (ek != nullptr) s[nt][e] += all_lo ? w[kRowQeLo] : w[kRowQeHi];
          if (ev != nullptr) dp[nt][e] += all_lo ? w[kRowDeLo] : w[kRowDeHi];
        }
      }
    }

    // P and dS (s <- dS, dp <- P kept): the scale (and the bias) and the masks in passes that run
    // only where they have work (tc_scale_logits, tc_hide_elems), then one loop (dropout as bits)
    tc_scale_logits<kNT>(s, scale2, eb != nullptr, [&](int nt, int e) {
      const int r = g + (e / 2) * 8, jj = nt * 8 + 2 * t4 + e % 2;
      return band ? sBias[cw + jj - r + 15] : (all_lo ? blo : bhi);
    });
    tc_hide_elems<kNT>(s, tc_pair_full<Tl>(p, elem_masks, i0, j0), [&](int nt, int e) {
      const int r = g + (e / 2) * 8, jj = nt * 8 + 2 * t4 + e % 2;
      return !attn_visible(p, b, h, i0 + warp * 16 + r, j0 + jj);
    });
    float rds[2] = {0, 0}, rp[2] = {0, 0};
    tc_with_dropout(p, [&](auto drop) {
      constexpr bool kDropOn = decltype(drop)::value;
      const uint32_t kept = kDropOn ? tc_row_kept_bits<kNT>(p, drop_key, j0 + 2 * t4) : 0u;
      RELPOS_UNROLL
      for (int nt = 0; nt < kNT; ++nt) {
        RELPOS_UNROLL
        for (int e = 0; e < 4; ++e) {
          const float pr = exp2_acc(s[nt][e] - lse2[e / 2]);
          const float f = kDropOn ? tc_drop_factor(p, kept, nt, e) : 1.f;
          const float ds = pr * (f * dp[nt][e] - di[e / 2]);
          const float pkept = !kDropOn || tc_bit(kept, nt, e) ? pr : 0.f;
          s[nt][e] = ds;
          dp[nt][e] = pkept;
          rds[e / 2] += ds;
          rp[e / 2] += pkept;
        }
      }
    });
    if (!band) {
      RELPOS_UNROLL
      for (int r = 0; r < 2; ++r) {
        if (all_lo) {
          mds_lo[r] += rds[r];
          mp_lo[r] += rp[r];
        } else {
          mds_hi[r] += rds[r];
          mp_hi[r] += rp[r];
        }
      }
    }

    // dq += dS K
    warp_mma_kn<T, kDT, Tl::kKeys / 16>(
        dq, [&](int kk, uint32_t (&a)[4]) { acc_a_frag<T>(a, s, kk); }, sK, Tl::kLdK, lane);

    if (band) {
      // dS' and the kept P' along the skew, transposed ([c][row]), over sRv and the scratch.
      __syncthreads();  // every warp's scratch and sRv reads are done
      {
        constexpr int kVec = 8;  // zero 16 bytes at a time
        const int n = 2 * Tl::kBand * Tl::kLdT / kVec;
        for (int idx = threadIdx.x; idx < n; idx += Tl::kThreads) {
          *reinterpret_cast<Bits16*>(sDSt + idx * kVec) = zero_bits<Bits16>();
        }
      }
      __syncthreads();
      // The pairs of the clamped buckets join the rows' masses instead (fewer atomics, none on
      // one address from many values of c): only the inner buckets go along the skew.
      RELPOS_UNROLL
      for (int nt = 0; nt < kNT; ++nt) {
        RELPOS_UNROLL
        for (int e = 0; e < 4; ++e) {
          const int r = warp * 16 + g + (e / 2) * 8, jj = nt * 8 + 2 * t4 + e % 2;
          const int c = jj - r + Tl::kRows - 1;
          const int64_t dist = dbase + c;
          float ds = s[nt][e], pkept = dp[nt][e];
          if (dist <= -K || dist >= K) {
            if (dist <= -K) {
              mds_lo[e / 2] += ds;
              mp_lo[e / 2] += pkept;
            } else {
              mds_hi[e / 2] += ds;
              mp_hi[e / 2] += pkept;
            }
            ds = pkept = 0;
          }
          sDSt[c * Tl::kLdT + r] = from_float<T>(ds);
          sPt[c * Tl::kLdT + r] = from_float<T>(pkept);
        }
      }
      __syncthreads();
      // dq += dS' Rk over the warp's 80 values of c
      if (ek != nullptr) {
        warp_mma_kn<T, kDT, kCK>(
            dq,
            [&](int kk, uint32_t (&a)[4]) {
              load_a_frag_t(a, sDSt + (cw + kk * 16) * Tl::kLdT + warp * 16, Tl::kLdT, lane);
            },
            sRk + cw * Tl::kLdK, Tl::kLdK, lane);
      }
      // c = kBand - 1 has no pair; the clamped buckets went to the masses.
      auto inner = [&](int c) { return c < Tl::kBand - 1 && dbase + c > -K && dbase + c < K; };
      // The table gradients of the pair, 16 values of c at a time:
      // drel_k[b(c)] += scale dS'^T Q, drel_v[b(c)] += P'^T dO (64 rows: 4 k-steps).
      // Beyond kD = 64 the columns go in two halves (dq's accumulators stay live: no spills).
      constexpr int kSplit = kDT > 8 ? 2 : 1, kDTs = kDT / kSplit;
      constexpr int kUnits = Tl::kBand / 16 * kSplit;  // (16 values of c, columns) per block
      static_assert(kUnits % Tl::kWarps == 0);
      auto table_grad = [&](const T* at, const T* rows, float* dst, float mul) {
        RELPOS_NO_UNROLL
        for (int x = 0; x < kUnits / Tl::kWarps; ++x) {
          const int u = warp * (kUnits / Tl::kWarps) + x;
          const int c0 = 16 * (u / kSplit), part = u % kSplit;
          float acc[kDTs][4];
          zero_acc(acc);
          warp_mma_kn<T, kDTs, Tl::kRows / 16>(
              acc,
              [&](int kk, uint32_t (&a)[4]) {
                load_a_frag(a, at + c0 * Tl::kLdT + kk * 16, Tl::kLdT, lane);
              },
              rows + part * kDTs * 8, Tl::kLdK, lane);
          RELPOS_UNROLL
          for (int e = 0; e < 4; ++e) {
            const int c = c0 + g + (e / 2) * 8;
            if (!inner(c)) continue;
            float* drow = dst + (dbase + c + K) * D;
            RELPOS_UNROLL
            for (int nt = 0; nt < kDTs; ++nt) {
              const int d = (part * kDTs + nt) * 8 + 2 * t4 + e % 2;
              if (d < D) atomicAdd(drow + d, acc[nt][e] * mul);
            }
          }
        }
      };
      if (pk != nullptr) table_grad(sDSt, sQ, pk, scale);
      if (pv != nullptr) table_grad(sPt, sG, pv, drop_scale);
      if (pb != nullptr && inner(threadIdx.x)) {  // drel_bias: dS' per c
        const int c = threadIdx.x;
        float x = 0;
        for (int r = 0; r < Tl::kRows; ++r) x += to_float(sDSt[c * Tl::kLdT + r]);
        atomicAdd(pb + dbase + c + K, x);
      }
    }
  }

  // The clamped masses: per row (the four lanes of a row summed), into dq and, per block, into
  // the tables' bucket 0 and 2K.
  RELPOS_UNROLL
  for (int r = 0; r < 2; ++r) {
    RELPOS_UNROLL
    for (int x = 1; x <= 2; x *= 2) {
      mds_lo[r] += __shfl_xor_sync(0xffffffffu, mds_lo[r], x);
      mds_hi[r] += __shfl_xor_sync(0xffffffffu, mds_hi[r], x);
      mp_lo[r] += __shfl_xor_sync(0xffffffffu, mp_lo[r], x);
      mp_hi[r] += __shfl_xor_sync(0xffffffffu, mp_hi[r], x);
    }
  }
  T* dqp = static_cast<T*>(bp.dq) + (bh * p.q_len + i0) * D;
  RELPOS_UNROLL
  for (int r = 0; r < 2; ++r) {
    const int row = warp * 16 + g + 8 * r;
    if (t4 == 0) {
      sMass[row * 4 + 0] = mds_lo[r];
      sMass[row * 4 + 1] = mds_hi[r];
      sMass[row * 4 + 2] = mp_lo[r];
      sMass[row * 4 + 3] = mp_hi[r];
    }
    if (row >= nq) continue;
    RELPOS_UNROLL
    for (int nt = 0; nt < kDT; ++nt) {
      if (nt * 8 >= D) break;  // the zero padding of D up to kD
      const int d = nt * 8 + 2 * t4;
      float x0 = dq[nt][2 * r], x1 = dq[nt][2 * r + 1];
      if (ek != nullptr) {
        const T* e0 = ek;
        const T* e1 = ek + (table_rows - 1) * D;
        x0 += mds_lo[r] * to_float(e0[d]) + mds_hi[r] * to_float(e1[d]);
        x1 += mds_lo[r] * to_float(e0[d + 1]) + mds_hi[r] * to_float(e1[d + 1]);
      }
      st32(dqp + row * D + d, pack2<T>(x0 * scale, x1 * scale));
    }
  }
  if (!any_lo && !any_hi) return;  // block-uniform
  __syncthreads();  // sMass complete
  for (int idx = threadIdx.x; idx < 2 * D; idx += Tl::kThreads) {
    const int d = idx % D, hi = idx / D;
    if (!(hi ? any_hi : any_lo)) continue;
    float xk = 0, xv = 0;
    for (int r = 0; r < nq; ++r) {
      xk += sMass[r * 4 + hi] * to_float(sQ[r * Tl::kLdK + d]);
      xv += sMass[r * 4 + 2 + hi] * to_float(sG[r * Tl::kLdK + d]);
    }
    const int64_t bucket = hi ? table_rows - 1 : 0;
    if (pk != nullptr) atomicAdd(pk + bucket * D + d, xk * scale);
    if (pv != nullptr) atomicAdd(pv + bucket * D + d, xv * drop_scale);
  }
  if (pb != nullptr && threadIdx.x < 2 && (threadIdx.x ? any_hi : any_lo)) {
    const int hi = threadIdx.x;
    float x = 0;
    for (int r = 0; r < nq; ++r) x += sMass[r * 4 + hi];
    atomicAdd(pb + (hi ? table_rows - 1 : 0), x);
  }
}

// Grid: batch * heads * ceil(q_len / 64) blocks, one query tile each; or, with tile >= 0, batch *
// heads blocks that all take query tile `tile`: deterministic mode (serial_q_tiles) launches
// that once per tile, in order on the stream, so that the table-gradient atomics of a (b, h) add
// in a fixed order (a loop over the tiles inside one block does the same, but ptxas spills there).
template <typename T, int kD, bool kRelQ>
__global__ void __launch_bounds__(TcBwdTile<kD>::kThreads)
    rel_attention_tc_bwd_dq_kernel(RelAttentionBwdParams bp, const float* ws, int64_t tile) {
  const int64_t q_tiles = (bp.fwd.q_len + TcBwdTile<kD>::kRows - 1) / TcBwdTile<kD>::kRows;
  // One call site: one inlined copy.
  const int64_t bh = tile < 0 ? blockIdx.x / q_tiles : blockIdx.x;
  tc_bwd_dq_tile<T, kD, kRelQ>(bp, ws, bh, tile < 0 ? blockIdx.x % q_tiles : tile);
}

// ---- dk and dv --------------------------------------------------------------------------------
// No atomics without rel_q: deterministic as it is.
// Key tile `tile` of (b, kv head) = bkv, against query tiles of 32 rows (TcBwdKvTile): per pair,
//   the relative terms of a band pair first, per block and before S^T is live: sSk = Rk Q^T and
//   sSv = Rv dO^T ([c][row] floats; both tables staged, or rel_v's rows after sSk where they
//   share a buffer, share_tables), each (key, row) then reads its c;
//   S^T = K Q^T, dP^T = V dO^T, P^T, dS^T; dv += P^T dO, dk += dS^T Q.
// kRelQ: the key-side table too (up to kD = 64):
//   S^T += K Rq^T along the skew (per warp, through its scratch), or k_j . rel_q[0 / 2K];
//   dk += dS' Rq (dS' = dS^T scattered along the skew, [c][key]) for the inner buckets, and
//   drel_q[b(c)] += scale dS'^T K per block (one atomic per address and pair, as the dq kernel's
//   table gradients); the clamped buckets through per-key masses, applied at the end of each head
//   (rel_q is per head): dk += m rel_q[0 / 2K], drel_q[0 / 2K] += scale sum_j m_j k_j.
template <typename T, int kD, bool kRelQ>
__device__ void tc_bwd_dkdv_tile(const RelAttentionBwdParams& bp, const float* ws, int64_t bkv,
                                 int64_t tile) {
  using Tl = TcBwdKvTile<kD>;
  constexpr int kNT = Tl::kRows / 8;  // n-tiles of S^T (query rows)
  constexpr int kDT = kD / 8;
  constexpr int kDK = kD / 16;
  constexpr int kMT = Tl::kBand / 16;  // m-tiles of c in the block-wide products
  const RelAttentionParams& p = bp.fwd;
  RELPOS_DYNAMIC_SMEM(unsigned char, smem);
  T* sQ = reinterpret_cast<T*>(smem);
  T* sG = sQ + Tl::kRows * Tl::kLdK;
  T* sK = sG + Tl::kRows * Tl::kLdK;
  T* sV = sK + Tl::kKeys * Tl::kLdK;
  T* sRk = sV + Tl::kKeys * Tl::kLdK;  // the band slices of rel_k and rel_v: [kBand][kLdK]
  constexpr bool kShareTables = Tl::share_tables(kRelQ);
  T* sRv = kShareTables ? sRk : sRk + Tl::kBand * Tl::kLdK;
  float* sSk = reinterpret_cast<float*>(sRv + Tl::kBand * Tl::kLdK);  // [kBand][kLdS]
  float* sSv = sSk + Tl::kBand * Tl::kLdS;
  float* sBias = sSv + Tl::kBand * Tl::kLdS;
  float* sRow = sBias + Tl::kBand;  // [kRowCols][kRows]
  T* sRq = reinterpret_cast<T*>(smem + Tl::base(kRelQ));  // kRelQ only
  T* sDSk = sRq + Tl::kBand * Tl::kLdK;
  float* scr_all = reinterpret_cast<float*>(sDSk + Tl::kBand * Tl::kLdT);
  float* sKm = scr_all + Tl::kWarps * 16 * Tl::kLdScr;  // [kKeys][2]
  float* sKq = sKm + 2 * Tl::kKeys;
  enum { kLse2 = 0, kDi, kQlo, kQhi, kDlo, kDhi, kDrop };

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t4 = lane % 4;
  const int64_t hk = bkv % p.kv_heads, b = bkv / p.kv_heads;
  const int64_t j0 = tile * Tl::kKeys;
  const int nk = static_cast<int>(p.k_len - j0 < Tl::kKeys ? p.k_len - j0 : Tl::kKeys);
  const int64_t K = p.max_distance, table_rows = num_buckets(K);
  const int D = static_cast<int>(p.dim);
  const int64_t group = p.heads / p.kv_heads;
  const float scale = static_cast<float>(p.scale);
  const float drop_scale = static_cast<float>(p.dropout.keep_scale);  // 1 without dropout
  const float scale2 = static_cast<float>(p.scale * kLog2e);
  const T* kp = static_cast<const T*>(p.k) + bkv * p.kv_stride + j0 * D;
  const T* vp = static_cast<const T*>(p.v) + bkv * p.kv_stride + j0 * D;

  tc_stage<T, kD, false>(sK, Tl::kLdK, Tl::kKeys,
                         [&](int r) { return r < nk ? kp + static_cast<int64_t>(r) * D : nullptr; },
                         D);
  tc_stage<T, kD, false>(sV, Tl::kLdK, Tl::kKeys,
                         [&](int r) { return r < nk ? vp + static_cast<int64_t>(r) * D : nullptr; },
                         D);
  __syncthreads();
  const T* kw = sK + warp * 16 * Tl::kLdK;
  const T* vw = sV + warp * 16 * Tl::kLdK;
  auto k_frag = [&](int kk, uint32_t (&a)[4]) { load_a_frag(a, kw + kk * 16, Tl::kLdK, lane); };
  auto v_frag = [&](int kk, uint32_t (&a)[4]) { load_a_frag(a, vw + kk * 16, Tl::kLdK, lane); };

  float dk[kDT][4], dv[kDT][4];
  zero_acc(dk);
  zero_acc(dv);
  const bool elem_masks = tc_elem_masks(p);

  // Query rows that can see a key of this tile
  const int64_t i_first = attn_query_begin(p, j0), i_end = attn_query_end(p, j0, nk);
  for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
    const int64_t bh = b * p.heads + h;
    const T* q = static_cast<const T*>(p.q) + bh * p.q_len * D;
    const T* go = static_cast<const T*>(bp.grad_out) + bh * p.q_len * D;
    const T* ek = head_table<T>(p.rel_k, p.rel_k_per_head, h, table_rows * D);
    const T* ev = head_table<T>(p.rel_v, p.rel_v_per_head, h, table_rows * D);
    const T* eb = head_table<T>(p.rel_bias, p.rel_bias_per_head, h, table_rows);
    const float blo = eb == nullptr ? 0.f : to_float(eb[0]) * static_cast<float>(kLog2e);
    const float bhi =
        eb == nullptr ? 0.f : to_float(eb[table_rows - 1]) * static_cast<float>(kLog2e);
    const T* eq = kRelQ ? head_table<T>(p.rel_q, p.rel_q_per_head, h, table_rows * D) : nullptr;
    float* pq = !kRelQ || bp.drel_q_partial == nullptr
                    ? nullptr : static_cast<float*>(bp.drel_q_partial) + bh * table_rows * D;
    float mk_lo[2] = {0, 0}, mk_hi[2] = {0, 0};  // kRelQ: the keys' (g, g + 8) clamped dS masses
    if constexpr (kRelQ) {  // the head's sKq, once (visible after the first pair's barrier)
      __syncthreads();  // the previous head's readers of sKq are done
      tc_key_side_clamped<T, kD>(sKq, sK, Tl::kLdK, eq, D);
      tc_key_side_clamped<T, kD>(sKq + Tl::kKeys, sK, Tl::kLdK, eq + (table_rows - 1) * D, D);
    }
    for (int64_t i0 = (i_first / Tl::kRows) * Tl::kRows; i0 < i_end; i0 += Tl::kRows) {
      const int nq = static_cast<int>(p.q_len - i0 < Tl::kRows ? p.q_len - i0 : Tl::kRows);
      if (has_tile_masks(p) && attn_tile_hidden<Tl>(p, b, h, i0, nq, j0, nk)) continue;
      const TcPair pair = tc_pair<Tl>(p, i0, j0, K);
      const int64_t dbase = pair.dbase;
      const bool all_lo = pair.all_lo, band = pair.band;
      __syncthreads();  // the previous pair's readers are done
      // Q and dO by cp.async, in flight while the rows' terms and the tables are staged.
      tc_stage_async<T, kD, Tl::kRows>(sQ, Tl::kLdK, q + i0 * D, nq, D);
      tc_stage_async<T, kD, Tl::kRows>(sG, Tl::kLdK, go + i0 * D, nq, D);
      cp_async_commit();
      for (int r = threadIdx.x; r < Tl::kRows; r += Tl::kThreads) {
        const int64_t gi = bh * p.q_len + i0 + r;
        const bool valid = r < nq;
        sRow[kLse2 * Tl::kRows + r] =
            valid ? static_cast<const float*>(p.lse)[gi] * static_cast<float>(kLog2e) : INFINITY;
        sRow[kDi * Tl::kRows + r] = valid ? ws[gi * kRowTerms + kRowDi] : 0.f;
        sRow[kQlo * Tl::kRows + r] = valid ? ws[gi * kRowTerms + kRowQeLo] : 0.f;
        sRow[kQhi * Tl::kRows + r] = valid ? ws[gi * kRowTerms + kRowQeHi] : 0.f;
        sRow[kDlo * Tl::kRows + r] = valid ? ws[gi * kRowTerms + kRowDeLo] : 0.f;
        sRow[kDhi * Tl::kRows + r] = valid ? ws[gi * kRowTerms + kRowDeHi] : 0.f;
        const uint32_t key = attn_dropout_key(p, bh, i0 + r);
        std::memcpy(&sRow[kDrop * Tl::kRows + r], &key, 4);
      }
      if (band && ek != nullptr) tc_stage_band<T, kD>(sRk, Tl::kLdK, Tl::kBand, ek, dbase, K, D);
      if constexpr (!kShareTables) {  // (else rel_v's rows wait until sSk is done, below)
        if (band && ev != nullptr) tc_stage_band<T, kD>(sRv, Tl::kLdK, Tl::kBand, ev, dbase, K, D);
      }
      if (band && eb != nullptr) tc_stage_band_bias(sBias, Tl::kBand, eb, dbase, K);
      if constexpr (kRelQ) {
        if (band) tc_stage_band<T, kD>(sRq, Tl::kLdK, Tl::kBand, eq, dbase, K, D);
      }
      cp_async_wait<0>();
      __syncthreads();

      if (band) {
        // The query-side relative logits of the pair, while only dk and dv are live: the block's
        // 2 x kMT units (table, 16 values of c) times the 32 rows, into sSk / sSv; with
        // kShareTables rel_k's units, then rel_v's in the same buffer (one copy of the loop, and
        // one staging of rel_v: ptxas spilled at kD = 128 with two).
        constexpr int kParts = kShareTables ? 2 : 1;
        RELPOS_NO_UNROLL
        for (int part = 0; part < kParts; ++part) {
          if (part == 1) {
            if (ev == nullptr) break;
            __syncthreads();  // every warp's reads of rel_k's rows are done
            tc_stage_band_async<T, kD, Tl::kBand>(sRv, Tl::kLdK, ev, dbase, K, D);
            cp_async_commit();
            cp_async_wait<0>();
            __syncthreads();
          }
          const int u_end = kShareTables ? (part + 1) * kMT : 2 * kMT;
          RELPOS_NO_UNROLL
          for (int u = part * kMT + warp; u < u_end; u += Tl::kWarps) {
            const bool vside = u >= kMT;
            if ((vside ? ev : ek) == nullptr) continue;
            const int c0 = 16 * (u % kMT);
            const T* table = (vside ? sRv : sRk) + c0 * Tl::kLdK;
            float x[kNT][4];
            zero_acc(x);
            warp_mma_bt<T, kNT, kDK>(
                x,
                [&](int kk, uint32_t (&a)[4]) { load_a_frag(a, table + kk * 16, Tl::kLdK, lane); },
                vside ? sG : sQ, Tl::kLdK, lane);
            store_acc((vside ? sSv : sSk) + c0 * Tl::kLdS, Tl::kLdS, x, lane);
          }
        }
        if constexpr (kRelQ) {  // KR of the warp's 16 keys, c in [16 w, 16 w + kWarpBand)
          tc_key_side_band<T, kD, Tl::kWarpBand>(scr_all + warp * 16 * Tl::kLdScr, Tl::kLdScr, sK,
                                                 sRq, warp, lane);
        }
        __syncthreads();
      }
      // acc += the relative logits of (key, row): sS[c][row] in the band, the rows' clamped dots
      // (sRow column col) beyond it.
      auto add_relative = [&](float (&acc)[kNT][4], const float* sS, int col) {
        RELPOS_UNROLL
        for (int nt = 0; nt < kNT; ++nt) {
          RELPOS_UNROLL
          for (int e = 0; e < 4; ++e) {
            const int jj = warp * 16 + g + (e / 2) * 8, ii = nt * 8 + 2 * t4 + e % 2;
            acc[nt][e] += band ? sS[(jj - ii + Tl::kRows - 1) * Tl::kLdS + ii]
                               : sRow[col * Tl::kRows + ii];
          }
        }
      };
      // S^T = K Q^T, dP^T = V dO^T: [16 keys][32 rows] per warp
      float st[kNT][4], dpt[kNT][4];
      zero_acc(st);
      warp_mma_bt<T, kNT, kDK>(st, k_frag, sQ, Tl::kLdK, lane);
      if (ek != nullptr) add_relative(st, sSk, all_lo ? kQlo : kQhi);
      if constexpr (kRelQ) {  // + k_j . rel_q[b(i, j)]: c - 16 w = r - ii + kRows - 1
        const float* scr = scr_all + warp * 16 * Tl::kLdScr;
        RELPOS_UNROLL
        for (int nt = 0; nt < kNT; ++nt) {
          RELPOS_UNROLL
          for (int e = 0; e < 4; ++e) {
            const int r = g + (e / 2) * 8, ii = nt * 8 + 2 * t4 + e % 2;
            st[nt][e] += band ? scr[r * Tl::kLdScr + r - ii + Tl::kRows - 1]
                              : sKq[(all_lo ? 0 : Tl::kKeys) + 16 * warp + r];
          }
        }
      }
      zero_acc(dpt);
      warp_mma_bt<T, kNT, kDK>(dpt, v_frag, sG, Tl::kLdK, lane);
      if (ev != nullptr) add_relative(dpt, sSv, all_lo ? kDlo : kDhi);

      // P^T and dS^T (st <- dS^T, dpt <- P^T kept): the scale (and the bias) and the masks in
      // passes that run only where they have work (tc_scale_logits, tc_hide_elems), then one loop
      // (dropout as bits)
      tc_scale_logits<kNT>(st, scale2, eb != nullptr, [&](int nt, int e) {
        const int jj = warp * 16 + g + (e / 2) * 8, ii = nt * 8 + 2 * t4 + e % 2;
        return band ? sBias[jj - ii + Tl::kRows - 1] : (all_lo ? blo : bhi);
      });
      tc_hide_elems<kNT>(st, tc_pair_full<Tl>(p, elem_masks, i0, j0), [&](int nt, int e) {
        const int jj = warp * 16 + g + (e / 2) * 8, ii = nt * 8 + 2 * t4 + e % 2;
        return !attn_visible(p, b, h, i0 + ii, j0 + jj);
      });
      tc_with_dropout(p, [&](auto drop) {
        constexpr bool kDropOn = decltype(drop)::value;
        uint32_t kept = 0;
        if constexpr (kDropOn) {
          kept = tc_elem_bits<kNT, true>([&](int nt, int e) {
            const int jj = warp * 16 + g + (e / 2) * 8, ii = nt * 8 + 2 * t4 + e % 2;
            uint32_t key;
            std::memcpy(&key, &sRow[kDrop * Tl::kRows + ii], 4);
            return dropout_kept(key, j0 + jj, p.dropout.threshold);
          });
        }
        RELPOS_UNROLL
        for (int nt = 0; nt < kNT; ++nt) {
          RELPOS_UNROLL
          for (int e = 0; e < 4; ++e) {
            const int ii = nt * 8 + 2 * t4 + e % 2;
            const float pr = exp2_acc(st[nt][e] - sRow[kLse2 * Tl::kRows + ii]);
            const float f = kDropOn ? tc_drop_factor(p, kept, nt, e) : 1.f;
            st[nt][e] = pr * (f * dpt[nt][e] - sRow[kDi * Tl::kRows + ii]);
            dpt[nt][e] = !kDropOn || tc_bit(kept, nt, e) ? pr : 0.f;
          }
        }
      });
      // dv += P^T dO, dk += dS^T Q
      warp_mma_kn<T, kDT, Tl::kRows / 16>(
          dv, [&](int kk, uint32_t (&a)[4]) { acc_a_frag<T>(a, dpt, kk); }, sG, Tl::kLdK, lane);
      warp_mma_kn<T, kDT, Tl::kRows / 16>(
          dk, [&](int kk, uint32_t (&a)[4]) { acc_a_frag<T>(a, st, kk); }, sQ, Tl::kLdK, lane);
      if constexpr (kRelQ) {
        if (band) {
          // dS' [c][key] for the inner buckets (over a zeroed sDSk: the previous pair's readers
          // finished before this pair's first barrier); the clamped ones into the key masses
          for (int idx = threadIdx.x; idx < Tl::kBand * Tl::kLdT / 8; idx += Tl::kThreads) {
            *reinterpret_cast<Bits16*>(sDSk + idx * 8) = zero_bits<Bits16>();
          }
          __syncthreads();
          RELPOS_UNROLL
          for (int nt = 0; nt < kNT; ++nt) {
            RELPOS_UNROLL
            for (int e = 0; e < 4; ++e) {
              const int jj = warp * 16 + g + (e / 2) * 8, ii = nt * 8 + 2 * t4 + e % 2;
              const int c = jj - ii + Tl::kRows - 1;
              const int64_t dist = dbase + c;
              if (dist <= -K) {
                mk_lo[e / 2] += st[nt][e];
              } else if (dist >= K) {
                mk_hi[e / 2] += st[nt][e];
              } else {
                sDSk[c * Tl::kLdT + jj] = from_float<T>(st[nt][e]);
              }
            }
          }
          __syncthreads();
          // dk += dS' Rq over the warp's c in [16 w, 16 w + kWarpBand)
          warp_mma_kn<T, kDT, Tl::kWarpBand / 16>(
              dk,
              [&](int kk, uint32_t (&a)[4]) {
                load_a_frag_t(a, sDSk + (16 * warp + kk * 16) * Tl::kLdT + 16 * warp, Tl::kLdT,
                              lane);
              },
              sRq + 16 * warp * Tl::kLdK, Tl::kLdK, lane);
          // drel_q[b(c)] += scale dS'^T K, 16 values of c by half the columns at a time (dk and
          // dv stay live: no spills)
          if (pq != nullptr) {
            constexpr int kDTs = kDT / 2;
            RELPOS_NO_UNROLL
            for (int u = warp; u < 2 * kMT; u += Tl::kWarps) {
              const int c0 = 16 * (u / 2), d0 = (u % 2) * kDTs * 8;
              float acc[kDTs][4];
              zero_acc(acc);
              warp_mma_kn<T, kDTs, Tl::kKeys / 16>(
                  acc,
                  [&](int kk, uint32_t (&a)[4]) {
                    load_a_frag(a, sDSk + c0 * Tl::kLdT + kk * 16, Tl::kLdT, lane);
                  },
                  sK + d0, Tl::kLdK, lane);
              RELPOS_UNROLL
              for (int e = 0; e < 4; ++e) {
                const int c = c0 + g + (e / 2) * 8;
                if (c >= Tl::kBand - 1 || dbase + c <= -K || dbase + c >= K) continue;
                float* drow = pq + (dbase + c + K) * D + d0;
                RELPOS_UNROLL
                for (int nt = 0; nt < kDTs; ++nt) {
                  const int d = nt * 8 + 2 * t4 + e % 2;
                  if (d0 + d < D) atomicAdd(drow + d, acc[nt][e] * scale);
                }
              }
            }
          }
        } else {
          RELPOS_UNROLL
          for (int nt = 0; nt < kNT; ++nt) {
            RELPOS_UNROLL
            for (int e = 0; e < 4; ++e) {
              if (all_lo) {
                mk_lo[e / 2] += st[nt][e];
              } else {
                mk_hi[e / 2] += st[nt][e];
              }
            }
          }
        }
      }
    }
    if constexpr (kRelQ) {
      // Head h's clamped buckets: dk += m rel_q[0 / 2K] per key, drel_q[0 / 2K] += scale
      // sum_j m_j k_j per block.
      RELPOS_UNROLL
      for (int r = 0; r < 2; ++r) {
        RELPOS_UNROLL
        for (int x = 1; x <= 2; x *= 2) {
          mk_lo[r] += __shfl_xor_sync(0xffffffffu, mk_lo[r], x);
          mk_hi[r] += __shfl_xor_sync(0xffffffffu, mk_hi[r], x);
        }
        if (t4 == 0) {
          sKm[(warp * 16 + g + 8 * r) * 2 + 0] = mk_lo[r];
          sKm[(warp * 16 + g + 8 * r) * 2 + 1] = mk_hi[r];
        }
        RELPOS_UNROLL
        for (int nt = 0; nt < kDT; ++nt) {
          RELPOS_UNROLL
          for (int x = 0; x < 2; ++x) {
            const int d = nt * 8 + 2 * t4 + x;
            if (d < D) {
              dk[nt][2 * r + x] += mk_lo[r] * to_float(eq[d]) +
                                   mk_hi[r] * to_float(eq[(table_rows - 1) * D + d]);
            }
          }
        }
      }
      __syncthreads();  // sKm complete
      if (pq != nullptr) {
        for (int idx = threadIdx.x; idx < 2 * D; idx += Tl::kThreads) {
          const int d = idx % D, hi = idx / D;
          float x = 0;
          for (int r = 0; r < nk; ++r) x += sKm[r * 2 + hi] * to_float(sK[r * Tl::kLdK + d]);
          atomicAdd(pq + (hi ? table_rows - 1 : 0) * D + d, x * scale);
        }
      }
      __syncthreads();  // sKm read before the next head writes it
    }
  }

  T* dkp = static_cast<T*>(bp.dk) + (bkv * p.k_len + j0) * D;
  T* dvp = static_cast<T*>(bp.dv) + (bkv * p.k_len + j0) * D;
  RELPOS_UNROLL
  for (int r = 0; r < 2; ++r) {
    const int row = warp * 16 + g + 8 * r;
    if (row >= nk) continue;
    RELPOS_UNROLL
    for (int nt = 0; nt < kDT; ++nt) {
      if (nt * 8 >= D) break;
      const int d = nt * 8 + 2 * t4;
      st32(dkp + row * D + d, pack2<T>(dk[nt][2 * r] * scale, dk[nt][2 * r + 1] * scale));
      st32(dvp + row * D + d,
           pack2<T>(dv[nt][2 * r] * drop_scale, dv[nt][2 * r + 1] * drop_scale));
    }
  }
}

// Grid: batch * kv_heads * ceil(k_len / 64) blocks, one key tile each; or, with tile >= 0 (rel_q
// in deterministic mode: drel_q takes atomics from every key tile), batch * kv_heads blocks that
// all take key tile `tile`, launched once per tile in order.
// (At least 1 block a multiprocessor, spelt out as in the forward: without it ptxas held the D = 32
// rel_q build to 168 registers on sm_90, where it spilled.)
template <typename T, int kD, bool kRelQ>
__global__ void __launch_bounds__(TcBwdKvTile<kD>::kThreads, 1)
    rel_attention_tc_bwd_dkdv_kernel(RelAttentionBwdParams bp, const float* ws, int64_t tile) {
  const int64_t k_tiles = (bp.fwd.k_len + TcBwdKvTile<kD>::kKeys - 1) / TcBwdKvTile<kD>::kKeys;
  const int64_t bkv = tile < 0 ? blockIdx.x / k_tiles : blockIdx.x;
  tc_bwd_dkdv_tile<T, kD, kRelQ>(bp, ws, bkv, tile < 0 ? blockIdx.x % k_tiles : tile);
}

}  // namespace relpos::cuda
