// AVX2/FMA fused Shaw attention (forward and backward), float32 arithmetic for float32, float16
// and bfloat16 inputs. Maths: RelAttentionParams in common/params.h.
//
// Tiling (flash-attention style): a work item is BQ query rows of one (b, h) in the forward and
// one (b, kv head) in the backward; keys are visited in tiles of BK with an online softmax, so no
// [Lq, Lk] matrix exists. The relative terms split each query row's keys into three parts
// (common/relpos_index.h inner_keys): keys left of the clipping window share bucket 0, keys right
// of it share bucket 2K, and inside it the bucket grows by one per key (the skew). The clamped
// parts are running sums per row; the inside is a band of at most BQ + Lk - 1 buckets per query
// tile, handled with small matmuls: QE = Q @ rel_k[band]^T (key term, added along the skew) and
// W = the probability mass per bucket (value term, W @ rel_v[band] at the end).
// This file is compiled with -mavx2 -mfma -mf16c and includes no torch headers (kernels.h).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "common/params.h"
#include "common/relpos_index.h"
#include "cpu/kernels.h"

namespace relpos::cpu::avx2 {
namespace {

constexpr int64_t BQ = kAttentionTileQ;  // query rows per tile
constexpr int64_t BK = 64;  // keys per tile
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ------------------------------------------------------------------------------ conversions
int64_t elem_bytes(DType d) { return d == DType::Float32 ? 4 : 2; }

float bf16_to_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t float_to_bf16(float f) {  // round to nearest even, NaN stays NaN (as c10::BFloat16)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// n elements of dtype `d` at src -> float dst
void load_row(DType d, const void* src, float* dst, int64_t n) {
  if (d == DType::Float32) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  }
  const uint16_t* s = static_cast<const uint16_t*>(src);
  int64_t i = 0;
  if (d == DType::Float16) {
    for (; i + 8 <= n; i += 8) {
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
    }
    for (; i < n; ++i) dst[i] = _cvtsh_ss(s[i]);
  } else {
    for (; i + 8 <= n; i += 8) {
      const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
      _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
    }
    for (; i < n; ++i) dst[i] = bf16_to_float(s[i]);
  }
}

void store_row(DType d, const float* src, void* dst, int64_t n) {
  if (d == DType::Float32) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  }
  uint16_t* o = static_cast<uint16_t*>(dst);
  if (d == DType::Float16) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o + i),
                       _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    }
    for (; i < n; ++i) o[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
  } else {
    for (int64_t i = 0; i < n; ++i) o[i] = float_to_bf16(src[i]);
  }
}

// rows x cols block of a row-major matrix (leading dim lds, dtype d) -> float, row-major (ldd)
void load_block(DType d, const void* src, int64_t lds, int64_t rows, int64_t cols, float* dst,
                int64_t ldd) {
  const char* s = static_cast<const char*>(src);
  for (int64_t r = 0; r < rows; ++r) load_row(d, s + r * lds * elem_bytes(d), dst + r * ldd, cols);
}

// dst[c, r] = src[r, c] for an r x c float block
void transpose(const float* src, int64_t lds, int64_t rows, int64_t cols, float* dst, int64_t ldd) {
  int64_t r0 = 0;
  for (; r0 + 8 <= rows; r0 += 8) {
    int64_t c0 = 0;
    for (; c0 + 8 <= cols; c0 += 8) {  // 8x8 in registers
      __m256 t[8], u[8];
      for (int k = 0; k < 8; ++k) t[k] = _mm256_loadu_ps(src + (r0 + k) * lds + c0);
      for (int k = 0; k < 8; k += 2) {
        u[k] = _mm256_unpacklo_ps(t[k], t[k + 1]);
        u[k + 1] = _mm256_unpackhi_ps(t[k], t[k + 1]);
      }
      for (int k = 0; k < 8; k += 4) {
        t[k] = _mm256_shuffle_ps(u[k], u[k + 2], 0x44);
        t[k + 1] = _mm256_shuffle_ps(u[k], u[k + 2], 0xEE);
        t[k + 2] = _mm256_shuffle_ps(u[k + 1], u[k + 3], 0x44);
        t[k + 3] = _mm256_shuffle_ps(u[k + 1], u[k + 3], 0xEE);
      }
      for (int k = 0; k < 4; ++k) {
        _mm256_storeu_ps(dst + (c0 + k) * ldd + r0, _mm256_permute2f128_ps(t[k], t[k + 4], 0x20));
        _mm256_storeu_ps(dst + (c0 + k + 4) * ldd + r0, _mm256_permute2f128_ps(t[k], t[k + 4], 0x31));
      }
    }
    for (; c0 < cols; ++c0) {
      for (int64_t r = r0; r < r0 + 8; ++r) dst[c0 * ldd + r] = src[r * lds + c0];
    }
  }
  for (; r0 < rows; ++r0) {
    for (int64_t c = 0; c < cols; ++c) dst[c * ldd + r0] = src[r0 * lds + c];
  }
}

