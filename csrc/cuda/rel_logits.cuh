// rel_logits, the fused skewed matmul (Huang et al. 2018), and bucket_sum, the first stage of its
// backward (see BucketSumParams):
//   rel_logits:  out[b, h, i, j] = q[b, h, i, :] . table[(h,) b(i, j), :]
//   bucket_sum:  wsum[b, h, i, c] = sum_{j: b(i, j) = bucket0 + c} grad[b, h, i, j]
#pragma once

#include "common/params.h"
#include "common/relpos_index.h"
#include "cuda/device.cuh"
#include "cuda/dtype.cuh"

namespace relpos::cuda {

// ---- rel_logits ---------------------------------------------------------------------------------
// One block = (b, h, tile of kTI query rows x kTJ keys). b(i, j) grows with j and shrinks with i,
// so the tile reaches the contiguous buckets [b(i_last, j_first), b(i_first, j_last)]: at most
// kTI + kTJ - 1 table rows, and far fewer when the tile lies in a clamped region. The block
// computes QE[ii, t] = q[i0 + ii] . table[bmin + t] for all of them as a small GEMM (q tile and
// table rows staged in shared memory, kDK columns of D at a time), then writes the skewed tile
// out[i, j] = QE[i - i0, b(i, j) - bmin] with coalesced stores.
// Thread layout of the GEMM: 256 threads = 16 (tx) x 16 (ty); thread (tx, ty) owns rows ty and
// ty + 16 and the columns tx + 16 k for k < kNK, where kNK = ceil(nb / 16) is chosen per tile
// (uniform in the block) so narrow clamped tiles do not pay for 96 columns.
struct RelLogitsTile {
  static constexpr int kTI = 32;         // query rows per tile
  static constexpr int kTJ = 64;         // keys per tile
  static constexpr int kNBMax = 96;      // >= kTI + kTJ - 1 buckets, a multiple of 16
  static constexpr int kThreads = 256;
};

template <typename A>
struct RelLogitsSmem {
  static constexpr int kDK = sizeof(A) == 8 ? 16 : 32;  // keeps double under 48 KiB static
  A q[RelLogitsTile::kTI][kDK + 1];                      // +1: conflict-free column reads
  A e[RelLogitsTile::kNBMax][kDK + 1];
  A qe[RelLogitsTile::kTI][RelLogitsTile::kNBMax + 1];
};

// acc[r][k] += sum_d q[ty + 16 r][d] * e[tx + 16 k][d] over one staged chunk of kDK columns.
template <int kNK, typename A>
RELPOS_DEVICE void rel_logits_chunk(const RelLogitsSmem<A>& sm, int tx, int ty, A (&acc)[2][6]) {
  RELPOS_UNROLL
  for (int d = 0; d < RelLogitsSmem<A>::kDK; ++d) {
    const A q0 = sm.q[ty][d], q1 = sm.q[ty + 16][d];
    RELPOS_UNROLL
    for (int k = 0; k < kNK; ++k) {
      const A e = sm.e[tx + 16 * k][d];
      acc[0][k] += q0 * e;
      acc[1][k] += q1 * e;
    }
  }
}

template <typename T>
__global__ void rel_logits_kernel(RelLogitsParams p) {
  using A = acc_t<T>;
  using Tile = RelLogitsTile;
  constexpr int kDK = RelLogitsSmem<A>::kDK;
  __shared__ RelLogitsSmem<A> sm;

  const int64_t tiles_j = (p.k_len + Tile::kTJ - 1) / Tile::kTJ;
  const int64_t tiles_i = (p.q_len + Tile::kTI - 1) / Tile::kTI;
  const int64_t tile = blockIdx.x;
  const int64_t tj = tile % tiles_j, ti = (tile / tiles_j) % tiles_i;
  const int64_t bh = tile / (tiles_j * tiles_i);  // b * heads + h
  const int64_t h = bh % p.heads;
  const int64_t i0 = ti * Tile::kTI, j0 = tj * Tile::kTJ;
  const int64_t ni = p.q_len - i0 < Tile::kTI ? p.q_len - i0 : Tile::kTI;
  const int64_t nj = p.k_len - j0 < Tile::kTJ ? p.k_len - j0 : Tile::kTJ;
  const int64_t bmin = shaw_bucket(i0 + ni - 1, j0, p.max_distance, p.q_offset, p.k_offset);
  const int64_t bmax = shaw_bucket(i0, j0 + nj - 1, p.max_distance, p.q_offset, p.k_offset);
  const int nb = static_cast<int>(bmax - bmin + 1);  // <= kTI + kTJ - 1
  const int nk = (nb + 15) / 16;                     // column groups of 16 in use

  const T* q = static_cast<const T*>(p.q) + (bh * p.q_len + i0) * p.dim;
  const T* tab = static_cast<const T*>(p.table) +
                 ((p.table_per_head ? h * num_buckets(p.max_distance) : 0) + bmin) * p.dim;
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;

  A acc[2][6];
  RELPOS_UNROLL
  for (int r = 0; r < 2; ++r) {
    RELPOS_UNROLL
    for (int k = 0; k < 6; ++k) acc[r][k] = 0;
  }

  for (int64_t d0 = 0; d0 < p.dim; d0 += kDK) {
    // Stage q[i0 .. i0 + kTI) and table[bmin .. bmin + 16 nk) columns [d0, d0 + kDK), zero-padded.
    for (int idx = tid; idx < Tile::kTI * kDK; idx += Tile::kThreads) {
      const int r = idx / kDK, c = idx % kDK;
      sm.q[r][c] = (r < ni && d0 + c < p.dim) ? to_float(q[r * p.dim + d0 + c]) : A(0);
    }
    for (int idx = tid; idx < 16 * nk * kDK; idx += Tile::kThreads) {
      const int r = idx / kDK, c = idx % kDK;
      sm.e[r][c] = (r < nb && d0 + c < p.dim) ? to_float(tab[r * p.dim + d0 + c]) : A(0);
    }
    __syncthreads();
    if (nk <= 2) {
      rel_logits_chunk<2>(sm, tx, ty, acc);
    } else if (nk <= 4) {
      rel_logits_chunk<4>(sm, tx, ty, acc);
    } else {
      rel_logits_chunk<6>(sm, tx, ty, acc);
    }
    __syncthreads();  // the next chunk overwrites sm.q and sm.e
  }

  RELPOS_UNROLL
  for (int r = 0; r < 2; ++r) {
    RELPOS_UNROLL
    for (int k = 0; k < 6; ++k) sm.qe[ty + 16 * r][tx + 16 * k] = acc[r][k];
  }
  __syncthreads();

  T* out = static_cast<T*>(p.out) + (bh * p.q_len + i0) * p.k_len + j0;
  for (int idx = tid; idx < Tile::kTI * Tile::kTJ; idx += Tile::kThreads) {
    const int r = idx / Tile::kTJ, c = idx % Tile::kTJ;
    if (r < ni && c < nj) {
      const int64_t t =
          shaw_bucket(i0 + r, j0 + c, p.max_distance, p.q_offset, p.k_offset) - bmin;
      out[r * p.k_len + c] = from_float<T>(sm.qe[r][t]);
    }
  }
}

// ---- bucket_sum ---------------------------------------------------------------------------------
// One warp per query row (kBucketSumWarps rows per block). The clamped buckets 0 and 2K collect
// whole key ranges: each lane sums a strided share and a butterfly of __shfl_xor_sync adds the 32
// partials in a fixed pattern (every lane ends with the same bits). Every other column c holds
// the gradient of the one key at distance bucket0 + c - K, or 0 when that key is out of range.
constexpr int kBucketSumWarps = 8;

template <typename T>
__global__ void bucket_sum_kernel(BucketSumParams p) {
  using A = acc_t<T>;
  const int lane = threadIdx.x % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kBucketSumWarps + threadIdx.x / 32;
  if (row >= p.batch * p.heads * p.q_len) return;  // the whole warp leaves together
  const int64_t i = row % p.q_len;
  const int64_t last = 2 * p.max_distance;
  const T* g = static_cast<const T*>(p.grad) + row * p.k_len;
  A* w = static_cast<A*>(p.wsum) + row * p.num_cols;

  const KeySpan lo = bucket_keys(i, 0, p.k_len, p.max_distance, p.q_offset, p.k_offset);
  const KeySpan hi = bucket_keys(i, last, p.k_len, p.max_distance, p.q_offset, p.k_offset);
  A s_lo = 0, s_hi = 0;
  for (int64_t j = lo.begin + lane; j < lo.end; j += 32) s_lo += to_float(g[j]);
  if (last != 0) {  // for K = 0 bucket 0 is bucket 2K: already summed
    for (int64_t j = hi.begin + lane; j < hi.end; j += 32) s_hi += to_float(g[j]);
  }
  s_lo = warp_sum(s_lo);
  s_hi = warp_sum(s_hi);

  for (int64_t c = lane; c < p.num_cols; c += 32) {
    const int64_t b = p.bucket0 + c;
    A v;
    if (b == 0) {
      v = s_lo;
    } else if (b == last) {
      v = s_hi;
    } else {
      const KeySpan k = bucket_keys(i, b, p.k_len, p.max_distance, p.q_offset, p.k_offset);
      v = k.end > k.begin ? to_float(g[k.begin]) : A(0);
    }
    w[c] = v;
  }
}

}  // namespace relpos::cuda