// ------------------------------------------------------------------------------ math
// exp for float32 lanes (Cephes expf range reduction and polynomial, ~1 ulp on [-87, 88]);
// inputs below -87.3 (including -inf, the masked logits) give exactly 0.
inline __m256 exp256(__m256 x) {
  const __m256 underflow = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_LT_OQ);
  x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
  x = _mm256_max_ps(x, _mm256_set1_ps(-88.0f));
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, z, x);
  y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
  const __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(y, _mm256_castsi256_ps(n)));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256i tail_mask(int64_t n) {  // lanes [0, n) of 8 enabled
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), idx);
}

float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = hsum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

void axpy(float alpha, const float* x, float* y, int64_t n) {  // y += alpha x
  const __m256 a = _mm256_set1_ps(alpha);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(a, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += alpha * x[i];
}

void scale_row(float alpha, float* y, int64_t n) {
  const __m256 a = _mm256_set1_ps(alpha);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_mul_ps(a, _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] *= alpha;
}

float sum_row(const float* x, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(x + i));
  float s = hsum(acc);
  for (; i < n; ++i) s += x[i];
  return s;
}

// ------------------------------------------------------------------------------ matmul
// C[M, N] += A[M, K] @ B[K, N], all float row-major. Register block: MR rows x 16 columns, an
// outer product per k (2 loads of B, MR broadcasts of A, 2*MR FMAs).
template <int MR, bool FULL>
inline void gemm_block(int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb,
                       float* C, int64_t ldc, int64_t n) {
  const __m256i m0 = tail_mask(std::min<int64_t>(n, 8));
  const __m256i m1 = tail_mask(std::max<int64_t>(n - 8, 0));
  __m256 c0[MR], c1[MR];
  for (int r = 0; r < MR; ++r) {
    c0[r] = FULL ? _mm256_loadu_ps(C + r * ldc) : _mm256_maskload_ps(C + r * ldc, m0);
    c1[r] = FULL ? _mm256_loadu_ps(C + r * ldc + 8) : _mm256_maskload_ps(C + r * ldc + 8, m1);
  }
  for (int64_t k = 0; k < K; ++k) {
    const float* b = B + k * ldb;
    const __m256 b0 = FULL ? _mm256_loadu_ps(b) : _mm256_maskload_ps(b, m0);
    const __m256 b1 = FULL ? _mm256_loadu_ps(b + 8) : _mm256_maskload_ps(b + 8, m1);
    for (int r = 0; r < MR; ++r) {
      const __m256 a = _mm256_broadcast_ss(A + r * lda + k);
      c0[r] = _mm256_fmadd_ps(a, b0, c0[r]);
      c1[r] = _mm256_fmadd_ps(a, b1, c1[r]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    if (FULL) {
      _mm256_storeu_ps(C + r * ldc, c0[r]);
      _mm256_storeu_ps(C + r * ldc + 8, c1[r]);
    } else {
      _mm256_maskstore_ps(C + r * ldc, m0, c0[r]);
      _mm256_maskstore_ps(C + r * ldc + 8, m1, c1[r]);
    }
  }
}

template <int MR>
inline void gemm_rows(int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
                      int64_t ldb, float* C, int64_t ldc) {
  int64_t j = 0;
  for (; j + 16 <= N; j += 16) gemm_block<MR, true>(K, A, lda, B + j, ldb, C + j, ldc, 16);
  if (j < N) gemm_block<MR, false>(K, A, lda, B + j, ldb, C + j, ldc, N - j);
}

void gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
          int64_t ldb, float* C, int64_t ldc) {
  if (M <= 0 || N <= 0 || K <= 0) return;
  int64_t i = 0;
  for (; i + 6 <= M; i += 6) gemm_rows<6>(N, K, A + i * lda, lda, B, ldb, C + i * ldc, ldc);
  switch (M - i) {
    case 5: gemm_rows<5>(N, K, A + i * lda, lda, B, ldb, C + i * ldc, ldc); break;
    case 4: gemm_rows<4>(N, K, A + i * lda, lda, B, ldb, C + i * ldc, ldc); break;
    case 3: gemm_rows<3>(N, K, A + i * lda, lda, B, ldb, C + i * ldc, ldc); break;
    case 2: gemm_rows<2>(N, K, A + i * lda, lda, B, ldb, C + i * ldc, ldc); break;
    case 1: gemm_rows<1>(N, K, A + i * lda, lda, B, ldb, C + i * ldc, ldc); break;
    default: break;
  }
}

// ------------------------------------------------------------------------------ shared setup
struct Head {
  const char* q;       // this (b, h)'s query rows
  const char* k;       // this (b, kv head)'s keys / values
  const char* v;
  const char* rel_k;   // table rows of head h (or the shared table); null when absent
  const char* rel_v;
  const bool* pad;     // key padding row of batch b, or null
};

Head head_of(const RelAttentionParams& p, int64_t b, int64_t h) {
  const int64_t es = elem_bytes(p.dtype), rows = num_buckets(p.max_distance);
  const int64_t kvh = b * p.kv_heads + h / (p.heads / p.kv_heads);
  Head hd;
  hd.q = static_cast<const char*>(p.q) + (b * p.heads + h) * p.q_len * p.dim * es;
  hd.k = static_cast<const char*>(p.k) + kvh * p.k_len * p.dim * es;
  hd.v = static_cast<const char*>(p.v) + kvh * p.k_len * p.dim * es;
  hd.rel_k = p.rel_k ? static_cast<const char*>(p.rel_k) + (p.rel_k_per_head ? h * rows * p.dim * es : 0) : nullptr;
  hd.rel_v = p.rel_v ? static_cast<const char*>(p.rel_v) + (p.rel_v_per_head ? h * rows * p.dim * es : 0) : nullptr;
  hd.pad = p.key_padding_mask ? p.key_padding_mask + b * p.k_len : nullptr;
  return hd;
}

// The band of inside buckets (1..2K-1) reachable from query rows [i0, i0 + mq): [lo, lo + n).
struct Band {
  int64_t lo = 0, n = 0;
};

Band band_of(const RelAttentionParams& p, int64_t i0, int64_t mq) {
  Band band;
  if (p.max_distance == 0 || p.k_len == 0) return band;
  const int64_t lo = std::max<int64_t>(1, shaw_bucket(i0 + mq - 1, 0, p.max_distance, p.q_offset, p.k_offset));
  const int64_t hi = std::min<int64_t>(2 * p.max_distance - 1,
                                       shaw_bucket(i0, p.k_len - 1, p.max_distance, p.q_offset, p.k_offset));
  if (hi >= lo) {
    band.lo = lo;
    band.n = hi - lo + 1;
  }
  return band;
}

// Per query row, the split of a key tile [j0, j0 + nk) into bucket-0 keys [j0, a), inside keys
// [a, e) (bucket = col0 + j) and bucket-2K keys [e, j0 + nk).
struct RowSplit {
  int64_t a, e, col0;  // col0: band column of key 0 (column of key j is col0 + j)
};

RowSplit split_row(const RelAttentionParams& p, int64_t i, int64_t j0, int64_t nk, const Band& band) {
  const KeySpan in = inner_keys(i, p.k_len, p.max_distance, p.q_offset, p.k_offset);
  RowSplit s;
  s.a = std::clamp(in.begin, j0, j0 + nk);
  s.e = std::clamp(in.end, s.a, j0 + nk);
  // bucket of key j inside the window: r + K = (k_offset + j - q_offset - i) + K
  s.col0 = p.k_offset - p.q_offset - i + p.max_distance - band.lo;
  return s;
}

// Scale a row of logits for query i over keys [j0, j0 + nk) and mask it: keys after the causal
// limit (k_offset + j > q_offset + i) and padded keys become -inf.
void scale_and_mask(const RelAttentionParams& p, const Head& hd, int64_t i, int64_t j0, int64_t nk,
                    float scale, float* sr) {
  int64_t vis = nk;
  if (p.causal) vis = std::clamp<int64_t>(p.q_offset + i - p.k_offset + 1 - j0, 0, nk);
  scale_row(scale, sr, vis);
  std::fill(sr + vis, sr + nk, kNegInf);
  if (hd.pad != nullptr) {
    for (int64_t j = 0; j < vis; ++j) {
      if (hd.pad[j0 + j]) sr[j] = kNegInf;
    }
  }
}

float max_row(const float* x, int64_t n) {
  __m256 mx = _mm256_set1_ps(kNegInf);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(x + i));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  float m = _mm_cvtss_f32(h);
  for (; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

// x[j] = exp(x[j] - shift) over a row (masked -inf entries give 0).
void exp_row(float* x, int64_t n, float shift) {
  const __m256 vs = _mm256_set1_ps(shift);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(x + j, exp256(_mm256_sub_ps(_mm256_loadu_ps(x + j), vs)));
  if (j < n) {
    const __m256i mk = tail_mask(n - j);
    _mm256_maskstore_ps(x + j, mk, exp256(_mm256_sub_ps(_mm256_maskload_ps(x + j, mk), vs)));
  }
}

// dS = scale * P * (dP - d_i), in place in dp (vectorised; P is already exponentiated).
void softmax_grad_row(const float* pr, float* dp, int64_t n, float di, float scale) {
  const __m256 vd = _mm256_set1_ps(di), vsc = _mm256_set1_ps(scale);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 g = _mm256_sub_ps(_mm256_loadu_ps(dp + j), vd);
    _mm256_storeu_ps(dp + j, _mm256_mul_ps(vsc, _mm256_mul_ps(_mm256_loadu_ps(pr + j), g)));
  }
  for (; j < n; ++j) dp[j] = scale * pr[j] * (dp[j] - di);
}

// Add the key term to a row of logits: s[j - j0] += q_i . rel_k[b(i, j)].
void add_rel_logits(float* s, int64_t j0, int64_t nk, const RowSplit& sp, float lo, float hi,
                    const float* qe_row) {
  for (int64_t j = j0; j < sp.a; ++j) s[j - j0] += lo;
  const float* src = qe_row + sp.col0;
  for (int64_t j = sp.a; j < sp.e; ++j) s[j - j0] += src[j];
  for (int64_t j = sp.e; j < j0 + nk; ++j) s[j - j0] += hi;
}

// Accumulate a row of per-key values into per-bucket sums: lo/hi running sums, band row.
void add_bucket_mass(const float* x, int64_t j0, int64_t nk, const RowSplit& sp, float& lo,
                     float& hi, float* w_row) {
  lo += sum_row(x, sp.a - j0);
  hi += sum_row(x + (sp.e - j0), j0 + nk - sp.e);
  float* dst = w_row + sp.col0;
  for (int64_t j = sp.a; j < sp.e; ++j) dst[j] += x[j - j0];
}

// Band rows of a table as float: rows [lo, lo + n) -> [n, D]; and its transpose [D, n].
void load_band(DType d, const char* table, int64_t dim, const Band& band, float* rows,
               float* rows_t) {
  load_block(d, table + band.lo * dim * elem_bytes(d), dim, band.n, dim, rows, dim);
  if (rows_t != nullptr) transpose(rows, dim, band.n, dim, rows_t, band.n);
}

// Key tile [j0, j0 + nk) as float, row-major [nk, D] and/or transposed [D, BK].
void load_keys(DType d, const char* base, int64_t dim, int64_t j0, int64_t nk, float* rows,
               float* rows_t) {
  load_block(d, base + j0 * dim * elem_bytes(d), dim, nk, dim, rows, dim);
  if (rows_t != nullptr) transpose(rows, dim, nk, dim, rows_t, BK);
}

int64_t last_key_tile(const RelAttentionParams& p, int64_t i_last) {
  int64_t k_end = p.k_len;
  if (p.causal) k_end = std::clamp<int64_t>(p.q_offset + i_last - p.k_offset + 1, 0, p.k_len);
  return (k_end + BK - 1) / BK;
}

}  // namespace

// ------------------------------------------------------------------------------ forward
// Work items: (b, h, query tile of BQ rows) of batch * heads * ceil(q_len / BQ).
void rel_attention(const RelAttentionParams& p, int64_t begin, int64_t end) {
  const int64_t D = p.dim, K = p.max_distance, rows_tab = num_buckets(K);
  const int64_t q_tiles = (p.q_len + BQ - 1) / BQ, es = elem_bytes(p.dtype);
  const int64_t max_band = std::min<int64_t>(std::max<int64_t>(2 * K - 1, 0), BQ + p.k_len);
  const int64_t n_ktiles = (p.k_len + BK - 1) / BK;
  const float scale = static_cast<float>(p.scale);
  std::vector<float> qf(BQ * D), kf(BK * D), kt(D * BK), vf(BK * D), s(BQ * BK), acc(BQ * D);
  std::vector<float> m(BQ), l(BQ), qe_lo(BQ), qe_hi(BQ), w_lo(BQ), w_hi(BQ), row(D);
  std::vector<float> band_k(max_band * D), band_kt(D * max_band), qe(BQ * max_band);
  std::vector<float> band_v(max_band * D), w(BQ * max_band), mref(BQ * n_ktiles), ek0(D), ek1(D);
  for (int64_t item = begin; item < end; ++item) {
    const int64_t qt = item % q_tiles, h = (item / q_tiles) % p.heads, b = item / (q_tiles * p.heads);
    const int64_t i0 = qt * BQ, mq = std::min(BQ, p.q_len - i0);
    const Head hd = head_of(p, b, h);
    load_block(p.dtype, hd.q + i0 * D * es, D, mq, D, qf.data(), D);
    const Band band = band_of(p, i0, mq);
    if (hd.rel_k) {  // QE = Q @ rel_k[band]^T, and the two clamped buckets per row
      load_row(p.dtype, hd.rel_k, ek0.data(), D);
      load_row(p.dtype, hd.rel_k + (rows_tab - 1) * D * es, ek1.data(), D);
      for (int64_t r = 0; r < mq; ++r) {
        qe_lo[r] = dot(qf.data() + r * D, ek0.data(), D);
        qe_hi[r] = dot(qf.data() + r * D, ek1.data(), D);
      }
      if (band.n > 0) {
        load_band(p.dtype, hd.rel_k, D, band, band_k.data(), band_kt.data());
        std::fill(qe.begin(), qe.begin() + mq * band.n, 0.f);
        gemm(mq, band.n, D, qf.data(), D, band_kt.data(), band.n, qe.data(), band.n);
      }
    }
    std::fill(m.begin(), m.end(), kNegInf);
    std::fill(l.begin(), l.end(), 0.f);
    std::fill(w_lo.begin(), w_lo.end(), 0.f);
    std::fill(w_hi.begin(), w_hi.end(), 0.f);
    std::fill(acc.begin(), acc.begin() + mq * D, 0.f);
    if (hd.rel_v) {
      std::fill(w.begin(), w.begin() + mq * band.n, 0.f);
      std::fill(mref.begin(), mref.begin() + mq * n_ktiles, kNegInf);
    }
    const int64_t kt_end = last_key_tile(p, i0 + mq - 1);
    for (int64_t t = 0; t < kt_end; ++t) {
      const int64_t j0 = t * BK, nk = std::min(BK, p.k_len - j0);
      load_keys(p.dtype, hd.k, D, j0, nk, kf.data(), kt.data());
      std::fill(s.begin(), s.begin() + mq * BK, 0.f);
      gemm(mq, nk, D, qf.data(), D, kt.data(), BK, s.data(), BK);  // S = Q K^T
      for (int64_t r = 0; r < mq; ++r) {
        const int64_t i = i0 + r;
        float* sr = s.data() + r * BK;
        const RowSplit sp = split_row(p, i, j0, nk, band);
        if (hd.rel_k) add_rel_logits(sr, j0, nk, sp, qe_lo[r], qe_hi[r], qe.data() + r * band.n);
        scale_and_mask(p, hd, i, j0, nk, scale, sr);
        const float mt = std::max(m[r], max_row(sr, nk));
        if (mt == kNegInf) {  // nothing visible yet in this row
          std::fill(sr, sr + nk, 0.f);
          continue;
        }
        const float alpha = m[r] == kNegInf ? 0.f : std::exp(m[r] - mt);
        exp_row(sr, nk, mt);
        l[r] = l[r] * alpha + sum_row(sr, nk);
        if (alpha != 1.f) scale_row(alpha, acc.data() + r * D, D);
        if (hd.rel_v) {
          w_lo[r] *= alpha;
          w_hi[r] *= alpha;
          add_bucket_mass(sr, j0, nk, sp, w_lo[r], w_hi[r], w.data() + r * band.n);
          mref[r * n_ktiles + t] = mt;  // the band entries of this tile are relative to mt
        }
        m[r] = mt;
      }
      load_block(p.dtype, hd.v + j0 * D * es, D, nk, D, vf.data(), D);
      gemm(mq, D, nk, s.data(), BK, vf.data(), D, acc.data(), D);  // acc += P V
    }
    if (hd.rel_v) {  // value term: acc += W @ rel_v[band] + the clamped buckets
      for (int64_t r = 0; r < mq; ++r) {
        if (m[r] == kNegInf || band.n == 0) continue;
        float* wr = w.data() + r * band.n;
        const int64_t i = i0 + r;
        for (int64_t c = 0; c < band.n; ++c) {
          if (wr[c] == 0.f) continue;
          // key of this bucket in row i, and the max its weight was taken relative to
          const int64_t j = c + band.lo - K - p.k_offset + p.q_offset + i;
          wr[c] *= std::exp(mref[r * n_ktiles + j / BK] - m[r]);
        }
      }
      if (band.n > 0) {
        load_band(p.dtype, hd.rel_v, D, band, band_v.data(), nullptr);
        gemm(mq, D, band.n, w.data(), band.n, band_v.data(), D, acc.data(), D);
      }
      load_row(p.dtype, hd.rel_v, ek0.data(), D);
      load_row(p.dtype, hd.rel_v + (rows_tab - 1) * D * es, ek1.data(), D);
      for (int64_t r = 0; r < mq; ++r) {
        axpy(w_lo[r], ek0.data(), acc.data() + r * D, D);
        axpy(w_hi[r], ek1.data(), acc.data() + r * D, D);
      }
    }
    float* lse = static_cast<float*>(p.lse) + (b * p.heads + h) * p.q_len + i0;
    char* out = static_cast<char*>(p.out) + ((b * p.heads + h) * p.q_len + i0) * D * es;
    for (int64_t r = 0; r < mq; ++r) {
      if (m[r] == kNegInf || l[r] == 0.f) {
        std::fill(row.begin(), row.end(), 0.f);
        lse[r] = std::numeric_limits<float>::infinity();
      } else {
        const float inv = 1.f / l[r];
        for (int64_t d = 0; d < D; ++d) row[d] = acc[r * D + d] * inv;
        lse[r] = m[r] + std::log(l[r]);
      }
      store_row(p.dtype, row.data(), out + r * D * es, D);
    }
  }
}

// ------------------------------------------------------------------------------ backward
// Work items: (b, kv head) of batch * kv_heads. dk/dv of the kv head accumulate in float here;
// each query head of the group adds its table gradients into its own (b, h) partial.
void rel_attention_backward(const RelAttentionBwdParams& bp, int64_t begin, int64_t end) {
  const RelAttentionParams& p = bp.fwd;
  const int64_t D = p.dim, K = p.max_distance, rows_tab = num_buckets(K), es = elem_bytes(p.dtype);
  const int64_t group = p.heads / p.kv_heads;
  const int64_t max_band = std::min<int64_t>(std::max<int64_t>(2 * K - 1, 0), BQ + p.k_len);
  const float scale = static_cast<float>(p.scale);
  std::vector<float> dk_acc(p.k_len * D), dv_acc(p.k_len * D);
  std::vector<float> qf(BQ * D), dof(BQ * D), of(BQ * D), dq(BQ * D), kf(BK * D), kt(D * BK);
  std::vector<float> vf(BK * D), vt(D * BK);
  std::vector<float> s(BQ * BK), dp(BQ * BK), tt(BK * BQ), lse(BQ), di(BQ), row(D);
  std::vector<float> qe_lo(BQ), qe_hi(BQ), de_lo(BQ), de_hi(BQ), ds_lo(BQ), ds_hi(BQ), p_lo(BQ), p_hi(BQ);
  std::vector<float> band_k(max_band * D), band_kt(D * max_band), band_v(max_band * D), band_vt(D * max_band);
  std::vector<float> qe(BQ * max_band), de(BQ * max_band), wds(BQ * max_band), wp(BQ * max_band);
  std::vector<float> wt(max_band * BQ), ek0(D), ek1(D), ev0(D), ev1(D);
  for (int64_t item = begin; item < end; ++item) {
    const int64_t b = item / p.kv_heads, hk = item % p.kv_heads;
    std::fill(dk_acc.begin(), dk_acc.end(), 0.f);
    std::fill(dv_acc.begin(), dv_acc.end(), 0.f);
    for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
      const Head hd = head_of(p, b, h);
      const int64_t bh = b * p.heads + h;
      float* pk = bp.drel_k_partial ? static_cast<float*>(bp.drel_k_partial) + bh * rows_tab * D : nullptr;
      float* pv = bp.drel_v_partial ? static_cast<float*>(bp.drel_v_partial) + bh * rows_tab * D : nullptr;
      if (hd.rel_k) {
        load_row(p.dtype, hd.rel_k, ek0.data(), D);
        load_row(p.dtype, hd.rel_k + (rows_tab - 1) * D * es, ek1.data(), D);
      }
      if (hd.rel_v) {
        load_row(p.dtype, hd.rel_v, ev0.data(), D);
        load_row(p.dtype, hd.rel_v + (rows_tab - 1) * D * es, ev1.data(), D);
      }
      for (int64_t i0 = 0; i0 < p.q_len; i0 += BQ) {
        const int64_t mq = std::min(BQ, p.q_len - i0);
        const int64_t row0 = bh * p.q_len + i0;
        load_block(p.dtype, hd.q + i0 * D * es, D, mq, D, qf.data(), D);
        load_block(p.dtype, static_cast<const char*>(bp.grad_out) + row0 * D * es, D, mq, D, dof.data(), D);
        load_block(p.dtype, static_cast<const char*>(p.out) + row0 * D * es, D, mq, D, of.data(), D);
        for (int64_t r = 0; r < mq; ++r) {
          lse[r] = static_cast<const float*>(p.lse)[row0 + r];
          di[r] = dot(dof.data() + r * D, of.data() + r * D, D);
        }
        const Band band = band_of(p, i0, mq);
        if (hd.rel_k) {
          for (int64_t r = 0; r < mq; ++r) {
            qe_lo[r] = dot(qf.data() + r * D, ek0.data(), D);
            qe_hi[r] = dot(qf.data() + r * D, ek1.data(), D);
          }
          if (band.n > 0) {
            load_band(p.dtype, hd.rel_k, D, band, band_k.data(), band_kt.data());
            std::fill(qe.begin(), qe.begin() + mq * band.n, 0.f);
            gemm(mq, band.n, D, qf.data(), D, band_kt.data(), band.n, qe.data(), band.n);
          }
          std::fill(wds.begin(), wds.begin() + mq * band.n, 0.f);
          std::fill(ds_lo.begin(), ds_lo.end(), 0.f);
          std::fill(ds_hi.begin(), ds_hi.end(), 0.f);
        }
        if (hd.rel_v) {
          for (int64_t r = 0; r < mq; ++r) {
            de_lo[r] = dot(dof.data() + r * D, ev0.data(), D);
            de_hi[r] = dot(dof.data() + r * D, ev1.data(), D);
          }
          if (band.n > 0) {
            load_band(p.dtype, hd.rel_v, D, band, band_v.data(), band_vt.data());
            std::fill(de.begin(), de.begin() + mq * band.n, 0.f);
            gemm(mq, band.n, D, dof.data(), D, band_vt.data(), band.n, de.data(), band.n);
          }
          std::fill(wp.begin(), wp.begin() + mq * band.n, 0.f);
          std::fill(p_lo.begin(), p_lo.end(), 0.f);
          std::fill(p_hi.begin(), p_hi.end(), 0.f);
        }
        std::fill(dq.begin(), dq.begin() + mq * D, 0.f);
        const int64_t kt_end = last_key_tile(p, i0 + mq - 1);
        for (int64_t t = 0; t < kt_end; ++t) {
          const int64_t j0 = t * BK, nk = std::min(BK, p.k_len - j0);
          load_keys(p.dtype, hd.k, D, j0, nk, kf.data(), kt.data());
          load_keys(p.dtype, hd.v, D, j0, nk, vf.data(), vt.data());
          std::fill(s.begin(), s.begin() + mq * BK, 0.f);
          std::fill(dp.begin(), dp.begin() + mq * BK, 0.f);
          gemm(mq, nk, D, qf.data(), D, kt.data(), BK, s.data(), BK);     // S = Q K^T
          gemm(mq, nk, D, dof.data(), D, vt.data(), BK, dp.data(), BK);   // dP = dO V^T
          for (int64_t r = 0; r < mq; ++r) {
            const int64_t i = i0 + r;
            float* sr = s.data() + r * BK;
            float* dpr = dp.data() + r * BK;
            const RowSplit sp = split_row(p, i, j0, nk, band);
            if (hd.rel_k) add_rel_logits(sr, j0, nk, sp, qe_lo[r], qe_hi[r], qe.data() + r * band.n);
            if (hd.rel_v) add_rel_logits(dpr, j0, nk, sp, de_lo[r], de_hi[r], de.data() + r * band.n);
            scale_and_mask(p, hd, i, j0, nk, scale, sr);  // P = exp(S * scale - lse)
            exp_row(sr, nk, lse[r]);
            softmax_grad_row(sr, dpr, nk, di[r], scale);  // dS = scale P (dP - D_i)
            if (hd.rel_v) add_bucket_mass(sr, j0, nk, sp, p_lo[r], p_hi[r], wp.data() + r * band.n);
            if (hd.rel_k) add_bucket_mass(dpr, j0, nk, sp, ds_lo[r], ds_hi[r], wds.data() + r * band.n);
          }
          transpose(s.data(), BK, mq, nk, tt.data(), BQ);  // P^T [nk, mq]
          gemm(nk, D, mq, tt.data(), BQ, dof.data(), D, dv_acc.data() + j0 * D, D);  // dV += P^T dO
          transpose(dp.data(), BK, mq, nk, tt.data(), BQ);  // dS^T
          gemm(nk, D, mq, tt.data(), BQ, qf.data(), D, dk_acc.data() + j0 * D, D);  // dK += dS^T Q
          gemm(mq, D, nk, dp.data(), BK, kf.data(), D, dq.data(), D);               // dQ += dS K
        }
        if (hd.rel_k) {  // dQ += W_ds @ rel_k; drel_k += W_ds^T Q (band and clamped buckets)
          if (band.n > 0) {
            gemm(mq, D, band.n, wds.data(), band.n, band_k.data(), D, dq.data(), D);
            transpose(wds.data(), band.n, mq, band.n, wt.data(), BQ);
            gemm(band.n, D, mq, wt.data(), BQ, qf.data(), D, pk + band.lo * D, D);
          }
          for (int64_t r = 0; r < mq; ++r) {
            axpy(ds_lo[r], ek0.data(), dq.data() + r * D, D);
            axpy(ds_hi[r], ek1.data(), dq.data() + r * D, D);
            axpy(ds_lo[r], qf.data() + r * D, pk, D);
            axpy(ds_hi[r], qf.data() + r * D, pk + (rows_tab - 1) * D, D);
          }
        }
        if (hd.rel_v) {  // drel_v += W_p^T dO
          if (band.n > 0) {
            transpose(wp.data(), band.n, mq, band.n, wt.data(), BQ);
            gemm(band.n, D, mq, wt.data(), BQ, dof.data(), D, pv + band.lo * D, D);
          }
          for (int64_t r = 0; r < mq; ++r) {
            axpy(p_lo[r], dof.data() + r * D, pv, D);
            axpy(p_hi[r], dof.data() + r * D, pv + (rows_tab - 1) * D, D);
          }
        }
        char* dq_out = static_cast<char*>(bp.dq) + row0 * D * es;
        for (int64_t r = 0; r < mq; ++r) store_row(p.dtype, dq.data() + r * D, dq_out + r * D * es, D);
      }
    }
    const int64_t kv_off = item * p.k_len * D * es;
    for (int64_t j = 0; j < p.k_len; ++j) {
      store_row(p.dtype, dk_acc.data() + j * D, static_cast<char*>(bp.dk) + kv_off + j * D * es, D);
      store_row(p.dtype, dv_acc.data() + j * D, static_cast<char*>(bp.dv) + kv_off + j * D * es, D);
    }
  }
}

}  // namespace relpos::cpu::avx2
