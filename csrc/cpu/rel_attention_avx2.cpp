// AVX2/FMA fused Shaw attention (forward and backward), float32 arithmetic for float32, float16
// and bfloat16 inputs (but for the AVX-512 build's bfloat16 dot products, "bfloat16 dots"
// below). Maths: RelAttentionParams in common/params.h.
//
// Tiling (flash-attention style): a work item is BQ query rows of one (b, h) in the forward and
// one (b, kv head) in the backward; keys are visited in tiles of BK with an online softmax, so no
// [Lq, Lk] matrix exists. The forward takes tiles of kAttentionWideTile rows and keys instead
// when no mask hides keys tile by tile (AttentionFwdSplit::tile). The relative terms split each
// query row's keys into three parts (common/relpos_index.h inner_keys): keys left of the
// clipping window share bucket 0, keys right of it share bucket 2K, and inside it the bucket
// grows by one per key (the skew). The clamped parts are running sums per row; the inside is a
// band of at most BQ + Lk - 1 buckets per query tile (of the keys the tile sees: seen_keys),
// handled with small matmuls:
// QE = Q @ rel_k[band]^T (key term, added along the skew) and W = the probability mass per
// bucket (value term, W @ rel_v[band] at the end).
// Logits are in natural units, as the op's log-sum-exp: the query tile is multiplied by the scale
// before S = Q K^T and QE = Q rel_k^T, so the softmax needs no per-logit scaling; its exponential
// (exp_256) takes log2(e) into its range reduction (see expv for why not base 2).
// Every exponent is formed as (s + term) - m, or (s + term) - lse in the backward, in that order:
// the backward recomputes P = e^(s - lse), which holds only while its logits are bitwise the
// forward's (once an ulp of the logits nears 1, a logit one ulp off makes P e^ulp times too
// large), so S, the terms and their sum are computed by the same operations in both, and
// the term is not folded into the maximum or the lse first (s + (c - lse) rounds c - lse on
// the lse's grid, which differs from the logit's where the two straddle a power of 2).
// A bias per bucket (rel_bias, added after the scale) is part of the key term: rel_bias[b]
// joins QE's band column or clamped bucket, so the key loops do not see it; the backward
// takes its gradient from the per-bucket sums of dS that drel_k needs anyway.
// The key-side table rel_q (k_j . rel_q[b], DeBERTa's position-to-content term) is the key term
// with queries and keys swapped, so its values vary per key, not per row: per key tile, the
// keys' clamped-bucket values (2 x BK) and, where the tile meets the band, KE^T = rel_q[band]
// K^T read along the skew's diagonal; both join S right after Q K^T, so the paths below see
// finished logits. The backward sums dS per key in the clamped buckets and per (bucket, key) in
// the band (WK^T), for dK and drel_q by small matmuls (add_key_side, key_side_grad).
// This file is compiled with -mavx2 -mfma -mf16c and includes no torch headers (kernels.h). It is
// compiled a second time, with AVX-512 flags and into namespace avx512, by
// rel_attention_avx512.cpp: there the matmul blocks (gemm_block) are 16 lanes wide, with the same
// FMA chains, and the one-pass softmax rows (exp_sum_rows8_stale, grad_rows8_uniform) take 16
// keys at a time; their 8-lane loops sum the even and the odd 8-key chunks apart, which are the
// two halves of the 16-lane sums, so both builds give bitwise the same results.
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>

#include "common/dropout.h"
#include "common/params.h"
#include "common/relpos_index.h"
#include "cpu/kernels.h"
#include "cpu/vec_avx2.h"

#ifndef RELPOS_ISA
#define RELPOS_ISA avx2
#endif

namespace relpos::cpu::RELPOS_ISA {
using namespace relpos::cpu::avx2;  // vec_avx2.h's helpers, when compiled as namespace avx512
namespace {

constexpr int64_t BQ = kAttentionTileQ;  // query rows per tile
constexpr int64_t BK = kAttentionTileK;  // keys per tile
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kLog2e = static_cast<float>(relpos::kLog2e);  // common/params.h
constexpr float kLn2 = static_cast<float>(relpos::kLn2);
// Forward, up to kAttentionFewQueries rows (kernels.h): from this many rows on, a
// float16/bfloat16 cache is converted to float a key tile at a time (below, each row converts
// the keys it reads; 16 rows x 4k bfloat16 keys: 1.48 -> 1.0 ms)
constexpr int64_t kConvertTileRows = 4;

// ------------------------------------------------------------------------------ conversions
int64_t elem_bytes(DType d) { return d == DType::Float32 ? 4 : 2; }

inline int64_t iclamp(int64_t v, int64_t lo, int64_t hi) { return v < lo ? lo : (v > hi ? hi : v); }
inline float fmax_(float a, float b) { return a > b ? a : b; }

// n elements of dtype `d` at src -> float dst, and back
void load_row(DType d, const void* src, float* dst, int64_t n) {
  dispatch(d, [&](auto tag) { convert_load(dst, static_cast<const decltype(tag)*>(src), n); });
}

void store_row(DType d, const float* src, void* dst, int64_t n) {
  dispatch(d, [&](auto tag) { convert_store(static_cast<decltype(tag)*>(dst), src, n); });
}

// A thread's arena for Buffers: one 64-byte aligned block, kept between kernel calls.
struct Arena {
  char* base = nullptr;
  int64_t cap = 0;   // bytes
  int64_t want = 0;  // what the last call on the thread took in all, up to kArenaKeepBytes
  bool in_use = false;
  Arena() = default;
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
  ~Arena() { std::free(base); }
};
thread_local Arena t_arena;

// The most an arena keeps between calls, per thread (1 MiB: what a forward or backward over
// 2k keys needs with D = 64).
constexpr int64_t kArenaKeepBytes = int64_t(1) << 20;

// Float buffers for one kernel call, 64-byte aligned, carved from the calling thread's arena in
// the order taken. What does not fit comes from the heap, one allocation per take (freed when
// the Buffers goes), and the thread's next call grows the arena to fit this one's total, up to
// kArenaKeepBytes (at its start: a thread that ends after one call, as the std::thread source's
// do, allocates nothing more). A small call thus allocates nothing: its 25-64 takes were as many
// aligned_alloc / free pairs, about 1.3 us of a 10 us call. A Buffers made while another is
// alive on the thread (none is today) takes everything from the heap. No std::vector here (the
// ODR note in vec_avx2.h). The backward has 64 takes, not all in one call.
class Buffers {
 public:
  Buffers() : arena_(t_arena.in_use ? nullptr : &t_arena) {
    if (arena_ == nullptr) return;
    arena_->in_use = true;
    if (arena_->want > arena_->cap) {
      std::free(arena_->base);
      arena_->base = static_cast<char*>(alloc_aligned64(arena_->want));
      arena_->cap = arena_->want;
    }
  }
  Buffers(const Buffers&) = delete;
  Buffers& operator=(const Buffers&) = delete;
  ~Buffers() {
    for (int i = 0; i < heap_used_; ++i) std::free(heap_[i]);
    if (arena_ == nullptr) return;
    if (need_ <= kArenaKeepBytes && need_ > arena_->want) arena_->want = need_;
    arena_->in_use = false;
  }
  float* take(int64_t n) {
    const int64_t bytes = aligned_float_bytes(n > 0 ? n : 1);
    need_ += bytes;
    if (arena_ != nullptr && need_ <= arena_->cap) return reinterpret_cast<float*>(arena_->base + need_ - bytes);
    if (heap_used_ == kPool) std::abort();  // (a kernel took more than it was sized for)
    heap_[heap_used_] = alloc_aligned64(bytes);
    return static_cast<float*>(heap_[heap_used_++]);
  }

 private:
  static constexpr int kPool = 72;
  Arena* arena_;
  int64_t need_ = 0;  // bytes taken so far, arena and heap
  void* heap_[kPool];
  int heap_used_ = 0;
};

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
// expv's polynomial for 2^f on [-1/2, 1/2]: its coefficients, highest degree first (Horner).
constexpr float kExp2Poly[6] = {1.327647129073739e-3f, 9.675541892647743e-3f,
                                5.550713092088699e-2f, 2.4022120237350464e-1f,
                                6.931469440460205e-1f, 1.0000001192092896f};
// e^x for float32 lanes (V: Ymm or Zmm, vec_avx2.h), as 2^(x log2 e): x log2 e = n + f with n
// an integer, |f| <= 1/2; 2^f by a degree-5 polynomial (coefficients fitted for relative error on
// [-1/2, 1/2]: at most 2.4e-7, about 2 ulp, in float32 arithmetic), times 2^n built from its
// exponent bits. The range reduction is two FMAs on the exact product x log2 e: t = x log2 e +
// kExp2Shift (1.5 * 2^23 + 127) rounds it to an integer (the spacing of floats there is 1; ties
// go to an odd n) and leaves n + 127 in t's low mantissa bits, so t - kExp2Shift is n (exact),
// f = x log2 e - n is rounded once, and t's bits shifted left by 23 are 2^n (V::shl23): no round
// and no float -> int conversion (see exp_sum_rows8_stale for what it saves). The logits stay in
// natural units (x = s - m, s = scale q.k): f's error is relative to |s - m|, not to |s|, and the
// log-sum-exp the forward stores is m + ln l, exact for a row with one dominant key, so the
// backward's e^(s - lse) gives that key 1 exactly even at logits of 1e9 (keeping the logits in
// base 2 and the lse in base e lost up to 3 ulp of the lse in the round trip: dv 5% off at
// logits of 1e5, inf at 1e9).
// x is clamped to [-127 ln 2, 128 ln 2]: inputs at or below -127 ln 2 (including -inf, the
// masked logits) give exactly 0 (2^-127 is built as +0), those near -126 ln 2 may give a
// denormal, 128 ln 2 and above +inf. NaN stays NaN (max/min return their second operand when
// either is NaN; NaN's shifted bits are 0, and NaN * 0 is NaN).
constexpr float kExp2Shift = 12583039.f;  // 0x1.8p23 + 127
constexpr float kExpMin = static_cast<float>(-127 * relpos::kLn2);
constexpr float kExpMax = static_cast<float>(128 * relpos::kLn2);
template <typename V>
inline typename V::reg expv(typename V::reg x) {
  x = V::min(V::set1(kExpMax), V::max(V::set1(kExpMin), x));
  const typename V::reg l2e = V::set1(kLog2e);
  const typename V::reg t = V::fma(x, l2e, V::set1(kExp2Shift));
  const typename V::reg f = V::fma(x, l2e, V::sub(V::set1(kExp2Shift), t));
  typename V::reg y = V::set1(kExp2Poly[0]);
  for (int c = 1; c < 6; ++c) y = V::fma(y, f, V::set1(kExp2Poly[c]));
  return V::mul(y, V::shl23(t));
}
inline __m256 exp_256(__m256 x) { return expv<Ymm>(x); }

#if defined(__AVX512F__)
// exp_256 on 16 lanes, for the AVX-512 build: bitwise exp_256's result in each lane.
inline __m512 exp_512(__m512 x) { return expv<Zmm>(x); }
#endif

// Decoding streams the whole key/value cache once per call, from memory when it is larger than
// the caches, and the hardware prefetchers do not keep up with that on their own: with 64-byte
// aligned rows (torch's allocations) one row x 16k keys x 8 heads took 6.6 ms on one core, and
// 3.6-4.1 ms when every cache line is prefetched this far ahead of its use. Below kStreamBytes
// of keys per kv head the cache mostly sits in L2/L3 and the prefetches only cost time (1k keys:
// 8% slower), so they are left out there.
constexpr int64_t kPrefetchAhead = 8192;  // bytes
constexpr int64_t kStreamBytes = int64_t(512) << 10;

inline void prefetch_ahead(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p) + kPrefetchAhead;
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(c + o, _MM_HINT_T0);
}

// sums[u] = the sum of the lanes of a[u], for 8 vectors at once (pairwise horizontal adds, then
// the two 128-bit halves)
inline __m256 hsum8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// The reductions below take their last n % 8 entries as one masked vector, not a scalar loop:
// GCC vectorises such a loop as an in-order reduction (products rounded before the adds) to a
// width that depends on the ISA flags, so builds with other flags would round differently.
template <typename T>  // b: float, or float16/bfloat16 converted by load8
float dot(const float* a, const T* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), acc);
  if (i < n) acc = _mm256_fmadd_ps(_mm256_maskload_ps(a + i, tail_mask(n - i)), load_n(b + i, n - i), acc);
  return hsum(acc);
}

void axpy(float alpha, const float* x, float* y, int64_t n) {  // y += alpha x
  const __m256 a = _mm256_set1_ps(alpha);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(a, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += alpha * x[i];
}

void add_const(float c, float* y, int64_t n) {  // y += c
  const __m256 v = _mm256_set1_ps(c);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_add_ps(v, _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += c;
}

void add_row(const float* x, float* y, int64_t n) {  // y += x
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += x[i];
}

void scale_copy(const float* x, float alpha, float* y, int64_t n) {  // y = alpha x (x == y allowed)
  const __m256 a = _mm256_set1_ps(alpha);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_mul_ps(a, _mm256_loadu_ps(x + i)));
  for (; i < n; ++i) y[i] = alpha * x[i];
}

void scale_row(float alpha, float* y, int64_t n) { scale_copy(y, alpha, y, n); }  // y *= alpha

float sum_row(const float* x, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(x + i));
  if (i < n) acc = _mm256_add_ps(acc, _mm256_maskload_ps(x + i, tail_mask(n - i)));
  return hsum(acc);
}

// ------------------------------------------------------------------------------ matmul
// C[M, N] (+)= A[M, K] @ B[K, N], float. B and C are row-major (ldb, ldc); A is read by broadcasts
// at A + m * lda + k * ka, so a transposed operand (ka = its row stride, lda = 1) costs nothing
// extra: P^T dO reads P in place. Register block: MR rows x 2 vectors (16 columns with AVX2, 32
// with AVX-512), an outer product per k (2 loads of B, MR broadcasts of A, 2*MR FMAs); with
// AVX-512, full 64-column strips take 4 x 64 blocks instead (gemm_wide). ACC = false
// overwrites C (no fill, no load). Each C entry is one FMA chain over k ascending, whatever the
// vector width: the AVX-512 build gives bitwise the AVX2 build's results.
// The accumulators are named variables, not an array: GCC kept an array of __m256 on the stack
// inside the k loop (a store per FMA), which halved the speed.
template <typename V, int MR, bool FULL, bool ACC>
inline void gemm_block(int64_t K, const float* A, int64_t lda, int64_t ka, const float* B,
                       int64_t ldb, float* C, int64_t ldc, int64_t n) {
  using reg = typename V::reg;
  constexpr int64_t W = V::kLanes;
  const typename V::mask m0 = V::tail(n), m1 = V::tail(n - W);
  auto load = [&](const float* ptr, const typename V::mask& mk) {
    return FULL ? V::load(ptr) : V::load(ptr, mk);
  };
  auto loadc = [&](const float* ptr, const typename V::mask& mk) {
    return ACC ? load(ptr, mk) : V::zero();
  };
  auto store = [&](float* ptr, const typename V::mask& mk, reg v) {
    if (FULL) {
      V::store(ptr, v);
    } else {
      V::store(ptr, mk, v);
    }
  };
  const reg z = V::zero();
  reg c00 = loadc(C, m0), c01 = loadc(C + W, m1);
  reg c10 = MR > 1 ? loadc(C + ldc, m0) : z, c11 = MR > 1 ? loadc(C + ldc + W, m1) : z;
  reg c20 = MR > 2 ? loadc(C + 2 * ldc, m0) : z, c21 = MR > 2 ? loadc(C + 2 * ldc + W, m1) : z;
  reg c30 = MR > 3 ? loadc(C + 3 * ldc, m0) : z, c31 = MR > 3 ? loadc(C + 3 * ldc + W, m1) : z;
  reg c40 = MR > 4 ? loadc(C + 4 * ldc, m0) : z, c41 = MR > 4 ? loadc(C + 4 * ldc + W, m1) : z;
  reg c50 = MR > 5 ? loadc(C + 5 * ldc, m0) : z, c51 = MR > 5 ? loadc(C + 5 * ldc + W, m1) : z;
  const float* a = A;
  const float* b = B;
  for (int64_t k = 0; k < K; ++k, a += ka, b += ldb) {
    const reg b0 = load(b, m0), b1 = load(b + W, m1);
    reg x = V::bcast(a);
    c00 = V::fma(x, b0, c00);
    c01 = V::fma(x, b1, c01);
    if constexpr (MR > 1) {
      x = V::bcast(a + lda);
      c10 = V::fma(x, b0, c10);
      c11 = V::fma(x, b1, c11);
    }
    if constexpr (MR > 2) {
      x = V::bcast(a + 2 * lda);
      c20 = V::fma(x, b0, c20);
      c21 = V::fma(x, b1, c21);
    }
    if constexpr (MR > 3) {
      x = V::bcast(a + 3 * lda);
      c30 = V::fma(x, b0, c30);
      c31 = V::fma(x, b1, c31);
    }
    if constexpr (MR > 4) {
      x = V::bcast(a + 4 * lda);
      c40 = V::fma(x, b0, c40);
      c41 = V::fma(x, b1, c41);
    }
    if constexpr (MR > 5) {
      x = V::bcast(a + 5 * lda);
      c50 = V::fma(x, b0, c50);
      c51 = V::fma(x, b1, c51);
    }
  }
  store(C, m0, c00);
  store(C + W, m1, c01);
  if constexpr (MR > 1) { store(C + ldc, m0, c10); store(C + ldc + W, m1, c11); }
  if constexpr (MR > 2) { store(C + 2 * ldc, m0, c20); store(C + 2 * ldc + W, m1, c21); }
  if constexpr (MR > 3) { store(C + 3 * ldc, m0, c30); store(C + 3 * ldc + W, m1, c31); }
  if constexpr (MR > 4) { store(C + 4 * ldc, m0, c40); store(C + 4 * ldc + W, m1, c41); }
  if constexpr (MR > 5) { store(C + 5 * ldc, m0, c50); store(C + 5 * ldc + W, m1, c51); }
}

// C[:MR, :4W] (+)= A B, MR rows x 4 vectors (64 columns), no masks: the AVX-512 build's block
// for full 64-column strips. An outer product per k takes 4 loads of B and MR broadcasts of A
// for 4 MR FMAs, where gemm_block's 2 vectors take 2 loads and MR broadcasts for 2 MR. Each C
// entry is the same FMA chain over k ascending as in gemm_block: bitwise the same results, for
// any MR. Which MR is fastest depends on the CPU (tl_wide_rows below, cpu/isa.h wide_block_rows).
template <int MR, bool ACC>
inline void gemm_wide(int64_t K, const float* A, int64_t lda, int64_t ka, const float* B,
                      int64_t ldb, float* C, int64_t ldc) {
  using V = MatmulVec;
  using reg = typename V::reg;
  constexpr int64_t W = V::kLanes;
  reg c[MR][4];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) c[r][v] = ACC ? V::load(C + r * ldc + v * W) : V::zero();
  }
  const float* a = A;
  const float* b = B;
  for (int64_t k = 0; k < K; ++k, a += ka, b += ldb) {
    const reg b0 = V::load(b), b1 = V::load(b + W), b2 = V::load(b + 2 * W), b3 = V::load(b + 3 * W);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const reg x = V::bcast(a + r * lda);
      c[r][0] = V::fma(x, b0, c[r][0]);
      c[r][1] = V::fma(x, b1, c[r][1]);
      c[r][2] = V::fma(x, b2, c[r][2]);
      c[r][3] = V::fma(x, b3, c[r][3]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) V::store(C + r * ldc + v * W, c[r][v]);
  }
}

template <int MR, bool ACC>
inline void gemm_rows(int64_t N, int64_t K, const float* A, int64_t lda, int64_t ka,
                      const float* B, int64_t ldb, float* C, int64_t ldc) {
  using V = MatmulVec;
  constexpr int64_t NB = 2 * V::kLanes;
  int64_t j = 0;
  for (; j + NB <= N; j += NB) gemm_block<V, MR, true, ACC>(K, A, lda, ka, B + j, ldb, C + j, ldc, NB);
  if (j < N) gemm_block<V, MR, false, ACC>(K, A, lda, ka, B + j, ldb, C + j, ldc, N - j);
}

// C[0, :N] += sum_k A[k * ka] B[k, :N] for a single row of C (decoding: P V of one query row).
// gemm_rows<1> would sweep B once per 16 columns, each sweep a strided walk over rows that have
// not been read yet; here each B row is read once, in order, 32 columns at a time (1 row x 4k
// keys x 8 heads, D = 64, one core: 0.46 -> 0.39 ms). Same products, summed in the same order
// (k ascending per column) as gemm_block: the results are bitwise those of gemm_rows<1>.
// B may be float16/bfloat16 (decoding reads the cache in its own dtype; load8 converts).
template <typename T>
inline void gemv_acc(int64_t N, int64_t K, const float* A, int64_t ka, const T* B, int64_t ldb,
                     float* C, bool prefetch = false) {
  int64_t j = 0;
  for (; j + 32 <= N; j += 32) {
    __m256 c0 = _mm256_loadu_ps(C + j), c1 = _mm256_loadu_ps(C + j + 8);
    __m256 c2 = _mm256_loadu_ps(C + j + 16), c3 = _mm256_loadu_ps(C + j + 24);
    const T* b = B + j;
    for (int64_t k = 0; k < K; ++k, b += ldb) {
      if (prefetch && j == 0) prefetch_ahead(b, N * int64_t(sizeof(T)));  // B's rows, once
      const __m256 x = _mm256_broadcast_ss(A + k * ka);
      c0 = _mm256_fmadd_ps(x, load8(b), c0);
      c1 = _mm256_fmadd_ps(x, load8(b + 8), c1);
      c2 = _mm256_fmadd_ps(x, load8(b + 16), c2);
      c3 = _mm256_fmadd_ps(x, load8(b + 24), c3);
    }
    _mm256_storeu_ps(C + j, c0);
    _mm256_storeu_ps(C + j + 8, c1);
    _mm256_storeu_ps(C + j + 16, c2);
    _mm256_storeu_ps(C + j + 24, c3);
  }
  for (; j < N; j += 8) {  // the last columns, 8 (or fewer, masked) at a time
    const int64_t n = imin(N - j, 8);
    const __m256i mk = tail_mask(n);
    __m256 c = _mm256_maskload_ps(C + j, mk);
    const T* b = B + j;
    for (int64_t k = 0; k < K; ++k, b += ldb) {
      c = _mm256_fmadd_ps(_mm256_broadcast_ss(A + k * ka), load_n(b, n), c);
    }
    _mm256_maskstore_ps(C + j, mk, c);
  }
}

// One 64-column strip of C (+)= A B in blocks of MR rows (gemm_wide), the last M % MR rows in
// one smaller block.
template <int MR, bool ACC>
void gemm_wide_strip(int64_t M, int64_t K, const float* A, int64_t lda, int64_t ka, const float* B,
                     int64_t ldb, float* C, int64_t ldc) {
  int64_t i = 0;
  for (; i + MR <= M; i += MR) gemm_wide<MR, ACC>(K, A + i * lda, lda, ka, B, ldb, C + i * ldc, ldc);
  const float* a = A + i * lda;
  float* c = C + i * ldc;
  switch (M - i) {
    case 5: if constexpr (MR > 5) gemm_wide<5, ACC>(K, a, lda, ka, B, ldb, c, ldc); break;
    case 4: if constexpr (MR > 4) gemm_wide<4, ACC>(K, a, lda, ka, B, ldb, c, ldc); break;
    case 3: gemm_wide<3, ACC>(K, a, lda, ka, B, ldb, c, ldc); break;
    case 2: gemm_wide<2, ACC>(K, a, lda, ka, B, ldb, c, ldc); break;
    case 1: gemm_wide<1, ACC>(K, a, lda, ka, B, ldb, c, ldc); break;
    default: break;
  }
}

// Rows per gemm_wide block in gemm_t (AttentionFwdSplit / AttentionBwdSplit::wide_rows, cpu/isa.h
// wide_block_rows: 6 on Intel CPUs, 4 on others), set for the calling thread at the entry of
// rel_attention and rel_attention_backward, the only callers of the matmuls: they sit too deep in
// the kernels to take it as an argument.
thread_local int tl_wide_rows = 4;

template <bool ACC>
void gemm_t(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, int64_t ka,
            const float* B, int64_t ldb, float* C, int64_t ldc) {
  if (M <= 0 || N <= 0) return;
  if (M == 1 && ACC) {
    gemv_acc(N, K, A, ka, B, ldb, C);
    return;
  }
  if (K <= 0) {
    if (!ACC) {
      for (int64_t i = 0; i < M; ++i) fill_f32(C + i * ldc, 0.f, N);
    }
    return;
  }
  // AVX-512: the full 64-column strips in blocks of 6 or 4 rows x 64 columns (gemm_wide,
  // tl_wide_rows), the rest as below. (AVX2 has 16 registers: 4 x 4 vectors would not fit.)
  if constexpr (MatmulVec::kLanes == 16) {
    constexpr int64_t NW = 4 * MatmulVec::kLanes;
    const int64_t nw = N / NW * NW;
    if (nw > 0) {
      const bool six = tl_wide_rows == 6;
      for (int64_t j = 0; j < nw; j += NW) {
        if (six) {
          gemm_wide_strip<6, ACC>(M, K, A, lda, ka, B + j, ldb, C + j, ldc);
        } else {
          gemm_wide_strip<4, ACC>(M, K, A, lda, ka, B + j, ldb, C + j, ldc);
        }
      }
      if (nw == N) return;
      N -= nw;
      B += nw;
      C += nw;
    }
  }
  // 6 rows per block with either width: 8 rows (16 of AVX-512's 32 registers accumulating) ran
  // no faster (L = 1024 and 2048, forward and backward, within 2%)
  int64_t i = 0;
  for (; i + 6 <= M; i += 6) gemm_rows<6, ACC>(N, K, A + i * lda, lda, ka, B, ldb, C + i * ldc, ldc);
  const float* a = A + i * lda;
  float* c = C + i * ldc;
  switch (M - i) {
    case 5: gemm_rows<5, ACC>(N, K, a, lda, ka, B, ldb, c, ldc); break;
    case 4: gemm_rows<4, ACC>(N, K, a, lda, ka, B, ldb, c, ldc); break;
    case 3: gemm_rows<3, ACC>(N, K, a, lda, ka, B, ldb, c, ldc); break;
    case 2: gemm_rows<2, ACC>(N, K, a, lda, ka, B, ldb, c, ldc); break;
    case 1: gemm_rows<1, ACC>(N, K, a, lda, ka, B, ldb, c, ldc); break;
    default: break;
  }
}

// C += A @ B with A row-major [M, K] (lda)
void gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
          int64_t ldb, float* C, int64_t ldc) {
  gemm_t<true>(M, N, K, A, lda, 1, B, ldb, C, ldc);
}
// C = A @ B (overwrite)
void gemm0(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
           int64_t ldb, float* C, int64_t ldc) {
  gemm_t<false>(M, N, K, A, lda, 1, B, ldb, C, ldc);
}
// C += A^T @ B where A is stored row-major as [K, M] (lda): C[m, n] += sum_k A[k, m] B[k, n]
void gemm_at(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
             int64_t ldb, float* C, int64_t ldc) {
  gemm_t<true>(M, N, K, A, 1, lda, B, ldb, C, ldc);
}

// ------------------------------------------------------------------------------ bfloat16 dots
// bfloat16 inputs on CPUs with AVX512-BF16 (the avx512 build only; AttentionFwdSplit and
// AttentionBwdSplit::bf16_dot): the big matmuls (forward S = Q K^T and P V; backward S, dP, dV,
// dK, dQ) take vdpbf16ps, which multiplies pairs of bfloat16 along k exactly and adds them into
// float32 accumulators, 32 products per instruction where the float32 FMA does 16: twice the
// float32 rate on Zen 4. Q, K, V and dO are read as they are (bfloat16 already); P and dS are
// rounded to bfloat16 for the matmuls that take them, as flash-attention does on GPUs (relative
// error 2^-9 per entry, averaged over the sums). Operands: A row-major with k pairs adjacent (a
// 32-bit word per pair, broadcast); B packed as [k / 2][N][2], one 32-bit word per (pair,
// column), so a zmm load is 16 columns x 2 k. An odd k count is padded with a zero. The
// relative terms' matmuls over a band of table rows take them too (band_dots and the next two,
// and rel_q's over WK in the backward); everything else (softmax, the terms' clamped buckets,
// the sums per bucket) stays float32.
#if defined(__AVX512F__)
constexpr bool kBf16Dot = true;
#define RELPOS_BF16_TARGET __attribute__((target("avx512bf16")))

// C[:MR, :n] (+)= A[:MR, :2 k2] B: MR rows x 32 columns, as gemm_block (each C entry one chain
// over the pairs in order, so a row computed alone gives the same bits). ACC = false writes alpha
// times the products (alpha: the logits' scale).
template <int MR, bool ACC>
RELPOS_BF16_TARGET inline void dot_block(int64_t k2, const uint16_t* A, int64_t lda,
                                         const uint32_t* B, int64_t ldb, float* C, int64_t ldc,
                                         int64_t n, float alpha) {
  const __mmask16 m0 = Zmm::tail(n), m1 = Zmm::tail(n - 16);
  __m512 c0[MR], c1[MR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    c0[r] = ACC ? _mm512_maskz_loadu_ps(m0, C + r * ldc) : _mm512_setzero_ps();
    c1[r] = ACC ? _mm512_maskz_loadu_ps(m1, C + r * ldc + 16) : _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < k2; ++k, B += ldb) {
    const __m512bh b0 = (__m512bh)_mm512_maskz_loadu_epi32(m0, B);
    const __m512bh b1 = (__m512bh)_mm512_maskz_loadu_epi32(m1, B + 16);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      int32_t pair;
      std::memcpy(&pair, A + r * lda + 2 * k, sizeof(pair));
      const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
      c0[r] = _mm512_dpbf16_ps(c0[r], x, b0);
      c1[r] = _mm512_dpbf16_ps(c1[r], x, b1);
    }
  }
  const __m512 a = _mm512_set1_ps(alpha);
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    _mm512_mask_storeu_ps(C + r * ldc, m0, ACC ? c0[r] : _mm512_mul_ps(a, c0[r]));
    _mm512_mask_storeu_ps(C + r * ldc + 16, m1, ACC ? c1[r] : _mm512_mul_ps(a, c1[r]));
  }
}

template <int MR, bool ACC>
RELPOS_BF16_TARGET inline void dot_rows(int64_t N, int64_t k2, const uint16_t* A, int64_t lda,
                                        const uint32_t* B, int64_t ldb, float* C, int64_t ldc,
                                        float alpha) {
  for (int64_t j = 0; j < N; j += 32) {
    dot_block<MR, ACC>(k2, A, lda, B + j, ldb, C + j, ldc, N - j, alpha);
  }
}

// gemm_bf16 by vdpbf16ps (dot_block): the whole product, where the AMX tiles (below) are off.
template <bool ACC>
RELPOS_BF16_TARGET void gemm_bf16_dots(int64_t M, int64_t N, int64_t k2, const uint16_t* A,
                                       int64_t lda, const uint32_t* B, int64_t ldb, float* C,
                                       int64_t ldc, float alpha = 1.f) {
  if (M <= 0 || N <= 0) return;
  int64_t i = 0;
  for (; i + 6 <= M; i += 6) dot_rows<6, ACC>(N, k2, A + i * lda, lda, B, ldb, C + i * ldc, ldc, alpha);
  const uint16_t* a = A + i * lda;
  float* c = C + i * ldc;
  switch (M - i) {
    case 5: dot_rows<5, ACC>(N, k2, a, lda, B, ldb, c, ldc, alpha); break;
    case 4: dot_rows<4, ACC>(N, k2, a, lda, B, ldb, c, ldc, alpha); break;
    case 3: dot_rows<3, ACC>(N, k2, a, lda, B, ldb, c, ldc, alpha); break;
    case 2: dot_rows<2, ACC>(N, k2, a, lda, B, ldb, c, ldc, alpha); break;
    case 1: dot_rows<1, ACC>(N, k2, a, lda, B, ldb, c, ldc, alpha); break;
    default: break;
  }
}

// ------------------------------------------------------------------------------ AMX tiles
// On CPUs with AMX (cpu/isa.h amx_enabled; AttentionFwdSplit / AttentionBwdSplit::amx) the
// bfloat16 dots run on tiles: TDPBF16PS adds to a 16 x 16 float32 block the products of a 16 x
// 16 block of pairs (A: 16 rows x 32 bfloat16) and 16 x 16 words of B, packed as above, which
// is the layout AMX takes for B. Eight tile registers: C blocks in 0-3 (2 x 2 of them, 32 x 32
// floats), A blocks in 4-5, B blocks in 6-7, all 16 rows x 64 bytes (AmxTiles loads that
// configuration for a kernel call's thread and releases the tiles at its end; tl_amx says it
// is loaded). Every entry of every product takes the tiles: whole blocks are read straight
// from A, B and C at their strides, and blocks at the edges (the last rows, the last columns,
// the pairs past the last whole 16) through zero-padded copies, so no tile load reads past a
// row's end. An entry's sum is then the same whatever block, band or row count it is computed
// in (zero products add nothing), as a dot's is: the backward recomputes P = e^(s - lse),
// which needs its logits bitwise the forward's, and it computes S, QE and KE^T in other
// blocks than the forward (other tiles and bands; one row again after a one-pass attempt).
// The tiles sum the same exact products as the dots in another order (float32, round to nearest
// even, denormals flushed), so results agree with the dots' to float32 rounding of the sums.
// B = 1, H = 8, D = 64, K = 64, L = 1024-4096, 2 threads of a Xeon with AMX (family 6, model
// 167): forward 3.4-4.3x and forward+backward 3.4-4.5x faster than the dots
// (benchmarks/results/bench_bf16_amx.json). Calls of fewer than kAttentionAmxMinRows query
// rows keep the dots (kernels.h).
#if defined(RELPOS_HAVE_AMX)
#define RELPOS_AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512bf16")))
// GCC's _tile_loadd (amxtileintrin.h, GCC 11-12 at least) is an asm statement that does not
// tell the compiler it reads memory: stores to what it reads (a padded copy built just before)
// could be kept for later or dropped, and were (NaN in P V). A compiler barrier before each
// load; _tile_stored has its memory clobber.
#define RELPOS_TILE_LOAD(tile, base, stride)  \
  do {                                        \
    __asm__ volatile("" ::: "memory");        \
    _tile_loadd(tile, base, stride);          \
  } while (0)
thread_local bool tl_amx = false;

struct alignas(64) AmxConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

// For a kernel call's thread: the tile configuration above while it lives (`on`: split.amx),
// tl_amx set; TILERELEASE at its end, which also spares the OS saving the tiles on a switch.
class AmxTiles {
 public:
  RELPOS_AMX_TARGET explicit AmxTiles(bool on) : on_(on) {
    if (!on_) return;
    static const AmxConfig config;
    _tile_loadconfig(&config);
    tl_amx = true;
  }
  RELPOS_AMX_TARGET ~AmxTiles() {
    if (!on_) return;
    _tile_release();
    tl_amx = false;
  }
  AmxTiles(const AmxTiles&) = delete;
  AmxTiles& operator=(const AmxTiles&) = delete;

 private:
  bool on_;
};

// A tile for a block at an edge: rows [0, rows) and 32-bit words [0, cols) of `src` (rows
// `stride` bytes apart: A's pairs, or B's words) into the 16 x 16 words of `tile`, zeros
// elsewhere (zero products add nothing).
RELPOS_AMX_TARGET inline void pad_tile(const void* src, int64_t stride, int64_t rows, int64_t cols,
                                       uint32_t* tile) {
  const __mmask16 mk = Zmm::tail(cols);
  const char* row = static_cast<const char*>(src);
  for (int64_t r = 0; r < 16; ++r, row += stride) {
    const __m512i x = r < rows ? _mm512_maskz_loadu_epi32(mk, row) : _mm512_setzero_si512();
    _mm512_store_si512(tile + 16 * r, x);
  }
}

// C[:rows, :cols] *= alpha
RELPOS_AMX_TARGET inline void scale_block(float* C, int64_t ldc, int64_t rows, int64_t cols, float alpha) {
  const __m512 a = _mm512_set1_ps(alpha);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; c += 16) {
      const __mmask16 mk = Zmm::tail(cols - c);
      _mm512_mask_storeu_ps(C + r * ldc + c, mk, _mm512_mul_ps(a, _mm512_maskz_loadu_ps(mk, C + r * ldc + c)));
    }
  }
}
// C[:16 MI, :16 NJ] (+)= A[:16 MI, :2 k2] B[:k2, :16 NJ], whole blocks (MI, NJ: 1 or 2 of them);
// the pairs past the last whole 16 from zero-padded copies. ACC = false starts from zeros and
// scales the sums by alpha once stored, while they are in L1 (a pass over all of S afterwards
// took 6.6% of a bfloat16 forward's samples; L = 2048, 3 alternating runs, forward 14.5-15.0 ->
// 13.2-13.3 ms, forward+backward 48.3-49.4 -> 45.7-47.4).
template <int MI, int NJ, bool ACC>
RELPOS_AMX_TARGET inline void amx_block(int64_t k2, const uint16_t* A, int64_t lda,
                                        const uint32_t* B, int64_t ldb, float* C, int64_t ldc,
                                        float alpha) {
  const int64_t sa = lda * 2, sb = ldb * 4, sc = ldc * 4;  // strides in bytes
  float* c10 = C + 16 * ldc;
  if constexpr (ACC) {
    RELPOS_TILE_LOAD(0, C, sc);
    if constexpr (NJ == 2) RELPOS_TILE_LOAD(1, C + 16, sc);
    if constexpr (MI == 2) RELPOS_TILE_LOAD(2, c10, sc);
    if constexpr (MI == 2 && NJ == 2) RELPOS_TILE_LOAD(3, c10 + 16, sc);
  } else {
    _tile_zero(0);
    if constexpr (NJ == 2) _tile_zero(1);
    if constexpr (MI == 2) _tile_zero(2);
    if constexpr (MI == 2 && NJ == 2) _tile_zero(3);
  }
  const int64_t k16 = k2 / 16 * 16;
  for (int64_t k = 0; k < k16; k += 16) {
    RELPOS_TILE_LOAD(4, A + 2 * k, sa);
    if constexpr (MI == 2) RELPOS_TILE_LOAD(5, A + 16 * lda + 2 * k, sa);
    RELPOS_TILE_LOAD(6, B + k * ldb, sb);
    if constexpr (NJ == 2) RELPOS_TILE_LOAD(7, B + k * ldb + 16, sb);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NJ == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (MI == 2) _tile_dpbf16ps(2, 5, 6);
    if constexpr (MI == 2 && NJ == 2) _tile_dpbf16ps(3, 5, 7);
  }
  if (k16 < k2) {
    alignas(64) uint32_t ta[2][256], tb[2][256];
    const int64_t kn = k2 - k16;
    pad_tile(A + 2 * k16, sa, 16, kn, ta[0]);
    if constexpr (MI == 2) pad_tile(A + 16 * lda + 2 * k16, sa, 16, kn, ta[1]);
    pad_tile(B + k16 * ldb, sb, kn, 16, tb[0]);
    if constexpr (NJ == 2) pad_tile(B + k16 * ldb + 16, sb, kn, 16, tb[1]);
    RELPOS_TILE_LOAD(4, ta[0], 64);
    if constexpr (MI == 2) RELPOS_TILE_LOAD(5, ta[1], 64);
    RELPOS_TILE_LOAD(6, tb[0], 64);
    if constexpr (NJ == 2) RELPOS_TILE_LOAD(7, tb[1], 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NJ == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (MI == 2) _tile_dpbf16ps(2, 5, 6);
    if constexpr (MI == 2 && NJ == 2) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, C, sc);
  if constexpr (NJ == 2) _tile_stored(1, C + 16, sc);
  if constexpr (MI == 2) _tile_stored(2, c10, sc);
  if constexpr (MI == 2 && NJ == 2) _tile_stored(3, c10 + 16, sc);
  if (!ACC && alpha != 1.f) scale_block(C, ldc, 16 * MI, 16 * NJ, alpha);
}

// An edge block's C, rows x cols < 16 x 16 of it, through the padded copy tc: into tile 0
// (the sums so far, zeros past the edge) ...
RELPOS_AMX_TARGET inline void edge_c_load(const float* C, int64_t ldc, int64_t rows, int64_t cols,
                                          float* tc) {
  const __mmask16 mc = Zmm::tail(cols);
  for (int64_t r = 0; r < 16; ++r) {
    _mm512_store_ps(tc + 16 * r, r < rows ? _mm512_maskz_loadu_ps(mc, C + r * ldc) : _mm512_setzero_ps());
  }
  RELPOS_TILE_LOAD(0, tc, 64);
}
// ... and tile 0 back into it, times alpha (1: as it is)
RELPOS_AMX_TARGET inline void edge_c_store(float* tc, int64_t rows, int64_t cols, float alpha,
                                           float* C, int64_t ldc) {
  _tile_stored(0, tc, 64);
  if (alpha != 1.f) scale_block(tc, 16, rows, 16, alpha);
  const __mmask16 mc = Zmm::tail(cols);
  for (int64_t r = 0; r < rows; ++r) _mm512_mask_storeu_ps(C + r * ldc, mc, _mm512_load_ps(tc + 16 * r));
}

// One block of 16 rows at C's right edge, cols < 16 (amx_edge_rows takes the last rows): C and
// B through zero-padded copies, A too where the k slice is partial, the same tile products;
// alpha as amx_block.
template <bool ACC>
RELPOS_AMX_TARGET void amx_edge_block(int64_t cols, int64_t k2, const uint16_t* A, int64_t lda,
                                      const uint32_t* B, int64_t ldb, float* C, int64_t ldc,
                                      float alpha) {
  alignas(64) float tc[256];
  alignas(64) uint32_t ta[256], tb[256];
  if constexpr (ACC) {
    edge_c_load(C, ldc, 16, cols, tc);
  } else {
    _tile_zero(0);
  }
  for (int64_t k = 0; k < k2; k += 16) {
    const int64_t kn = imin(16, k2 - k);
    if (kn == 16) {
      RELPOS_TILE_LOAD(4, A + 2 * k, lda * 2);
    } else {
      pad_tile(A + 2 * k, lda * 2, 16, kn, ta);
      RELPOS_TILE_LOAD(4, ta, 64);
    }
    pad_tile(B + k * ldb, ldb * 4, kn, cols, tb);
    RELPOS_TILE_LOAD(6, tb, 64);
    _tile_dpbf16ps(0, 4, 6);
  }
  edge_c_store(tc, 16, cols, ACC ? 1.f : alpha, C, ldc);
}

// The last rows < 16 of a product, every column: C[:rows, :N] (+)= A[:rows, :2 k2] B. A's rows
// are padded once per slice of kAmxEdgeRowPairs pairs and serve every 16-column block, rather
// than once per block (a decode step of 8-15 query rows: 8 times for S over a tile of 128
// keys). The sums of a block that needs more than one slice are stored between slices and
// loaded again, which float32 keeps exact: the same entries as amx_edge_block's, bitwise.
constexpr int64_t kAmxEdgeRowPairs = 128;  // A's padded slice: 16 x 128 words, 8 KiB
template <bool ACC>
RELPOS_AMX_TARGET void amx_edge_rows(int64_t rows, int64_t N, int64_t k2, const uint16_t* A,
                                     int64_t lda, const uint32_t* B, int64_t ldb, float* C,
                                     int64_t ldc, float alpha) {
  alignas(64) uint32_t ta[kAmxEdgeRowPairs / 16][256];
  alignas(64) uint32_t tb[256];
  alignas(64) float tc[256];
  for (int64_t k0 = 0; k0 < k2; k0 += kAmxEdgeRowPairs) {
    const int64_t kc = imin(kAmxEdgeRowPairs, k2 - k0);
    for (int64_t k = 0; k < kc; k += 16) pad_tile(A + 2 * (k0 + k), lda * 2, rows, imin(16, kc - k), ta[k / 16]);
    const bool first = k0 == 0, last = k0 + kc == k2;
    for (int64_t j = 0; j < N; j += 16) {
      const int64_t cols = imin(16, N - j);
      float* cj = C + j;
      if (ACC || !first) {  // the sums so far (C's own, or the slices before)
        edge_c_load(cj, ldc, rows, cols, tc);
      } else {
        _tile_zero(0);
      }
      for (int64_t k = 0; k < kc; k += 16) {
        const int64_t kn = imin(16, kc - k);
        const uint32_t* bk = B + (k0 + k) * ldb + j;
        RELPOS_TILE_LOAD(4, ta[k / 16], 64);
        if (cols == 16 && kn == 16) {
          RELPOS_TILE_LOAD(6, bk, ldb * 4);
        } else {
          pad_tile(bk, ldb * 4, kn, cols, tb);
          RELPOS_TILE_LOAD(6, tb, 64);
        }
        _tile_dpbf16ps(0, 4, 6);
      }
      edge_c_store(tc, rows, cols, !ACC && last ? alpha : 1.f, cj, ldc);
    }
  }
}

template <int MI, bool ACC>
RELPOS_AMX_TARGET inline void amx_row_blocks(int64_t n16, int64_t k2, const uint16_t* A,
                                             int64_t lda, const uint32_t* B, int64_t ldb, float* C,
                                             int64_t ldc, float alpha) {
  int64_t j = 0;
  for (; j + 32 <= n16; j += 32) amx_block<MI, 2, ACC>(k2, A, lda, B + j, ldb, C + j, ldc, alpha);
  if (j < n16) amx_block<MI, 1, ACC>(k2, A, lda, B + j, ldb, C + j, ldc, alpha);
}

// C[M, N] (+)= A B on the tiles, every entry (ACC = false: C = alpha A B): whole blocks straight
// from A, B and C, the blocks at the edges (the last rows and columns) through padded copies.
template <bool ACC>
RELPOS_AMX_TARGET void amx_gemm(int64_t M, int64_t N, int64_t k2, const uint16_t* A, int64_t lda,
                                const uint32_t* B, int64_t ldb, float* C, int64_t ldc,
                                float alpha) {
  const int64_t m16 = M / 16 * 16, n16 = N / 16 * 16;
  int64_t i = 0;
  for (; i + 32 <= m16; i += 32) amx_row_blocks<2, ACC>(n16, k2, A + i * lda, lda, B, ldb, C + i * ldc, ldc, alpha);
  if (i < m16) amx_row_blocks<1, ACC>(n16, k2, A + i * lda, lda, B, ldb, C + i * ldc, ldc, alpha);
  if (n16 < N) {
    for (i = 0; i < m16; i += 16) {
      amx_edge_block<ACC>(N - n16, k2, A + i * lda, lda, B + n16, ldb, C + i * ldc + n16, ldc, alpha);
    }
  }
  if (m16 < M) amx_edge_rows<ACC>(M - m16, N, k2, A + m16 * lda, lda, B, ldb, C + m16 * ldc, ldc, alpha);
}

#endif

// C[M, N] (+)= A[M, 2 k2] B with B packed [k2][ldb words] (see above); ACC = false: C = alpha A B.
// Every entry on the AMX tiles where they are configured (tl_amx), else by the dots.
template <bool ACC>
RELPOS_BF16_TARGET void gemm_bf16(int64_t M, int64_t N, int64_t k2, const uint16_t* A,
                                  int64_t lda, const uint32_t* B, int64_t ldb, float* C,
                                  int64_t ldc, float alpha = 1.f) {
#if defined(RELPOS_HAVE_AMX)
  if (tl_amx) {
    if (M <= 0 || N <= 0) return;
    amx_gemm<ACC>(M, N, k2, A, lda, B, ldb, C, ldc, alpha);
    return;
  }
#endif
  gemm_bf16_dots<ACC>(M, N, k2, A, lda, B, ldb, C, ldc, alpha);
}

// dst[c][r] = the pair word (src[r][2c], src[r][2c + 1]) for r < rows, c < D / 2 (D even):
// K^T packed for S = Q K^T, a transpose of 32-bit words (moves only, no arithmetic on them).
void pack_pairs_t(const uint16_t* src, int64_t rows, int64_t D, uint32_t* dst, int64_t ldd) {
  transpose(reinterpret_cast<const float*>(src), D / 2, rows, D / 2, reinterpret_cast<float*>(dst), ldd);
}

// dst[r2][d] = the pair (src[2 r2][d], src[2 r2 + 1][d]), a missing last row as zeros: V packed
// for P V ([ceil(rows / 2)][D] words).
RELPOS_BF16_TARGET void pack_row_pairs(const uint16_t* src, int64_t rows, int64_t D, uint32_t* dst) {
  // word d of the output: the halves src0[d], src1[d]; vpermt2w picks them from the two rows
  alignas(64) uint16_t lo_idx[32], hi_idx[32];
  for (int e = 0; e < 16; ++e) {
    lo_idx[2 * e] = static_cast<uint16_t>(e);
    lo_idx[2 * e + 1] = static_cast<uint16_t>(32 + e);
    hi_idx[2 * e] = static_cast<uint16_t>(16 + e);
    hi_idx[2 * e + 1] = static_cast<uint16_t>(48 + e);
  }
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx);
  for (int64_t r = 0; r < rows; r += 2) {
    const uint16_t* s0 = src + r * D;
    const uint16_t* s1 = r + 1 < rows ? s0 + D : nullptr;
    uint32_t* d = dst + (r / 2) * D;
    for (int64_t c = 0; c < D; c += 32) {
      const int64_t n = imin(D - c, 32);
      const __mmask32 mk = n >= 32 ? ~__mmask32(0) : (__mmask32(1) << n) - 1;
      const __m512i a = _mm512_maskz_loadu_epi16(mk, s0 + c);
      const __m512i b = s1 != nullptr ? _mm512_maskz_loadu_epi16(mk, s1 + c) : _mm512_setzero_si512();
      _mm512_mask_storeu_epi32(d + c, Zmm::tail(n), _mm512_permutex2var_epi16(a, lo, b));
      if (n > 16) _mm512_mask_storeu_epi32(d + c + 16, Zmm::tail(n - 16), _mm512_permutex2var_epi16(a, hi, b));
    }
  }
}

// dst[r][:cols] = src[r][:cols] rounded to bfloat16 (to nearest even), and dst[r][cols] = 0 when
// cols is odd (the pad of the last pair).
RELPOS_BF16_TARGET void round_rows_bf16(const float* src, int64_t lds, int64_t rows, int64_t cols,
                                        uint16_t* dst, int64_t ldd) {
  const int64_t padded = cols + (cols & 1);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < padded; c += 32) {
      const int64_t n = imin(cols - c, 32), np = imin(padded - c, 32);
      const __m512 a = _mm512_maskz_loadu_ps(Zmm::tail(n), src + r * lds + c);
      const __m512 b = _mm512_maskz_loadu_ps(Zmm::tail(n - 16), src + r * lds + c + 16);
      const __mmask32 mk = np >= 32 ? ~__mmask32(0) : (__mmask32(1) << np) - 1;
      _mm512_mask_storeu_epi16(dst + r * ldd + c, mk, (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
  }
}
// dst[r2][c] = the pair word (src[2 r2][c], src[2 r2 + 1][c]) rounded to bfloat16, for r2 <
// ceil(rows / 2), c < cols; a missing last row as zeros. P and dS packed as the right operand of
// dV^T += dO^T P and dK^T += Q^T dS: round_rows_bf16 and pack_row_pairs in one pass, the same bits.
RELPOS_BF16_TARGET void round_pack_pairs(const float* src, int64_t lds, int64_t rows, int64_t cols,
                                         uint32_t* dst, int64_t ldd) {
  alignas(64) uint16_t idx[32];  // word e: row 0's column e (low half), row 1's (high half)
  for (int e = 0; e < 16; ++e) {
    idx[2 * e] = static_cast<uint16_t>(e);
    idx[2 * e + 1] = static_cast<uint16_t>(16 + e);
  }
  const __m512i zip = _mm512_load_si512(idx);
  for (int64_t r = 0; r < rows; r += 2) {
    const float* s0 = src + r * lds;
    const float* s1 = r + 1 < rows ? s0 + lds : nullptr;
    uint32_t* d = dst + (r / 2) * ldd;
    for (int64_t c = 0; c < cols; c += 16) {
      const __mmask16 mk = Zmm::tail(cols - c);
      const __m512 a = _mm512_maskz_loadu_ps(mk, s0 + c);
      const __m512 b = s1 != nullptr ? _mm512_maskz_loadu_ps(mk, s1 + c) : _mm512_setzero_ps();
      const __m512i h = (__m512i)_mm512_cvtne2ps_pbh(b, a);  // a's 16 halves, then b's
      _mm512_mask_storeu_epi32(d + c, mk, _mm512_permutexvar_epi16(zip, h));
    }
  }
}
#else
constexpr bool kBf16Dot = false;
template <bool ACC>
void gemm_bf16(int64_t M, int64_t N, int64_t k2, const uint16_t* A, int64_t lda, const uint32_t* B,
               int64_t ldb, float* C, int64_t ldc, float alpha = 1.f);
void pack_pairs_t(const uint16_t* src, int64_t rows, int64_t D, uint32_t* dst, int64_t ldd);
void pack_row_pairs(const uint16_t* src, int64_t rows, int64_t D, uint32_t* dst);
void round_rows_bf16(const float* src, int64_t lds, int64_t rows, int64_t cols, uint16_t* dst,
                     int64_t ldd);
void round_pack_pairs(const float* src, int64_t lds, int64_t rows, int64_t cols, uint32_t* dst,
                      int64_t ldd);
#endif
#if !defined(__AVX512F__) || !defined(RELPOS_HAVE_AMX)
// No AMX code in this build: the kernels' AmxTiles does nothing (split.amx is never set here).
struct AmxTiles {
  explicit AmxTiles(bool) {}
};
#endif

// s[r * lds + j] = q_r . k_j for r < mq, j < nk, with K row-major [nk, D]: the scores of a few
// query rows (decoding) without the transposed key tiles, whose building would cost as much as
// the scores. Eight keys at a time, their eight accumulators reduced to one vector at the end.
// K may be float16/bfloat16 (the cache read in its own dtype; load8 converts).
template <typename T>
void scores_rows(int64_t mq, int64_t nk, int64_t D, const float* q, const T* k, float* s,
                 int64_t lds, bool prefetch) {
  const int64_t d8 = D / 8 * 8;
  const __m256i tm = tail_mask(D - d8);
  for (int64_t r = 0; r < mq; ++r) {
    const float* qr = q + r * D;
    int64_t j = 0;
    for (; j + 8 <= nk; j += 8) {
      const T* kj = k + j * D;
      if (prefetch && r == 0) prefetch_ahead(kj, 8 * D * int64_t(sizeof(T)));
      __m256 a[8];
      for (int u = 0; u < 8; ++u) a[u] = _mm256_setzero_ps();
      for (int64_t d = 0; d < d8; d += 8) {
        const __m256 qv = _mm256_loadu_ps(qr + d);
        for (int u = 0; u < 8; ++u) a[u] = _mm256_fmadd_ps(load8(kj + u * D + d), qv, a[u]);
      }
      if (d8 < D) {
        const __m256 qv = _mm256_maskload_ps(qr + d8, tm);
        for (int u = 0; u < 8; ++u) a[u] = _mm256_fmadd_ps(load_n(kj + u * D + d8, D - d8), qv, a[u]);
      }
      _mm256_storeu_ps(s + r * lds + j, hsum8(a));  // lanes of a[u] summed into lane u
    }
    for (; j < nk; ++j) s[r * lds + j] = dot(qr, k + j * D, D);
  }
}

// ------------------------------------------------------------------------------ shared setup
struct Head {
  const char* q;       // this (b, h)'s query rows
  const char* k;       // this (b, kv head)'s keys / values
  const char* v;
  const char* rel_k;   // table rows of head h (or the shared table); null when absent
  const char* rel_v;
  const char* rel_bias;  // [2K+1] of head h (or the shared one); null when absent
  const char* rel_q;   // key-side table rows of head h (or the shared table); null when absent
  const bool* pad;     // key padding row of batch b, or null
  const bool* amask;   // attention mask of (b, h), [q_len, k_len] rows (broadcast resolved), or null
  const int64_t* qseg;  // segment ids of batch b's queries [q_len] and keys [k_len], or null
  const int64_t* kseg;
  const uint8_t* amask_tiles;  // the attention mask's tile classes of (b, h) [q_tiles, k_tiles], or null
  int64_t k_tiles;
};

Head head_of(const RelAttentionParams& p, int64_t b, int64_t h, const AttnMaskTiles& tiles = {}) {
  const int64_t es = elem_bytes(p.dtype), rows = num_buckets(p.max_distance);
  const int64_t kvh = b * p.kv_heads + h / (p.heads / p.kv_heads);
  Head hd;
  hd.q = static_cast<const char*>(p.q) + (b * p.heads + h) * p.q_len * p.dim * es;
  hd.k = static_cast<const char*>(p.k) + kvh * p.kv_stride * es;
  hd.v = static_cast<const char*>(p.v) + kvh * p.kv_stride * es;
  hd.rel_k = p.rel_k ? static_cast<const char*>(p.rel_k) + (p.rel_k_per_head ? h * rows * p.dim * es : 0) : nullptr;
  hd.rel_v = p.rel_v ? static_cast<const char*>(p.rel_v) + (p.rel_v_per_head ? h * rows * p.dim * es : 0) : nullptr;
  hd.rel_q = p.rel_q ? static_cast<const char*>(p.rel_q) + (p.rel_q_per_head ? h * rows * p.dim * es : 0) : nullptr;
  hd.rel_bias = p.rel_bias ? static_cast<const char*>(p.rel_bias) + (p.rel_bias_per_head ? h * rows * es : 0) : nullptr;
  hd.pad = p.key_padding_mask ? p.key_padding_mask + b * p.k_len : nullptr;
  hd.amask = p.attn_mask ? &p.attn_mask[b * p.attn_mask_b_stride + h * p.attn_mask_h_stride] : nullptr;
  hd.qseg = p.q_segment_ids ? p.q_segment_ids + b * p.q_len : nullptr;
  hd.kseg = p.k_segment_ids ? p.k_segment_ids + b * p.k_len : nullptr;
  hd.amask_tiles = nullptr;
  hd.k_tiles = tiles.k_tiles;
  if (tiles.cls != nullptr) {
    const int64_t slab = (p.attn_mask_b_stride != 0 ? b : 0) * (p.attn_mask_h_stride != 0 ? p.heads : 1) +
                         (p.attn_mask_h_stride != 0 ? h : 0);
    hd.amask_tiles = tiles.cls + slab * tiles.q_tiles * tiles.k_tiles;
  }
  return hd;
}

// A head's operands of the bfloat16 dots: `o` (kernels.h) moved to the query rows of (b, h), the
// keys and values of its kv head and head h's table rows (or the shared table's); grad_out and
// kv_stride stay the call's. Null where the call has none, and q, k, v for float32 inputs.
Bf16Operands head16_of(const RelAttentionParams& p, const Bf16Operands& o, int64_t b, int64_t h) {
  const int64_t rows = num_buckets(p.max_distance);
  const int64_t kvh = b * p.kv_heads + h / (p.heads / p.kv_heads);
  auto table = [&](const uint16_t* t, bool per_head) {
    return t ? t + (per_head ? h * rows * p.dim : 0) : nullptr;
  };
  Bf16Operands hd = o;
  if (o.q != nullptr) {  // (bfloat16 inputs; float32 ones are rounded by the kernels, tile by tile)
    hd.q = o.q + (b * p.heads + h) * p.q_len * p.dim;
    hd.k = o.k + kvh * o.kv_stride;
    hd.v = o.v + kvh * o.kv_stride;
  }
  hd.rel_k = table(o.rel_k, p.rel_k_per_head);
  hd.rel_v = table(o.rel_v, p.rel_v_per_head);
  hd.rel_q = table(o.rel_q, p.rel_q_per_head);
  return hd;
}

// The band of inside buckets (1..2K-1) reachable from query rows [i0, i0 + mq): [lo, lo + n).
struct Band {
  int64_t lo = 0, n = 0;
};

// ... from keys [kb, ke) (a key chunk or run; all keys: [0, k_len)).
Band band_of(const RelAttentionParams& p, int64_t i0, int64_t mq, int64_t kb, int64_t ke) {
  Band band;
  if (p.max_distance == 0 || ke <= kb) return band;
  const int64_t lo = imax(1, shaw_bucket(i0 + mq - 1, kb, p.max_distance, p.q_offset, p.k_offset));
  const int64_t hi = imin(2 * p.max_distance - 1,
                          shaw_bucket(i0, ke - 1, p.max_distance, p.q_offset, p.k_offset));
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
  s.a = iclamp(in.begin, j0, j0 + nk);
  s.e = iclamp(in.end, s.a, j0 + nk);
  // bucket of key j inside the window: r + K = (k_offset + j - q_offset - i) + K
  s.col0 = p.k_offset - p.q_offset - i + p.max_distance - band.lo;
  return s;
}

// Mask a row of logits for query i over keys [j0, j0 + nk): keys after the causal limit
// (k_offset + j > q_offset + i) become -inf, and, unless the tile is clear (TileMask), padded
// keys, keys the attention mask hides, keys of other segments and keys outside the window.
void mask_logits(const RelAttentionParams& p, const Head& hd, int64_t i, int64_t j0, int64_t nk,
                 bool clear, float* sr) {
  int64_t vis = nk;
  if (p.causal) vis = iclamp(p.q_offset + i - p.k_offset + 1 - j0, 0, nk);
  fill_f32(sr + vis, kNegInf, nk - vis);
  if (clear) return;
  if (hd.pad != nullptr) {
    for (int64_t j = 0; j < vis; ++j) {
      if (hd.pad[j0 + j]) sr[j] = kNegInf;
    }
  }
  if (hd.amask != nullptr) {
    const bool* row = hd.amask + i * p.k_len + j0;
    for (int64_t j = 0; j < vis; ++j) {
      if (row[j]) sr[j] = kNegInf;
    }
  }
  if (hd.qseg != nullptr) {
    const int64_t seg = hd.qseg[i];
    for (int64_t j = 0; j < vis; ++j) {
      if (hd.kseg[j0 + j] != seg) sr[j] = kNegInf;
    }
  }
  const int64_t d = p.q_offset + i - p.k_offset - j0;  // the tile's key at r = 0
  if (p.window_left >= 0) fill_f32(sr, kNegInf, iclamp(d - p.window_left, 0, vis));
  if (p.window_right >= 0) {
    const int64_t e = iclamp(d + p.window_right + 1, 0, vis);
    fill_f32(sr + e, kNegInf, vis - e);
  }
}

// What the n bools x hold: bit 0 set if some are false, bit 1 if some are true (a bool is the
// byte 0 or 1). 32 at a time: tile_mask reads every byte of the attention mask a tile covers.
int bool_kinds(const bool* x, int64_t n) {
  const __m256i zero = _mm256_setzero_si256();
  int kinds = 0;
  int64_t j = 0;
  for (; j + 32 <= n && kinds != 3; j += 32) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + j));
    const auto zeros = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi8(v, zero)));
    kinds |= (zeros != 0u ? 1 : 0) | (zeros != 0xFFFFFFFFu ? 2 : 0);
  }
  for (; j < n && kinds != 3; ++j) kinds |= x[j] ? 2 : 1;
  return kinds;
}

// The smallest and largest of n > 0 segment ids.
std::pair<int64_t, int64_t> id_range(const int64_t* ids, int64_t n) {
  int64_t lo = ids[0], hi = ids[0];
  for (int64_t j = 1; j < n; ++j) {
    lo = imin(lo, ids[j]);
    hi = imax(hi, ids[j]);
  }
  return {lo, hi};
}

// What the key padding, the attention mask, the segments and the window (not the causal limit)
// do to the query rows [i0, i0 + mq) over the key tile [j0, j0 + nk), one of the kernels' BQ x
// BK tiles (hd from head_of with the call's AttnMaskTiles when there is an attention mask):
//   kHidden: every pair hidden by one of them. The tile adds nothing (all its probabilities are
//     0) and is skipped, so a block-sparse mask (packed documents, local windows) costs only the
//     tiles it leaves visible;
//   kClear: no pair hidden. The tile takes the unmasked paths (one pass, 8 rows at a time);
//   kMixed: anything else, masked key by key.
enum class TileMask { kClear, kMixed, kHidden };

TileMask tile_mask(const RelAttentionParams& p, const Head& hd, int64_t i0, int64_t mq, int64_t j0,
                   int64_t nk) {
  bool mixed = false;
  if (hd.pad != nullptr) {
    const int kinds = bool_kinds(hd.pad + j0, nk);
    if ((kinds & 1) == 0) return TileMask::kHidden;  // every key padded
    mixed = (kinds & 2) != 0;
  }
  if (hd.amask != nullptr) {  // the tile's class, computed once per call by attn_mask_tiles
    // (for tiles of BQ x BK: the forward takes wide tiles only when there is no mask)
    const uint8_t cls = hd.amask_tiles[(i0 / BQ) * hd.k_tiles + j0 / BK];
    if (cls == kTileHidden) return TileMask::kHidden;
    mixed = mixed || cls == kTileMixed;
  }
  if (hd.qseg != nullptr && mq > 0) {  // from the id ranges: exact for sorted (packed) ids
    const auto [qlo, qhi] = id_range(hd.qseg + i0, mq);
    const auto [klo, khi] = id_range(hd.kseg + j0, nk);
    if (qhi < klo || khi < qlo) return TileMask::kHidden;
    mixed = mixed || !(qlo == qhi && klo == khi && qlo == klo);
  }
  if (p.window_left >= 0 || p.window_right >= 0) {  // the tile's extreme distances r decide
    const int64_t r_min = p.k_offset + j0 - p.q_offset - (i0 + mq - 1);
    const int64_t r_max = p.k_offset + j0 + nk - 1 - p.q_offset - i0;
    const bool has_l = p.window_left >= 0, has_r = p.window_right >= 0;
    if ((has_l && r_max < -p.window_left) || (has_r && r_min > p.window_right)) {
      return TileMask::kHidden;
    }
    mixed = mixed || (has_l && r_min < -p.window_left) || (has_r && r_max > p.window_right);
  }
  return mixed ? TileMask::kMixed : TileMask::kClear;
}

// The largest lane of mx; NaN when a lane of nan is set (max_row, logits_row_uniform).
inline float max_or_nan(__m256 mx, __m256 nan) {
  if (_mm256_movemask_ps(nan) != 0) return std::numeric_limits<float>::quiet_NaN();
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

// The largest of x[0, n), or NaN when any entry is NaN, so that a row with a NaN logit comes
// out NaN (as in torch and the scalar kernel). A max instruction alone keeps or drops a NaN
// depending on its place: a row whose visible logits were all NaN (a NaN query) came out as a
// row with no visible key, zeros.
float max_row(const float* x, int64_t n) {
  __m256 mx = _mm256_set1_ps(kNegInf), nan = _mm256_setzero_ps();
  int64_t i = 0;
#if defined(__AVX512F__)
  if (n >= 16) {  // 16 at a time (a maximum is exact: the same whatever the order)
    __m512 mx16 = _mm512_set1_ps(kNegInf);
    __mmask16 nan16 = 0;
    for (; i + 16 <= n; i += 16) {
      const __m512 v = _mm512_loadu_ps(x + i);
      mx16 = _mm512_max_ps(mx16, v);
      nan16 = static_cast<__mmask16>(nan16 | _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q));
    }
    if (nan16 != 0) return std::numeric_limits<float>::quiet_NaN();
    mx = _mm256_max_ps(_mm512_castps512_ps256(mx16), _mm512_extractf32x8_ps(mx16, 1));
  }
#endif
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    mx = _mm256_max_ps(mx, v);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  if (i < n) {  // the last n - i entries, the other lanes -inf
    const __m256i mk = tail_mask(n - i);
    const __m256 v = _mm256_blendv_ps(_mm256_set1_ps(kNegInf), _mm256_maskload_ps(x + i, mk),
                                      _mm256_castsi256_ps(mk));
    mx = _mm256_max_ps(mx, v);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  return max_or_nan(mx, nan);
}

// x[j] = e^(x[j] - shift) over a row (masked -inf entries give 0).
void exp_row(float* x, int64_t n, float shift) {
  const __m256 vs = _mm256_set1_ps(shift);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    _mm256_storeu_ps(x + j, exp_256(_mm256_sub_ps(_mm256_loadu_ps(x + j), vs)));
  }
  if (j < n) {
    const __m256i mk = tail_mask(n - j);
    _mm256_maskstore_ps(x + j, mk, exp_256(_mm256_sub_ps(_mm256_maskload_ps(x + j, mk), vs)));
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

// ---- attention dropout (common/dropout.h), 8 keys at a time with the hash in 32-bit lanes
inline __m256i dropout_mix8(__m256i x) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0x7FEB352Du)));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0x846CA68Bu)));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

// The dropout of one query row: factors(j0) gives, for keys j0 .. j0 + 7, keep_scale where the
// key is kept and 0 where it is dropped (bitwise dropout_kept's decision).
struct RowDropout {
  uint32_t key = 0;
  __m256i bound, lanes;
  __m256 keep_scale;
  RowDropout(const RelAttentionParams& p, int64_t b, int64_t h, int64_t i) {
    key = dropout_row_key(p.dropout.seed, b * p.heads + h, i);
    // kept <=> (u >> 1) >= threshold <=> (u >> 1) > threshold - 1, as signed 32-bit lanes
    bound = _mm256_set1_epi32(static_cast<int>(p.dropout.threshold) - 1);
    lanes = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                               _mm256_set1_epi32(static_cast<int>(kDropoutKeyMul)));
    keep_scale = _mm256_set1_ps(static_cast<float>(p.dropout.keep_scale));
  }
  __m256 factors(int64_t j0) const {
    const uint32_t base = key + static_cast<uint32_t>(j0) * kDropoutKeyMul;
    const __m256i u = dropout_mix8(_mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(base)), lanes));
    const __m256i kept = _mm256_cmpgt_epi32(_mm256_srli_epi32(u, 1), bound);
    return _mm256_and_ps(_mm256_castsi256_ps(kept), keep_scale);
  }
};

// x[j] *= the dropout factor of key j0 + j, over a row of n probabilities.
void dropout_row(const RowDropout& dr, int64_t j0, float* x, int64_t n) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(x + j, _mm256_mul_ps(_mm256_loadu_ps(x + j), dr.factors(j0 + j)));
  if (j < n) {
    const __m256i mk = tail_mask(n - j);
    _mm256_maskstore_ps(x + j, mk, _mm256_mul_ps(_mm256_maskload_ps(x + j, mk), dr.factors(j0 + j)));
  }
}

// softmax_grad_row under dropout: dS = scale * P * (f dP - d_i) in dp and P *= f in pr, with f
// the dropout factors of keys j0 ..; dV and drel_v then take the dropped P.
void softmax_grad_row_dropout(const RowDropout& dr, int64_t j0, float* pr, float* dp, int64_t n,
                              float di, float scale) {
  const __m256 vd = _mm256_set1_ps(di), vsc = _mm256_set1_ps(scale);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 f = dr.factors(j0 + j), pv = _mm256_loadu_ps(pr + j);
    const __m256 g = _mm256_sub_ps(_mm256_mul_ps(f, _mm256_loadu_ps(dp + j)), vd);
    _mm256_storeu_ps(dp + j, _mm256_mul_ps(vsc, _mm256_mul_ps(pv, g)));
    _mm256_storeu_ps(pr + j, _mm256_mul_ps(pv, f));
  }
  if (j < n) {
    const __m256i mk = tail_mask(n - j);
    const __m256 f = dr.factors(j0 + j), pv = _mm256_maskload_ps(pr + j, mk);
    const __m256 g = _mm256_sub_ps(_mm256_mul_ps(f, _mm256_maskload_ps(dp + j, mk)), vd);
    _mm256_maskstore_ps(dp + j, mk, _mm256_mul_ps(vsc, _mm256_mul_ps(pv, g)));
    _mm256_maskstore_ps(pr + j, mk, _mm256_mul_ps(pv, f));
  }
}

// ---- one-pass rows: the common case of a row whose keys in this tile all share one clamped
// bucket (far from the diagonal: rel = a constant per row) in a clear tile (TileMask).
// Lanes from `vis` (the causal limit) to the 8-aligned end of the row are masked; the s / dp
// buffers are BK wide, so whole 8-lane chunks stay inside them (lanes past nk are written, never
// read).
inline bool uniform_row(const RowSplit& sp, int64_t j0, int64_t nk, bool clear) {
  return clear && (sp.a == j0 + nk || sp.e == j0);
}

inline int64_t visible_keys(const RelAttentionParams& p, int64_t i, int64_t j0, int64_t nk) {
  return p.causal ? iclamp(p.q_offset + i - p.k_offset + 1 - j0, 0, nk) : nk;
}

// The clamped bucket shared by every row of the query tile [i0, i0 + mq) over the key tile
// [j0, j0 + nk), when the tile is clear, each row is a uniform_row on the same side with all nk
// keys visible and nk is a multiple of 8: 1 for bucket 0, 2 for bucket 2K; else 0. A
// row's inside window and its causal limit only move right as the row grows, so the first and
// last rows decide.
inline int uniform_tile(const RelAttentionParams& p, bool clear, int64_t i0, int64_t mq,
                        int64_t j0, int64_t nk) {
  if (!clear || mq <= 0 || nk % 8 != 0 || visible_keys(p, i0, j0, nk) < nk) {
    return 0;
  }
  const int64_t K = p.max_distance;
  if (inner_keys(i0, p.k_len, K, p.q_offset, p.k_offset).begin >= j0 + nk) return 1;
  if (inner_keys(i0 + mq - 1, p.k_len, K, p.q_offset, p.k_offset).end <= j0) return 2;
  return 0;
}

// Forward: sr = sr + c (masked lanes -inf); returns the row maximum (NaN when any is NaN).
inline float logits_row_uniform(float* sr, int64_t nk, int64_t vis, float c) {
  const __m256 vc = _mm256_set1_ps(c), ninf = _mm256_set1_ps(kNegInf);
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 mx = ninf, nan = _mm256_setzero_ps();
  for (int64_t j = 0; j < nk; j += 8) {
    const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(vis - j)), idx));
    const __m256 x = _mm256_blendv_ps(ninf, _mm256_add_ps(_mm256_loadu_ps(sr + j), vc), keep);
    _mm256_storeu_ps(sr + j, x);
    mx = _mm256_max_ps(mx, x);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  }
  return max_or_nan(mx, nan);  // NaN when a visible logit is (see max_row)
}

// Forward: sr = e^(sr - shift) over whole 8-lane chunks (masked lanes hold -inf: 0); returns
// the sum of the first nk entries (the lanes past nk are -inf or garbage only where j >= vis,
// which logits_row_uniform set to -inf, so the sum over whole chunks is the row sum).
inline float exp_sum_row(float* sr, int64_t nk, float shift) {
  const __m256 vs = _mm256_set1_ps(shift);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t j = 0; j < nk; j += 8) {
    const __m256 e = exp_256(_mm256_sub_ps(_mm256_loadu_ps(sr + j), vs));
    _mm256_storeu_ps(sr + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  return hsum(acc);
}

// Forward, the one-pass form of logits_row_uniform + exp_sum_row for a row that already has a
// running maximum m: sr = e^(sr + c - m) in place (masked lanes 0), with its sum, without first
// finding the row's maximum in this tile. m may be below the true maximum (a stale maximum, as
// in FlashAttention-4): the probabilities then carry a common factor e^(true max - m), which the
// normalisation by the row sum cancels, as long as it stays small. Returns false, leaving the
// caller to recompute the row's logits and redo it with its new maximum, when a visible logit
// exceeds m by more than kStaleMax (so P <= e^kStaleMax = 2^8: no overflow in P, the sums or P V).
constexpr float kStaleMax = 8.f * kLn2;

// The 8-key chunks of a row from key j (the first of them an even chunk) to nk, a multiple of 8:
// chunk(j, odd) for each, odd telling the odd chunks from the even. The one-pass rows below sum
// the two apart, the halves of the AVX-512 build's 16-lane sums, so both builds add the same
// numbers in the same order.
template <typename F>
inline void for_chunk_pairs(int64_t j, int64_t nk, F&& chunk) {
  for (; j + 16 <= nk; j += 16) {
    chunk(j, false);
    chunk(j + 8, true);
  }
  if (j < nk) chunk(j, false);
}

// Whole rows of 8-lane chunks with every key visible (the common case) need no lane mask.
inline bool unmasked(int64_t nk, int64_t vis) { return vis >= nk && nk % 8 == 0; }

// The 8-lane chunks that cover nk keys (the s / dp rows are BK wide: whole chunks stay inside).
inline int64_t chunk_end(int64_t nk) { return (nk + 7) / 8 * 8; }

// Forward, the one pass of exp_sum_row_stale for a single row (kMasked: keys from vis are -inf):
// its sums of the even and the odd 8-key chunks (for_chunk_pairs) as exp_sum_rows8_stale keeps
// them, so that the AVX-512 build can take 16 keys at a time (the halves of its sum) and still
// add the same numbers in the same order as the AVX2 build. Rows of band tiles that sit in one
// clamped bucket take this (a clamped tile's rows take exp_sum_rows8_stale).
template <bool kMasked>
inline bool exp_sum_row_stale_(float* sr, int64_t nk, int64_t vis, float c, float m, float& sum) {
  const int64_t n8 = chunk_end(nk);
  const __m256 vc = _mm256_set1_ps(c), vm = _mm256_set1_ps(m), ninf = _mm256_set1_ps(kNegInf);
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, mx = ninf;
  int64_t j = 0;
#if defined(__AVX512F__)
  {
    const __m512 vc16 = _mm512_set1_ps(c), vm16 = _mm512_set1_ps(m);
    const __m512 ninf16 = _mm512_set1_ps(kNegInf);
    const __m512i idx16 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 a16 = _mm512_setzero_ps(), mx16 = ninf16;
    for (; j + 16 <= n8; j += 16) {
      __m512 x = _mm512_sub_ps(_mm512_add_ps(_mm512_loadu_ps(sr + j), vc16), vm16);
      if constexpr (kMasked) {
        const __mmask16 keep = _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(static_cast<int>(vis - j)), idx16);
        x = _mm512_mask_blend_ps(keep, ninf16, x);
      }
      mx16 = _mm512_max_ps(x, mx16);
      const __m512 e = exp_512(x);
      _mm512_storeu_ps(sr + j, e);
      a16 = _mm512_add_ps(a16, e);
    }
    a0 = _mm512_castps512_ps256(a16);
    a1 = _mm512_extractf32x8_ps(a16, 1);
    mx = _mm256_max_ps(_mm512_castps512_ps256(mx16), _mm512_extractf32x8_ps(mx16, 1));
  }
#endif
  for_chunk_pairs(j, n8, [&](int64_t jj, bool odd) {
    __m256& a = odd ? a1 : a0;
    __m256 x = _mm256_sub_ps(_mm256_add_ps(_mm256_loadu_ps(sr + jj), vc), vm);
    if constexpr (kMasked) {
      const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(vis - jj)), idx);
      x = _mm256_blendv_ps(ninf, x, _mm256_castsi256_ps(keep));
    }
    mx = _mm256_max_ps(x, mx);
    const __m256 e = exp_256(x);
    _mm256_storeu_ps(sr + jj, e);
    a = _mm256_add_ps(a, e);
  });
  if (_mm256_movemask_ps(_mm256_cmp_ps(mx, _mm256_set1_ps(kStaleMax), _CMP_GT_OQ)) != 0) return false;
  sum = hsum(_mm256_add_ps(a0, a1));
  return true;
}

// Forward, exp_sum_row_stale for 8 rows at once (row stride ld): rows whose keys in this tile all
// sit in one clamped bucket and are all visible, nk a multiple of 8, every row with a running
// maximum m[u]; c: the rows' key-term constants (null: none). Row u becomes e^(s + c[u] - m[u])
// and its sum is added to l[u] (and w[u] when w is not null), as one vector. Returns a bit per
// row that went over kStaleMax: those rows' sums are not added and their logits are overwritten.
// The exponentials are those of exp_sum_row_stale; what goes is the per-row split, tests and
// reduction (L = 2048, H = 8, D = 64, K = 64, one core: forward 100.9 -> 98.2 ms).
// Under dropout (drop: the 8 rows' RowDropout, keys from j0) the rows keep the dropped
// probabilities and w takes their sums, while l takes the sums without dropout.
// The AVX-512 build takes 16 keys at a time without dropout (exp_512): L = 2048, H = 8,
// D = 64, K = 64, 2 threads, 8 alternating runs: forward 44.8 -> 41.7 ms (medians). Its sums go
// into one 16-lane accumulator, whose halves the 8-lane loop (AVX2, dropout, a last 8 keys) keeps
// as two accumulators, the even and the odd chunks: the same sums in the same order, with two
// add chains instead of one per row (and one add per 16 keys instead of two and an extract).
// A row goes over when its largest logit does (one max per chunk, not a compare and an or).
// Both, with a one-add range reduction (of the base-2 exponential then, see expv), on a 64 x 64
// tile of these rows in L1: AVX-512 0.264 -> 0.217 ns a key, AVX2 0.333 -> 0.289 (best of
// 5 x 20000 tiles, one core).
template <bool kDrop = false>
inline int exp_sum_rows8_stale(float* s, int64_t ld, int64_t nk, const float* c, const float* m,
                               float* l, float* w, const RowDropout* drop = nullptr,
                               int64_t j0 = 0) {
  const __m256 lim = _mm256_set1_ps(kStaleMax), ninf = _mm256_set1_ps(kNegInf);
  __m256 acc[8], dacc[8];
  int over = 0;
  for (int u = 0; u < 8; ++u) {
    float* sr = s + u * ld;
    const float cu = c != nullptr ? c[u] : 0.f;
    const __m256 vc = _mm256_set1_ps(cu), vm = _mm256_set1_ps(m[u]);
    // the sums of the even and of the odd 8-key chunks (for_chunk_pairs), and the largest logit
    // (max(x, mx) keeps mx where x is NaN, which never counts as over, as in a compare)
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, d0 = a0, d1 = a0, mx = ninf;
    int64_t j = 0;
#if defined(__AVX512F__)
    if constexpr (!kDrop) {  // 16 keys at a time: the halves of a16 are a0 and a1
      const __m512 vc16 = _mm512_set1_ps(cu), vm16 = _mm512_set1_ps(m[u]);
      __m512 a16 = _mm512_setzero_ps(), mx16 = _mm512_set1_ps(kNegInf);
      for (; j + 16 <= nk; j += 16) {
        const __m512 x = _mm512_sub_ps(_mm512_add_ps(_mm512_loadu_ps(sr + j), vc16), vm16);
        mx16 = _mm512_max_ps(x, mx16);
        const __m512 e = exp_512(x);
        _mm512_storeu_ps(sr + j, e);
        a16 = _mm512_add_ps(a16, e);
      }
      a0 = _mm512_castps512_ps256(a16);
      a1 = _mm512_extractf32x8_ps(a16, 1);
      mx = _mm256_max_ps(_mm512_castps512_ps256(mx16), _mm512_extractf32x8_ps(mx16, 1));
    }
#endif
    for_chunk_pairs(j, nk, [&](int64_t jj, bool odd) {
      __m256& a = odd ? a1 : a0;
      __m256& d = odd ? d1 : d0;
      const __m256 x = _mm256_sub_ps(_mm256_add_ps(_mm256_loadu_ps(sr + jj), vc), vm);
      mx = _mm256_max_ps(x, mx);
      const __m256 e = exp_256(x);
      a = _mm256_add_ps(a, e);
      if constexpr (kDrop) {
        const __m256 ed = _mm256_mul_ps(e, drop[u].factors(j0 + jj));
        _mm256_storeu_ps(sr + jj, ed);
        d = _mm256_add_ps(d, ed);
      } else {
        _mm256_storeu_ps(sr + jj, e);
      }
    });
    acc[u] = _mm256_add_ps(a0, a1);
    dacc[u] = _mm256_add_ps(d0, d1);
    over |= (_mm256_movemask_ps(_mm256_cmp_ps(mx, lim, _CMP_GT_OQ)) != 0) << u;
  }
  // lanes of the rows that went over: 0
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i bad = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(over), bit), bit);
  const __m256 sums = _mm256_andnot_ps(_mm256_castsi256_ps(bad), hsum8(acc));
  _mm256_storeu_ps(l, _mm256_add_ps(_mm256_loadu_ps(l), sums));
  if (w != nullptr) {
    const __m256 ws = kDrop ? _mm256_andnot_ps(_mm256_castsi256_ps(bad), hsum8(dacc)) : sums;
    _mm256_storeu_ps(w, _mm256_add_ps(_mm256_loadu_ps(w), ws));
  }
  return over;
}

inline bool exp_sum_row_stale(float* sr, int64_t nk, int64_t vis, float c, float m, float& sum) {
  return unmasked(nk, vis) ? exp_sum_row_stale_<false>(sr, nk, vis, c, m, sum)
                           : exp_sum_row_stale_<true>(sr, nk, vis, c, m, sum);
}

// A row's relative term over a key tile, by bucket: lo for bucket 0, hi for bucket 2K, and
// inside the band row[sp.col0 + j] for key j (row null: no term, 0).
struct BandTerm {
  float lo = 0.f, hi = 0.f;
  const float* row = nullptr;
};
// Where a row's per-bucket sums go, as add_bucket_mass: lo, hi and the band row (row null: not
// summed).
struct BandMass {
  float* lo = nullptr;
  float* hi = nullptr;
  float* row = nullptr;
};

// The one-pass band rows below walk a row of a clear tile whose keys span several buckets (a
// band tile, near the diagonal) 8 keys at a time; per chunk of keys j0 + j .. j0 + j + 7, which
// lanes sit in bucket 0 (left), inside the band (in), in bucket 2K (right) and before the
// causal limit vis (keep); inside: whether any lane is in, col: the band column of the chunk's
// first key. Lanes past nk are past vis too (vis <= nk).
struct BandChunk {
  __m256i left, right, in;
  __m256 keep;
  bool inside;
  int64_t col;
};
class BandLanes {
 public:
  BandLanes(int64_t j0, int64_t vis, const RowSplit& sp)
      : j0_(j0), sp_(sp), ia_(_mm256_set1_epi32(static_cast<int>(sp.a - j0))),
        ie_(_mm256_set1_epi32(static_cast<int>(sp.e - j0))),
        iv_(_mm256_set1_epi32(static_cast<int>(vis))) {}
  BandChunk at(int64_t j) const {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i pos = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(j)), idx);
    BandChunk c;
    c.left = _mm256_cmpgt_epi32(ia_, pos);
    c.right = _mm256_cmpgt_epi32(_mm256_add_epi32(pos, _mm256_set1_epi32(1)), ie_);
    c.in = _mm256_xor_si256(_mm256_or_si256(c.left, c.right), _mm256_set1_epi32(-1));
    c.keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(iv_, pos));
    const int64_t k = j0_ + j;  // the chunk's first key
    c.inside = k + 8 > sp_.a && k < sp_.e;
    c.col = sp_.col0 + k;
    return c;
  }

 private:
  int64_t j0_;
  RowSplit sp_;
  __m256i ia_, ie_, iv_;
};

// A BandTerm minus a shift per row, lane by lane over a chunk: lo - shift, hi - shift or the
// band row's column - shift, by each key's bucket (the inside columns by a masked load).
class ShiftedTerm {
 public:
  ShiftedTerm(const BandTerm& t, float shift)
      : lo_(_mm256_set1_ps(t.lo - shift)), hi_(_mm256_set1_ps(t.hi - shift)),
        shift_(_mm256_set1_ps(shift)), row_(t.row) {}
  __m256 at(const BandChunk& c) const {
    const __m256 x = _mm256_blendv_ps(lo_, hi_, _mm256_castsi256_ps(c.right));
    if (!c.inside) return x;
    const __m256 q =
        row_ != nullptr ? _mm256_maskload_ps(row_ + c.col, c.in) : _mm256_setzero_ps();
    return _mm256_blendv_ps(x, _mm256_sub_ps(q, shift_), _mm256_castsi256_ps(c.in));
  }

 private:
  __m256 lo_, hi_, shift_;
  const float* row_;
};

#if defined(__AVX512F__)
// BandLanes and ShiftedTerm 16 keys at a time, for the AVX-512 build: the same lanes (as mask
// bits) and the same terms, lane by lane.
struct BandChunk16 {
  __mmask16 left, right, in, keep;
  bool inside;
  int64_t col;
};
class BandLanes16 {
 public:
  BandLanes16(int64_t j0, int64_t vis, const RowSplit& sp)
      : j0_(j0), sp_(sp), ia_(_mm512_set1_epi32(static_cast<int>(sp.a - j0))),
        ie_(_mm512_set1_epi32(static_cast<int>(sp.e - j0))),
        iv_(_mm512_set1_epi32(static_cast<int>(vis))) {}
  BandChunk16 at(int64_t j) const {
    const __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i pos = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(j)), idx);
    BandChunk16 c;
    c.left = _mm512_cmpgt_epi32_mask(ia_, pos);
    c.right = _mm512_cmpge_epi32_mask(pos, ie_);
    c.in = static_cast<__mmask16>(~(c.left | c.right));
    c.keep = _mm512_cmpgt_epi32_mask(iv_, pos);
    const int64_t k = j0_ + j;
    c.inside = k + 16 > sp_.a && k < sp_.e;
    c.col = sp_.col0 + k;
    return c;
  }

 private:
  int64_t j0_;
  RowSplit sp_;
  __m512i ia_, ie_, iv_;
};
class ShiftedTerm16 {
 public:
  ShiftedTerm16(const BandTerm& t, float shift)
      : lo_(_mm512_set1_ps(t.lo - shift)), hi_(_mm512_set1_ps(t.hi - shift)),
        shift_(_mm512_set1_ps(shift)), row_(t.row) {}
  __m512 at(const BandChunk16& c) const {
    const __m512 x = _mm512_mask_blend_ps(c.right, lo_, hi_);
    if (!c.inside) return x;
    const __m512 q = row_ != nullptr ? _mm512_maskz_loadu_ps(c.in, row_ + c.col) : _mm512_setzero_ps();
    return _mm512_mask_blend_ps(c.in, x, _mm512_sub_ps(q, shift_));
  }

 private:
  __m512 lo_, hi_, shift_;
  const float* row_;
};
#endif

// Forward, exp_sum_row_stale for a band row: sr = e^(sr + rel - m) in place, rel being tk's value
// of each key's bucket (the key term), keys from vis on masked (0). One pass, where
// add_rel_logits, mask_logits, max_row, exp_row and sum_row take five; returns false, as
// exp_sum_row_stale, when a visible logit exceeds m by more than kStaleMax. The sums of the even
// and the odd 8-key chunks apart, as exp_sum_row_stale_, so that the AVX-512 build takes 16 keys
// at a time with the AVX2 build's results.
inline bool band_row_stale(float* sr, int64_t j0, int64_t nk, int64_t vis, const RowSplit& sp,
                           const BandTerm& tk, float m, float& sum) {
  const int64_t n8 = chunk_end(nk);
  const __m256 ninf = _mm256_set1_ps(kNegInf);
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, mx = ninf;
  int64_t j = 0;
#if defined(__AVX512F__)
  {
    const BandLanes16 lanes(j0, vis, sp);
    const ShiftedTerm16 rel(tk, 0.f);
    const __m512 ninf16 = _mm512_set1_ps(kNegInf), vm16 = _mm512_set1_ps(m);
    __m512 a16 = _mm512_setzero_ps(), mx16 = ninf16;
    for (; j + 16 <= n8; j += 16) {
      const BandChunk16 c = lanes.at(j);
      const __m512 x = _mm512_mask_blend_ps(
          c.keep, ninf16, _mm512_sub_ps(_mm512_add_ps(_mm512_loadu_ps(sr + j), rel.at(c)), vm16));
      mx16 = _mm512_max_ps(x, mx16);
      const __m512 e = exp_512(x);
      _mm512_storeu_ps(sr + j, e);
      a16 = _mm512_add_ps(a16, e);
    }
    a0 = _mm512_castps512_ps256(a16);
    a1 = _mm512_extractf32x8_ps(a16, 1);
    mx = _mm256_max_ps(_mm512_castps512_ps256(mx16), _mm512_extractf32x8_ps(mx16, 1));
  }
#endif
  const BandLanes lanes(j0, vis, sp);
  const ShiftedTerm rel(tk, 0.f);
  const __m256 vm = _mm256_set1_ps(m);
  for_chunk_pairs(j, n8, [&](int64_t jj, bool odd) {
    __m256& a = odd ? a1 : a0;
    const BandChunk c = lanes.at(jj);
    const __m256 x = _mm256_blendv_ps(
        ninf, _mm256_sub_ps(_mm256_add_ps(_mm256_loadu_ps(sr + jj), rel.at(c)), vm), c.keep);
    mx = _mm256_max_ps(x, mx);
    const __m256 e = exp_256(x);
    _mm256_storeu_ps(sr + jj, e);
    a = _mm256_add_ps(a, e);
  });
  if (_mm256_movemask_ps(_mm256_cmp_ps(mx, _mm256_set1_ps(kStaleMax), _CMP_GT_OQ)) != 0) {
    return false;
  }
  sum = hsum(_mm256_add_ps(a0, a1));
  return true;
}

// Backward (logits s, ck and lse): P = e^(s + ck - lse), dS = scale P (dp + cv - di) in
// one pass, masked lanes 0; adds the row sums of P and dS to psum / dssum.
template <bool kMasked>
inline void grad_row_uniform_(float* sr, float* dpr, int64_t nk, int64_t vis, float ck, float cv,
                              float scale, float lse, float di, float& psum, float& dssum) {
  const int64_t n8 = chunk_end(nk);
  // the sums of P and dS over the even and the odd 8-key chunks (for_chunk_pairs), so that the
  // AVX-512 build takes 16 keys at a time with the AVX2 build's results
  __m256 p0 = _mm256_setzero_ps(), p1 = p0, g0 = p0, g1 = p0;
  int64_t j = 0;
#if defined(__AVX512F__)
  {
    const __m512 vck = _mm512_set1_ps(ck), vlse = _mm512_set1_ps(lse), vsc = _mm512_set1_ps(scale);
    const __m512 vcd = _mm512_set1_ps(cv - di), ninf = _mm512_set1_ps(kNegInf);
    const __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 ps = _mm512_setzero_ps(), ds = ps;
    for (; j + 16 <= n8; j += 16) {
      __m512 x = _mm512_sub_ps(_mm512_add_ps(_mm512_loadu_ps(sr + j), vck), vlse);
      __mmask16 keep = 0xFFFF;
      if constexpr (kMasked) {
        keep = _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(static_cast<int>(vis - j)), idx);
        x = _mm512_mask_blend_ps(keep, ninf, x);
      }
      const __m512 pj = exp_512(x);
      const __m512 pd = _mm512_mul_ps(pj, _mm512_add_ps(_mm512_loadu_ps(dpr + j), vcd));
      // masked lanes: 0, whatever the lanes past nk hold
      const __m512 g = kMasked ? _mm512_maskz_mul_ps(keep, vsc, pd) : _mm512_mul_ps(vsc, pd);
      _mm512_storeu_ps(sr + j, pj);
      _mm512_storeu_ps(dpr + j, g);
      ps = _mm512_add_ps(ps, pj);
      ds = _mm512_add_ps(ds, g);
    }
    p0 = _mm512_castps512_ps256(ps);
    p1 = _mm512_extractf32x8_ps(ps, 1);
    g0 = _mm512_castps512_ps256(ds);
    g1 = _mm512_extractf32x8_ps(ds, 1);
  }
#endif
  const __m256 vck = _mm256_set1_ps(ck), vlse = _mm256_set1_ps(lse), vsc = _mm256_set1_ps(scale);
  const __m256 vcd = _mm256_set1_ps(cv - di), ninf = _mm256_set1_ps(kNegInf);
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for_chunk_pairs(j, n8, [&](int64_t jj, bool odd) {
    __m256 x = _mm256_sub_ps(_mm256_add_ps(_mm256_loadu_ps(sr + jj), vck), vlse);
    __m256 keep;
    if constexpr (kMasked) {
      keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(vis - jj)), idx));
      x = _mm256_blendv_ps(ninf, x, keep);
    }
    const __m256 pj = exp_256(x);
    __m256 g = _mm256_mul_ps(vsc, _mm256_mul_ps(pj, _mm256_add_ps(_mm256_loadu_ps(dpr + jj), vcd)));
    if constexpr (kMasked) g = _mm256_and_ps(keep, g);  // 0, whatever the lanes past nk hold
    _mm256_storeu_ps(sr + jj, pj);
    _mm256_storeu_ps(dpr + jj, g);
    __m256& ps = odd ? p1 : p0;
    __m256& ds = odd ? g1 : g0;
    ps = _mm256_add_ps(ps, pj);
    ds = _mm256_add_ps(ds, g);
  });
  psum += hsum(_mm256_add_ps(p0, p1));
  dssum += hsum(_mm256_add_ps(g0, g1));
}

// Backward, grad_row_uniform for 8 rows at once (row stride BK) of a tile whose rows all sit in
// one clamped bucket with every key visible and nk a multiple of 8 (uniform_tile): ck, cv, lse,
// di per row (ck / cv null: no such term). The row sums go to psum[u] and dssum[u] as one vector
// each (hsum8) instead of two horizontal sums per row (L = 2048, H = 8, D = 64, K = 64, one
// core, medians of 3 alternating pairs: backward 233.6-237.3 -> 230.4-234.0 ms; 2 threads
// within the noise, 117.6-119.8 -> 117.2-118.5 ms).
// Under dropout (drop: the 8 rows' RowDropout, keys from j0, factors f): dS = scale P (f (dP +
// cv) - d_i) and P *= f, as softmax_grad_row_dropout. The AVX-512 build takes 16 keys at a time
// without dropout, with its sums split as in exp_sum_rows8_stale (forward+backward 138.3 -> 134.5
// ms, medians; with the split sums and a one-add range reduction (base 2 then, see expv),
// 8 alternating runs, medians: AVX-512 130.3 -> 126.9 ms, the AVX2 path 275 -> 244 ms).
template <bool kDrop = false>
inline void grad_rows8_uniform(float* s, float* dp, int64_t nk, const float* ck, const float* cv,
                               float scale, const float* lse, const float* di, float* psum,
                               float* dssum, const RowDropout* drop = nullptr, int64_t j0 = 0) {
  const __m256 vsc = _mm256_set1_ps(scale);
  __m256 pacc[8], dacc[8];
  for (int u = 0; u < 8; ++u) {
    float* sr = s + u * BK;
    float* dpr = dp + u * BK;
    const float ck_u = ck != nullptr ? ck[u] : 0.f, cv_u = cv != nullptr ? cv[u] : 0.f;
    const __m256 vck = _mm256_set1_ps(ck_u), vlse = _mm256_set1_ps(lse[u]);
    const __m256 vcv = _mm256_set1_ps(cv_u), vdi = _mm256_set1_ps(di[u]);
    const __m256 vcd = _mm256_set1_ps(cv_u - di[u]);
    // the sums of P and dS over the even and over the odd 8-key chunks (for_chunk_pairs)
    __m256 p0 = _mm256_setzero_ps(), p1 = p0, g0 = p0, g1 = p0;
    int64_t j = 0;
#if defined(__AVX512F__)
    if constexpr (!kDrop) {  // 16 keys at a time: the halves of the sums are p0 / p1, g0 / g1
      const __m512 vck16 = _mm512_set1_ps(ck_u), vlse16 = _mm512_set1_ps(lse[u]);
      const __m512 vcd16 = _mm512_set1_ps(cv_u - di[u]);
      const __m512 vsc16 = _mm512_set1_ps(scale);
      __m512 ps = _mm512_setzero_ps(), ds = _mm512_setzero_ps();
      for (; j + 16 <= nk; j += 16) {
        const __m512 x = _mm512_sub_ps(_mm512_add_ps(_mm512_loadu_ps(sr + j), vck16), vlse16);
        const __m512 pj = exp_512(x);
        const __m512 g = _mm512_mul_ps(vsc16, _mm512_mul_ps(pj, _mm512_add_ps(_mm512_loadu_ps(dpr + j), vcd16)));
        _mm512_storeu_ps(sr + j, pj);
        _mm512_storeu_ps(dpr + j, g);
        ps = _mm512_add_ps(ps, pj);
        ds = _mm512_add_ps(ds, g);
      }
      p0 = _mm512_castps512_ps256(ps);
      p1 = _mm512_extractf32x8_ps(ps, 1);
      g0 = _mm512_castps512_ps256(ds);
      g1 = _mm512_extractf32x8_ps(ds, 1);
    }
#endif
    for_chunk_pairs(j, nk, [&](int64_t jj, bool odd) {
      __m256& ps = odd ? p1 : p0;
      __m256& ds = odd ? g1 : g0;
      __m256 pj = exp_256(_mm256_sub_ps(_mm256_add_ps(_mm256_loadu_ps(sr + jj), vck), vlse));
      __m256 g;
      if constexpr (kDrop) {
        const __m256 f = drop[u].factors(j0 + jj);
        const __m256 dpf = _mm256_mul_ps(f, _mm256_add_ps(_mm256_loadu_ps(dpr + jj), vcv));
        g = _mm256_mul_ps(vsc, _mm256_mul_ps(pj, _mm256_sub_ps(dpf, vdi)));
        pj = _mm256_mul_ps(pj, f);
      } else {
        g = _mm256_mul_ps(vsc, _mm256_mul_ps(pj, _mm256_add_ps(_mm256_loadu_ps(dpr + jj), vcd)));
      }
      _mm256_storeu_ps(sr + jj, pj);
      _mm256_storeu_ps(dpr + jj, g);
      ps = _mm256_add_ps(ps, pj);
      ds = _mm256_add_ps(ds, g);
    });
    pacc[u] = _mm256_add_ps(p0, p1);
    dacc[u] = _mm256_add_ps(g0, g1);
  }
  if (psum != nullptr) _mm256_storeu_ps(psum, _mm256_add_ps(_mm256_loadu_ps(psum), hsum8(pacc)));
  if (dssum != nullptr) _mm256_storeu_ps(dssum, _mm256_add_ps(_mm256_loadu_ps(dssum), hsum8(dacc)));
}

inline void grad_row_uniform(float* sr, float* dpr, int64_t nk, int64_t vis, float ck, float cv,
                             float scale, float lse, float di, float& psum, float& dssum) {
  if (unmasked(nk, vis)) {
    grad_row_uniform_<false>(sr, dpr, nk, vis, ck, cv, scale, lse, di, psum, dssum);
  } else {
    grad_row_uniform_<true>(sr, dpr, nk, vis, ck, cv, scale, lse, di, psum, dssum);
  }
}

// Backward, a band row (see BandLanes) of a clear tile without dropout in one pass: P = e^(s +
// tk - lse) and dS = scale P (dP + tv - d_i) in place (keys from vis masked: 0), tk / tv being
// the key / value term of each key's bucket; P summed per bucket into pm, dS into dm. The
// general path takes add_rel_logits twice, mask_logits, exp_row, softmax_grad_row and
// add_bucket_mass twice (B = 1, H = 8, D = 64, K = 64, 2 threads, alternating runs, medians of
// forward+backward: L = 512 11.8 -> 11.5 ms, L = 2048 126.6 -> 125.2 ms). The AVX-512 build takes
// 16 keys at a time, with the sums split into even and odd chunks as exp_sum_row_stale_ does:
// bitwise the AVX2 build's results.
inline void grad_band_row(float* sr, float* dpr, int64_t j0, int64_t nk, int64_t vis,
                          const RowSplit& sp, const BandTerm& tk, const BandTerm& tv, float scale,
                          float lse, float di, const BandMass& pm, const BandMass& dm) {
  const int64_t n8 = chunk_end(nk);
  // the clamped buckets' sums of P and dS over the even and the odd 8-key chunks
  // (for_chunk_pairs): [0] / [1] bucket 0, [2] / [3] bucket 2K
  __m256 ps[4], ds[4];
  for (int u = 0; u < 4; ++u) ps[u] = ds[u] = _mm256_setzero_ps();
  int64_t j = 0;
#if defined(__AVX512F__)
  {  // 16 keys at a time: the halves of each sum are its even and odd chunks' parts
    const BandLanes16 lanes(j0, vis, sp);
    const ShiftedTerm16 rk(tk, 0.f), rv(tv, di);
    const __m512 vsc = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(kNegInf);
    const __m512 vlse = _mm512_set1_ps(lse);
    __m512 p_lo = _mm512_setzero_ps(), p_hi = p_lo, d_lo = p_lo, d_hi = p_lo;
    auto add_band = [](float* row, __mmask16 in, __m512 x) {
      _mm512_mask_storeu_ps(row, in, _mm512_add_ps(_mm512_maskz_loadu_ps(in, row), x));
    };
    for (; j + 16 <= n8; j += 16) {
      const BandChunk16 c = lanes.at(j);
      const __m512 x = _mm512_sub_ps(_mm512_add_ps(_mm512_loadu_ps(sr + j), rk.at(c)), vlse);
      const __m512 pj = exp_512(_mm512_mask_blend_ps(c.keep, ninf, x));
      const __m512 dpv = _mm512_add_ps(_mm512_loadu_ps(dpr + j), rv.at(c));
      const __m512 g = _mm512_maskz_mul_ps(c.keep, vsc, _mm512_mul_ps(pj, dpv));
      _mm512_storeu_ps(sr + j, pj);
      _mm512_storeu_ps(dpr + j, g);
      if (pm.row != nullptr) {
        p_lo = _mm512_add_ps(p_lo, _mm512_maskz_mov_ps(c.left, pj));
        p_hi = _mm512_add_ps(p_hi, _mm512_maskz_mov_ps(c.right, pj));
        if (c.inside) add_band(pm.row + c.col, c.in, pj);
      }
      if (dm.row != nullptr) {
        d_lo = _mm512_add_ps(d_lo, _mm512_maskz_mov_ps(c.left, g));
        d_hi = _mm512_add_ps(d_hi, _mm512_maskz_mov_ps(c.right, g));
        if (c.inside) add_band(dm.row + c.col, c.in, g);
      }
    }
    const __m512 p16[2] = {p_lo, p_hi}, d16[2] = {d_lo, d_hi};
    for (int u = 0; u < 2; ++u) {
      ps[2 * u] = _mm512_castps512_ps256(p16[u]);
      ps[2 * u + 1] = _mm512_extractf32x8_ps(p16[u], 1);
      ds[2 * u] = _mm512_castps512_ps256(d16[u]);
      ds[2 * u + 1] = _mm512_extractf32x8_ps(d16[u], 1);
    }
  }
#endif
  const BandLanes lanes(j0, vis, sp);
  const ShiftedTerm rk(tk, 0.f), rv(tv, di);
  const __m256 vsc = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(kNegInf);
  const __m256 vlse = _mm256_set1_ps(lse);
  // the band row's columns of the chunk's keys: a masked load, add and store (inside lanes only)
  auto add_band = [](float* row, __m256i in, __m256 x) {
    _mm256_maskstore_ps(row, in, _mm256_add_ps(_mm256_maskload_ps(row, in), x));
  };
  for_chunk_pairs(j, n8, [&](int64_t jj, bool odd) {
    const BandChunk c = lanes.at(jj);
    const __m256 x = _mm256_sub_ps(_mm256_add_ps(_mm256_loadu_ps(sr + jj), rk.at(c)), vlse);
    const __m256 pj = exp_256(_mm256_blendv_ps(ninf, x, c.keep));
    const __m256 dpv = _mm256_add_ps(_mm256_loadu_ps(dpr + jj), rv.at(c));
    // masked lanes: 0, whatever the lanes past nk hold
    const __m256 g = _mm256_and_ps(c.keep, _mm256_mul_ps(vsc, _mm256_mul_ps(pj, dpv)));
    _mm256_storeu_ps(sr + jj, pj);
    _mm256_storeu_ps(dpr + jj, g);
    const __m256 lf = _mm256_castsi256_ps(c.left), rf = _mm256_castsi256_ps(c.right);
    if (pm.row != nullptr) {
      ps[odd] = _mm256_add_ps(ps[odd], _mm256_and_ps(lf, pj));
      ps[2 + odd] = _mm256_add_ps(ps[2 + odd], _mm256_and_ps(rf, pj));
      if (c.inside) add_band(pm.row + c.col, c.in, pj);
    }
    if (dm.row != nullptr) {
      ds[odd] = _mm256_add_ps(ds[odd], _mm256_and_ps(lf, g));
      ds[2 + odd] = _mm256_add_ps(ds[2 + odd], _mm256_and_ps(rf, g));
      if (c.inside) add_band(dm.row + c.col, c.in, g);
    }
  });
  if (pm.row != nullptr) {
    *pm.lo += hsum(_mm256_add_ps(ps[0], ps[1]));
    *pm.hi += hsum(_mm256_add_ps(ps[2], ps[3]));
  }
  if (dm.row != nullptr) {
    *dm.lo += hsum(_mm256_add_ps(ds[0], ds[1]));
    *dm.hi += hsum(_mm256_add_ps(ds[2], ds[3]));
  }
}

// Add the key term to a row of logits: s[j - j0] += q_i . rel_k[b(i, j)] (+ the bias of b(i, j)).
void add_rel_logits(float* s, int64_t j0, int64_t nk, const RowSplit& sp, float lo, float hi,
                    const float* qe_row) {
  add_const(lo, s, sp.a - j0);
  add_row(qe_row + sp.col0 + sp.a, s + (sp.a - j0), sp.e - sp.a);
  add_const(hi, s + (sp.e - j0), j0 + nk - sp.e);
}

// Accumulate a row of per-key values into per-bucket sums: lo/hi running sums, band row.
void add_bucket_mass(const float* x, int64_t j0, int64_t nk, const RowSplit& sp, float& lo,
                     float& hi, float* w_row) {
  lo += sum_row(x, sp.a - j0);
  hi += sum_row(x + (sp.e - j0), j0 + nk - sp.e);
  add_row(x + (sp.a - j0), w_row + sp.col0 + sp.a, sp.e - sp.a);
}

// Band rows of a table as float: rows [lo, lo + n) -> [n, D]; and its transpose [D, n].
void load_band(DType d, const char* table, int64_t dim, const Band& band, float* rows,
               float* rows_t) {
  load_block(d, table + band.lo * dim * elem_bytes(d), dim, band.n, dim, rows, dim);
  if (rows_t != nullptr) transpose(rows, dim, band.n, dim, rows_t, band.n);
}

// Which table's band a pair of load_band buffers holds. Query tiles away from the sequence's
// ends all reach the whole inner band [1, 2K - 1], and consecutive work items are tiles of one
// head (tables shared by the heads: of every head), so most tiles find their band loaded already
// (L = 512, H = 8, D = 64, K = 64: the copy and transpose took 2% of the forward).
class BandCache {
 public:
  // load_band unless this cache last loaded the same band of the same table into these buffers
  void load(DType d, const char* table, int64_t dim, const Band& band, float* rows, float* rows_t) {
    if (table == table_ && band.lo == lo_ && band.n == n_) return;
    load_band(d, table, dim, band, rows, rows_t);
    table_ = table;
    lo_ = band.lo;
    n_ = band.n;
  }

 private:
  const char* table_ = nullptr;
  int64_t lo_ = -1, n_ = -1;
};

// The relative term of mq rows x (Q, or dO in the backward) against a table, e0 / e1 being its
// clamped rows 0 and 2K as float: lo[r] = x_r . e0, hi[r] = x_r . e1 (table_ends), and over the
// band of inside buckets xe[r, c] = x_r . table[band.lo + c] (table_band); the band rows are left
// in band_rows (as float) and transposed in band_t.
void table_ends(const float* x, int64_t mq, int64_t D, const float* e0, const float* e1, float* lo,
                float* hi) {
  for (int64_t r = 0; r < mq; ++r) {
    lo[r] = dot(x + r * D, e0, D);
    hi[r] = dot(x + r * D, e1, D);
  }
}

void table_band(DType d, const char* table, int64_t D, const Band& band, const float* x,
                int64_t mq, float* xe, float* band_rows, float* band_t, BandCache& cache) {
  if (band.n > 0) {
    cache.load(d, table, D, band, band_rows, band_t);
    gemm0(mq, band.n, D, x, D, band_t, band.n, xe, band.n);
  }
}

void table_terms(DType d, const char* table, int64_t D, const Band& band, const float* x,
                 int64_t mq, const float* e0, const float* e1, float* lo, float* hi, float* xe,
                 float* band_rows, float* band_t, BandCache& cache) {
  table_ends(x, mq, D, e0, e1, lo, hi);
  table_band(d, table, D, band, x, mq, xe, band_rows, band_t, cache);
}

// The relative terms' band matmuls by the same dots (bfloat16 tables, D even). Table rows are
// bfloat16 already, so band_dots is exact up to the order of the sums, as S is; band_acc_dots
// rounds its weights to bfloat16, as P and dS are rounded for P V and dS K.
// xe[r, c] = alpha * x_r . table[band.lo + c] for mq rows x (leading dim ldx) over the band;
// pk: D / 2 x band.n words (the band rows' pairs, transposed).
void band_dots(const uint16_t* table, int64_t D, const Band& band, const uint16_t* x, int64_t ldx,
               int64_t mq, float alpha, float* xe, uint32_t* pk) {
  if constexpr (kBf16Dot) {  // (the AVX2 build only declares the bfloat16 functions)
    if (band.n == 0 || mq == 0) return;
    pack_pairs_t(table + band.lo * D, band.n, D, pk, band.n);
    gemm_bf16<false>(mq, band.n, D / 2, x, ldx, pk, band.n, xe, band.n, alpha);
  }
}

// y[r, :] += sum_c wt[r, c] table[band.lo + c] for mq rows of weights wt (leading dim band.n),
// rounded into w_bf (mq x 2 ceil(band.n / 2) halves); pk: ceil(band.n / 2) x D words.
void band_acc_dots(const uint16_t* table, int64_t D, const Band& band, const float* wt,
                   int64_t mq, float* y, int64_t ldy, uint16_t* w_bf, uint32_t* pk) {
  if constexpr (kBf16Dot) {
    if (band.n == 0 || mq == 0) return;
    const int64_t n2 = (band.n + 1) / 2;
    round_rows_bf16(wt, band.n, mq, band.n, w_bf, 2 * n2);
    pack_row_pairs(table + band.lo * D, band.n, D, pk);
    gemm_bf16<true>(mq, D, n2, w_bf, 2 * n2, pk, D, y, ldy);
  }
}

// y[c, :] += sum_r wt[r, c] x_r for c < n: a table's gradient over a band, W^T X for mq rows of
// weights wt (leading dim ldw) and X's rows packed in pairs (x_pk, ceil(mq / 2) x D words); W^T
// through wt_t (n x ldt floats, ldt >= mq) and rounded into w_bf (n x 2 ceil(mq / 2) halves).
void band_grad_dots(const float* wt, int64_t ldw, int64_t mq, int64_t n, const uint32_t* x_pk,
                    int64_t D, float* y, float* wt_t, int64_t ldt, uint16_t* w_bf) {
  if constexpr (kBf16Dot) {
    if (n == 0 || mq == 0) return;
    const int64_t m2 = (mq + 1) / 2;
    transpose(wt, ldw, mq, n, wt_t, ldt);
    round_rows_bf16(wt_t, ldt, n, mq, w_bf, 2 * m2);
    gemm_bf16<true>(n, D, m2, w_bf, 2 * m2, x_pk, D, y, D);
  }
}

// The bias's part of the key term, rel_bias[b] in QE's units (scaled), added
// to the table's part (with_table) or written alone: bias_ends to the clamped buckets' lo[r] and
// hi[r] (buckets 0 and 2K) of n rows; bias_band to the band's xe[r, c] (bucket band.lo + c) of mq
// rows, through tmp (band.n floats), or without a table into xe's first row alone: the bias
// depends on the bucket only, so every row reads that one (key_term_stride).
void bias_ends(DType d, const char* bias, int64_t rows_tab, int64_t n, bool with_table, float* lo,
               float* hi) {
  float b0, b1;
  load_row(d, bias, &b0, 1);
  load_row(d, bias + (rows_tab - 1) * elem_bytes(d), &b1, 1);
  if (with_table) {
    add_const(b0, lo, n);
    add_const(b1, hi, n);
  } else {
    fill_f32(lo, b0, n);
    fill_f32(hi, b1, n);
  }
}

void bias_band(DType d, const char* bias, const Band& band, int64_t mq, bool with_table, float* xe,
               float* tmp) {
  if (band.n == 0) return;
  float* b = with_table ? tmp : xe;
  load_row(d, bias + band.lo * elem_bytes(d), b, band.n);
  if (!with_table) return;
  for (int64_t r = 0; r < mq; ++r) add_row(b, xe + r * band.n, band.n);
}

// Whether logits have a key term beyond Q K^T (a table, a bias or both); and the rows (of mq
// query rows) and row stride of its band xe and, in the backward, of the band's dS sums W_ds:
// with the bias alone one row that every query row reads (bias_band) and adds its dS into, as
// drel_bias needs only the sums over the rows (bias_grad_band).
inline bool has_key_term(const Head& hd) { return hd.rel_k != nullptr || hd.rel_bias != nullptr; }
inline int64_t key_term_rows(const Head& hd, int64_t mq) { return hd.rel_k ? mq : 1; }
inline int64_t key_term_stride(const Head& hd, const Band& band) { return hd.rel_k ? band.n : 0; }

// drel_bias over the band: partial[band.lo + c] += inv_scale * sum_r wds[r, c] over the rows of
// the scaled dS sums (several rows summed in order into sum, band.n floats, then scaled once).
void bias_grad_band(const float* wds, int64_t rows, const Band& band, float inv_scale, float* sum,
                    float* partial) {
  if (band.n == 0) return;
  if (rows > 1) {
    std::memcpy(sum, wds, sizeof(float) * band.n);
    for (int64_t r = 1; r < rows; ++r) add_row(wds + r * band.n, sum, band.n);
    wds = sum;
  }
  axpy(inv_scale, wds, partial + band.lo, band.n);
}

// The key-side table rel_q, k_j . rel_q[b(i, j)]: the key term with queries and keys swapped.
// Per key, the clamped buckets' values k_j . rel_q[0] and k_j . rel_q[2K] (the "ends", lo and
// hi); inside the band of a (query tile, key tile), KE^T[c, j - j0] = rel_q[band.lo + c] . k_j,
// [band.n, ld] (ld: the tile's width; from the transposed key tile, the B operand S = Q K^T uses).
// Bucket and key both move by one along a query row, so the row reads KE^T along a diagonal
// (stride ld + 1): an element-wise gather, where QE's row is a contiguous slice. The values are kept unscaled (dK
// takes the table as it is) and scaled by the scale as they join the logits.
//
// s[j - j0] += alpha * k_j . rel_q[b(i, j)] over the key tile [j0, j0 + nk) for the row split
// sp against KE^T's band; lo / hi: the ends of key j0 onwards.
void add_key_side(float* sr, int64_t j0, int64_t nk, const RowSplit& sp, float alpha,
                  const float* lo, const float* hi, const float* ke, int64_t ld) {
  axpy(alpha, lo, sr, sp.a - j0);
  for (int64_t j = sp.a; j < sp.e; ++j) sr[j - j0] += alpha * ke[(sp.col0 + j) * ld + (j - j0)];
  axpy(alpha, hi + (sp.e - j0), sr + (sp.e - j0), j0 + nk - sp.e);
}

// KE^T's entries that a few query rows [i0, i0 + mq) read over the key tile [j0, j0 + nk), by
// dots (the rest of KE^T is left as it is): ke[(sp.col0 + j) ld + (j - j0)] = rel_q[kband.lo +
// sp.col0 + j] . k_j, bq holding rel_q[kband] as float and keys the key rows from j0 (float, or
// float16/bfloat16 that dot converts). The forward and the backward of a few rows both take it,
// so that their key-side terms agree bitwise.
template <typename T>
void key_side_dots(const RelAttentionParams& p, int64_t i0, int64_t mq, int64_t j0, int64_t nk,
                   const Band& kband, const float* bq, const T* keys, float* ke, int64_t ld) {
  const int64_t D = p.dim;
  for (int64_t r = 0; r < mq; ++r) {
    const RowSplit sp = split_row(p, i0 + r, j0, nk, kband);
    for (int64_t j = sp.a; j < sp.e; ++j) {
      ke[(sp.col0 + j) * ld + (j - j0)] = dot(bq + (sp.col0 + j) * D, keys + (j - j0) * D, D);
    }
  }
}

// Backward, the adjoint of add_key_side for a row of dS: its clamped parts summed per key into
// ds_lo / ds_hi (of key j0 onwards), its band entries stored into WK^T (KE^T's layout, zeros on
// entry; a (bucket, key) pair of the band belongs to one query row, so nothing is summed there).
// Then dK += WK rel_q[band] and drel_q[band] += WK^T K are two small matmuls per tile.
void key_side_grad(const float* dsr, int64_t j0, int64_t nk, const RowSplit& sp, float* ds_lo,
                   float* ds_hi, float* wk) {
  add_row(dsr, ds_lo, sp.a - j0);
  for (int64_t j = sp.a; j < sp.e; ++j) wk[(sp.col0 + j) * BK + (j - j0)] = dsr[j - j0];
  add_row(dsr + (sp.e - j0), ds_hi + (sp.e - j0), j0 + nk - sp.e);
}

// The small matmuls over KE^T / WK^T in strips of `width` keys of the tile: the keys of a
// strip reach only mq + width - 1 of the tile's mq + nk - 1 band buckets, and only the pairs
// that occur are read, so each strip's matmul covers its rectangle of buckets alone (a 64 x 64
// tile inside the clipping window, 16-key strips: 79 x 16 x 4 = 5056 of 127 x 64 = 8128
// entries). f(s, w, c0, n): the strip of keys [j0 + s, j0 + s + w) and its buckets, rows
// [c0, c0 + n) of the tile's band.
// WK's two matmuls take kKeyStrip keys (their strip is the matmul's rows or its k); KE^T's
// keys are its columns, so its strips take a whole column block of the matmul (kKeTStrip for
// gemm's 2 vectors, 32 for the dots): a 16-key strip filled half of an AVX-512 block and the
// other half was computed on masked lanes (H = 12, K = 256, per-head rel_k and rel_q,
// L = 1024, 2 threads, forward: bf16 dots 19.0-24.6 -> 16.9-17.5 ms, float32 32.2-33.4 ->
// 28.4-29.7 ms).
constexpr int64_t kKeyStrip = 16;
constexpr int64_t kKeTStrip = 2 * MatmulVec::kLanes;
constexpr int64_t kKeTStripDots = 32;
static_assert(kKeyStrip % 2 == 0, "the dots take a strip's keys in pairs from its first");

template <typename F>
void for_key_strips(const RelAttentionParams& p, int64_t i0, int64_t mq, int64_t j0, int64_t nk,
                    const Band& band, F&& f, int64_t width = kKeyStrip) {
  for (int64_t s = 0; s < nk; s += width) {
    const int64_t w = imin(width, nk - s);
    const Band sb = band_of(p, i0, mq, j0 + s, j0 + s + w);
    if (sb.n > 0) f(s, w, sb.lo - band.lo, sb.n);
  }
}

// Keys [j_begin, j_end) of a kv head (dtype d, rows of D) as float for the matmuls: tiles
// [t_from, t_to) of bk keys, each transposed into kt + t * D * bk as [D, bk] (the B operand of
// S = Q K^T), and for float16/bfloat16 also row-major into rows + t * bk * D when rows is not
// null (float32 rows are read in place). tmp: bk * D floats.
void build_key_tiles(DType d, const char* base, int64_t D, int64_t bk, int64_t j_begin,
                     int64_t j_end, int64_t t_from, int64_t t_to, float* kt, float* rows,
                     float* tmp) {
  const int64_t es = elem_bytes(d);
  for (int64_t t = t_from; t < t_to; ++t) {
    const int64_t j0 = j_begin + t * bk, nk = imin(bk, j_end - j0);
    const float* src;
    if (d == DType::Float32) {
      src = reinterpret_cast<const float*>(base + j0 * D * es);
    } else {
      float* dst = rows != nullptr ? rows + t * bk * D : tmp;
      load_block(d, base + j0 * D * es, D, nk, D, dst, D);
      src = dst;
    }
    if (kt != nullptr) transpose(src, D, nk, D, kt + t * D * bk, bk);
  }
}

// rows x D block at src (dtype d) as float: in place for float32, else converted into buf.
const float* float_rows(DType d, const char* src, int64_t rows, int64_t D, float* buf) {
  if (d == DType::Float32) return reinterpret_cast<const float*>(src);
  load_block(d, src, D, rows, D, buf, D);
  return buf;
}

// Work items one at a time from the chunks a WorkQueue hands this thread.
class ItemCursor {
 public:
  explicit ItemCursor(WorkQueue& q) : q_(q) {}
  bool next(int64_t& item) {
    if (i_ == e_ && !q_.pop(i_, e_)) return false;
    item = i_++;
    return true;
  }

 private:
  WorkQueue& q_;
  int64_t i_ = 0, e_ = 0;
};

// One past the last key tile (of bk keys) that query row i_last may see.
int64_t last_key_tile(const RelAttentionParams& p, int64_t i_last, int64_t bk) {
  int64_t k_end = p.k_len;
  if (p.causal) k_end = iclamp(p.q_offset + i_last - p.k_offset + 1, 0, p.k_len);
  return (k_end + bk - 1) / bk;
}

// The keys that query rows [i0, i0 + mq) can see among key tiles [t0, t1) of tk keys: from the
// first to the last tile that tile_mask does not hide (the window, padding, the attention mask's
// tile classes, segment ids), as whole tiles; empty when it hides them all. The relative terms'
// band (band_of) covers these keys only: a window, a block-sparse mask or packed documents then
// cost a band of about their own width per query tile, not of every key, where the tables are
// long (Transformer-XL's K = L - 1).
KeySpan seen_keys(const RelAttentionParams& p, const Head& hd, int64_t i0, int64_t mq, int64_t t0,
                  int64_t t1, int64_t tk) {
  auto hidden = [&](int64_t t) {
    const int64_t j0 = t * tk;
    return tile_mask(p, hd, i0, mq, j0, imin(tk, p.k_len - j0)) == TileMask::kHidden;
  };
  while (t0 < t1 && hidden(t0)) ++t0;
  while (t1 > t0 && hidden(t1 - 1)) --t1;
  return t1 > t0 ? KeySpan{t0 * tk, imin(t1 * tk, p.k_len)} : KeySpan{0, 0};
}

// ------------------------------------------------------------------------------ forward
// Work items: (b, h, query tile of TQ rows, key chunk) of batch * heads * ceil(q_len / TQ) *
// split.chunks, with tiles of TQ x TK: BQ x BK, or kAttentionWideTile squared (split.tile).
// The keys of the current kv head are transposed (and converted) once per call and thread, tile
// by tile as needed, and reused by every query tile and query head of that kv head the thread
// visits. With one chunk an item writes its rows of out and lse; with several, the chunk's
// running maximum, sum and unnormalised output, for rel_attention_combine.
template <int64_t TQ, int64_t TK>
void forward_tiles(const RelAttentionParams& p, const AttentionFwdSplit& split, WorkQueue& work) {
  const int64_t D = p.dim, K = p.max_distance, rows_tab = num_buckets(K);
  const int64_t q_tiles = (p.q_len + TQ - 1) / TQ, es = elem_bytes(p.dtype);
  const int64_t max_band = imin(imax(2 * K - 1, 0), TQ + p.k_len);
  const int64_t n_ktiles = (p.k_len + TK - 1) / TK;
  const bool f32 = p.dtype == DType::Float32;
  const float scale = static_cast<float>(p.scale);  // logits in natural units (see expv)
  // Few query rows (decoding): scores from the key rows (scores_rows) instead of transposed key
  // tiles, which would be built for a single tile of at most kAttentionFewQueries rows.
  const bool few_q = p.q_len <= kAttentionFewQueries;
  const bool stream = few_q && p.k_len * D * es >= kStreamBytes;  // prefetch K and V rows
  const bool drop_on = p.dropout.on;
  Buffers buf;
  float* qf = buf.take(TQ * D);
  float* qs = buf.take(TQ * D);
  // Decoding reads K and V in place, in their dtype; else the transposed key tiles, and for
  // float16/bfloat16 the value rows as float, are built once per kv head and reused.
  // With bfloat16 dots (AttentionFwdSplit::bf16_dot: bfloat16, D even, kAttentionDotMinRows
  // query rows or more) the packed K^T and V tiles instead (the pairs of the dots; when
  // decoding, one tile at a time, as the float path converts them), and P rounded per tile; the
  // relative terms' matmuls by dots too, from a band of table rows packed per query tile and W
  // rounded.
  const bool bdot = kBf16Dot && split.bf16_dot;
  const int64_t D2 = D / 2, TK2 = (TK + 1) / 2, pk_tiles = few_q ? 1 : n_ktiles;
  float* kt_all = few_q || bdot ? nullptr : buf.take(n_ktiles * D * TK);
  float* v_all = f32 || few_q || bdot ? nullptr : buf.take(n_ktiles * TK * D);
  auto* kt_pk = bdot ? reinterpret_cast<uint32_t*>(buf.take(pk_tiles * D2 * TK)) : nullptr;
  auto* v_pk = bdot ? reinterpret_cast<uint32_t*>(buf.take(pk_tiles * TK2 * D)) : nullptr;
  // tile t's packed K^T and V
  auto kt_of = [&](int64_t t) { return kt_pk + (few_q ? 0 : t) * D2 * TK; };
  auto v_of = [&](int64_t t) { return v_pk + (few_q ? 0 : t) * TK2 * D; };
  // float32 inputs (matmul precision "bf16"): the query tile, and a key tile's K or V rows,
  // rounded to bfloat16 (as round_rows_bf16 rounds P)
  auto* q16 = bdot && f32 ? reinterpret_cast<uint16_t*>(buf.take(TQ * D / 2 + 1)) : nullptr;
  auto* rows16 = bdot && f32 ? reinterpret_cast<uint16_t*>(buf.take(TK * D / 2 + 1)) : nullptr;
  auto pack_tile = [&](const Head& hd, const Bf16Operands& h16, int64_t t) {
    if constexpr (kBf16Dot) {  // (the AVX2 build only declares the bfloat16 functions)
      const int64_t j0 = t * TK, nk = imin(TK, p.k_len - j0);
      const uint16_t* k16 = f32 ? rows16 : h16.k + j0 * D;  // float32: the tile rounded
      if (f32) round_rows_bf16(reinterpret_cast<const float*>(hd.k) + j0 * D, D, nk, D, rows16, D);
      pack_pairs_t(k16, nk, D, kt_of(t), TK);
      const uint16_t* v16 = f32 ? rows16 : h16.v + j0 * D;
      if (f32) round_rows_bf16(reinterpret_cast<const float*>(hd.v) + j0 * D, D, nk, D, rows16, D);
      pack_row_pairs(v16, nk, D, v_of(t));
    }
  };
  auto* p_bf = bdot ? reinterpret_cast<uint16_t*>(buf.take(TQ * TK2)) : nullptr;
  auto* band_pk = bdot ? reinterpret_cast<uint32_t*>(buf.take(D2 * max_band + D)) : nullptr;
  auto* w_bf = bdot && p.rel_v ? reinterpret_cast<uint16_t*>(buf.take(TQ * ((max_band + 1) / 2))) : nullptr;
  float* tmp = buf.take(TK * D);
  float* kf = few_q && !f32 && !bdot ? buf.take(TK * D) : nullptr;
  float* s = buf.take(TQ * TK);  // logits, then (in place) probabilities
  float* acc = buf.take(TQ * D);
  float* m = buf.take(TQ);
  float* l = buf.take(TQ);
  float* qe_lo = buf.take(TQ);
  float* qe_hi = buf.take(TQ);
  float* w_lo = buf.take(TQ);
  float* w_hi = buf.take(TQ);
  float* row = buf.take(D);
  float* band_k = buf.take(max_band * D);
  float* band_kt = buf.take(D * max_band);
  float* qe = buf.take(TQ * max_band);
  float* band_v = buf.take(max_band * D);
  BandCache band_k_cache, band_v_cache;  // what band_k / band_kt and band_v hold
  float* w = buf.take(TQ * max_band);
  float* mref = buf.take(TQ * n_ktiles);
  float* ek0 = buf.take(D);
  float* ek1 = buf.take(D);
  float* band_row = p.rel_bias ? buf.take(max_band) : nullptr;  // the bias over a band (bias_band)
  // the key-side table: its rows 0 and 2K, a key tile's ends [2, TK] (lo, then hi) and, over the
  // tile's band (at most TQ + TK - 1 buckets), the table rows as float and KE^T
  const int64_t tile_band = imin(imax(2 * K - 1, 0), TQ + TK - 1);
  float* eq_ends = p.rel_q ? buf.take(2 * D) : nullptr;
  float* kq = p.rel_q ? buf.take(2 * TK) : nullptr;
  float* band_q = p.rel_q && !f32 && !bdot ? buf.take(tile_band * D) : nullptr;
  float* ket = p.rel_q ? buf.take(tile_band * TK) : nullptr;
  const char* cached = nullptr;  // kv head whose tiles [0, built) are in kt_all / v_all
  int64_t built = 0;
  ItemCursor cursor(work);
  const int64_t chunks = split.chunks, chunk_keys = chunks == 1 ? p.k_len : split.chunk_keys;
  for (int64_t item; cursor.next(item);) {
    const int64_t c = item % chunks, qt = (item / chunks) % q_tiles;
    const int64_t h = (item / (chunks * q_tiles)) % p.heads, b = item / (chunks * q_tiles * p.heads);
    const int64_t i0 = qt * TQ, mq = imin(TQ, p.q_len - i0);
    const int64_t kb = c * chunk_keys, ke = imin(p.k_len, kb + chunk_keys);  // this item's keys
    const Head hd = head_of(p, b, h, split.mask_tiles);
    const Bf16Operands h16 = bdot ? head16_of(p, split.bf16, b, h) : Bf16Operands{};
    const uint16_t* q_bf = nullptr;  // the query tile in bfloat16, for the dots
    if (bdot) {
      if constexpr (kBf16Dot) {
        if (f32) round_rows_bf16(reinterpret_cast<const float*>(hd.q) + i0 * D, D, mq, D, q16, D);
        q_bf = f32 ? q16 : h16.q + i0 * D;
      }
    }
    // qs = Q * scale: S, QE and so the logits come out scaled
    scale_copy(float_rows(p.dtype, hd.q + i0 * D * es, mq, D, qf), scale, qs, mq * D);
    const int64_t kt_end = imin(last_key_tile(p, i0 + mq - 1, TK), (ke + TK - 1) / TK);
    const KeySpan seen = seen_keys(p, hd, i0, mq, kb / TK, kt_end, TK);
    const Band band = band_of(p, i0, mq, seen.begin, seen.end);
    if (hd.rel_k) {  // QE = Q @ rel_k[band]^T, and the two clamped buckets per row
      load_row(p.dtype, hd.rel_k, ek0, D);
      load_row(p.dtype, hd.rel_k + (rows_tab - 1) * D * es, ek1, D);
      if (bdot) {  // the band as S: scale (Q rel_k^T)
        table_ends(qs, mq, D, ek0, ek1, qe_lo, qe_hi);
        band_dots(h16.rel_k, D, band, q_bf, D, mq, scale, qe, band_pk);
      } else {
        table_terms(p.dtype, hd.rel_k, D, band, qs, mq, ek0, ek1, qe_lo, qe_hi, qe, band_k, band_kt,
                    band_k_cache);
      }
    }
    if (hd.rel_bias) {  // and the bias, in QE's units
      bias_ends(p.dtype, hd.rel_bias, rows_tab, mq, hd.rel_k != nullptr, qe_lo, qe_hi);
      bias_band(p.dtype, hd.rel_bias, band, mq, hd.rel_k != nullptr, qe, band_row);
    }
    const bool key_term = has_key_term(hd);
    const int64_t ld_qe = key_term_stride(hd, band);
    if (hd.rel_q && !bdot) {  // (the dots read rel_q in place)
      load_row(p.dtype, hd.rel_q, eq_ends, D);
      load_row(p.dtype, hd.rel_q + (rows_tab - 1) * D * es, eq_ends + D, D);
    }
    fill_f32(m, kNegInf, TQ);
    fill_f32(l, 0.f, TQ);
    fill_f32(w_lo, 0.f, TQ);
    fill_f32(w_hi, 0.f, TQ);
    fill_f32(acc, 0.f, mq * D);
    if (hd.rel_v) {
      fill_f32(w, 0.f, mq * band.n);
      fill_f32(mref, kNegInf, mq * n_ktiles);
    }
    if (hd.k != cached) {
      cached = hd.k;
      built = 0;
    }
    if (bdot && !few_q) {
      for (; built < kt_end; ++built) pack_tile(hd, h16, built);
    } else if (built < kt_end && !few_q) {
      build_key_tiles(p.dtype, hd.k, D, TK, 0, p.k_len, built, kt_end, kt_all, nullptr, tmp);
      if (!f32) build_key_tiles(p.dtype, hd.v, D, TK, 0, p.k_len, built, kt_end, nullptr, v_all, tmp);
      built = kt_end;
    }
    for (int64_t t = seen.begin / TK; t * TK < seen.end; ++t) {
      const int64_t j0 = t * TK, nk = imin(TK, p.k_len - j0);
      const TileMask tm = tile_mask(p, hd, i0, mq, j0, nk);
      if (tm == TileMask::kHidden) continue;  // as if every logit were -inf
      const bool clear = tm == TileMask::kClear;
      if (bdot && few_q) pack_tile(hd, h16, t);  // decoding with the dots: this tile's pairs
      // Decoding several rows of a float16/bfloat16 cache: this tile's keys as float once,
      // rather than converted again for every row
      const float* k_tile = nullptr;
      if (few_q && !f32 && !bdot && mq >= kConvertTileRows) {
        load_block(p.dtype, hd.k + j0 * D * es, D, nk, D, kf, D);
        k_tile = kf;
      }
      // y[r * ldy + j] = x_r . k_{j0 + j} for `rows` float rows x against the tile's keys
      auto times_keys = [&](const float* x, int64_t rows, float* y, int64_t ldy) {
        if (few_q && k_tile != nullptr) {
          scores_rows(rows, nk, D, x, k_tile, y, ldy, false);
        } else if (few_q) {
          dispatch(p.dtype, [&](auto tag) {
            const auto* kp = reinterpret_cast<const decltype(tag)*>(hd.k) + j0 * D;
            scores_rows(rows, nk, D, x, kp, y, ldy, stream);
          });
        } else {
          gemm0(rows, nk, D, x, D, kt_all + t * D * TK, TK, y, ldy);
        }
      };
      // the key-side table over this tile: the keys' ends, and KE^T over the tile's band
      Band kband;
      if (hd.rel_q && bdot) {  // the same by dots, from the packed K^T tile
        kband = band_of(p, i0, mq, j0, j0 + nk);
        if constexpr (kBf16Dot) {
          const uint16_t* eq = h16.rel_q;
          const uint32_t* kt = kt_of(t);
          // the ends: rel_q rows 0 and 2K as the two rows of A (lda reaches from one to the other)
          gemm_bf16<false>(2, nk, D2, eq, (rows_tab - 1) * D, kt, TK, kq, TK);
          for_key_strips(p, i0, mq, j0, nk, kband, [&](int64_t s0, int64_t w, int64_t c0, int64_t n) {
            gemm_bf16<false>(n, w, D2, eq + (kband.lo + c0) * D, D, kt + s0, TK, ket + c0 * TK + s0, TK);
          }, kKeTStripDots);
        }
      } else if (hd.rel_q) {
        times_keys(eq_ends, 2, kq, TK);
        kband = band_of(p, i0, mq, j0, j0 + nk);
        const float* bq = kband.n > 0 ? float_rows(p.dtype, hd.rel_q + kband.lo * D * es, kband.n, D, band_q) : nullptr;
        if (kband.n > 0 && !few_q) {
          for_key_strips(p, i0, mq, j0, nk, kband, [&](int64_t s0, int64_t w, int64_t c0, int64_t n) {
            gemm0(n, w, D, bq + c0 * D, D, kt_all + t * D * TK + s0, TK, ket + c0 * TK + s0, TK);
          }, kKeTStrip);
        } else if (kband.n > 0 && k_tile != nullptr) {  // a few rows read few of KE^T's entries
          key_side_dots(p, i0, mq, j0, nk, kband, bq, k_tile, ket, TK);
        } else if (kband.n > 0) {
          dispatch(p.dtype, [&](auto tag) {
            const auto* kp = reinterpret_cast<const decltype(tag)*>(hd.k) + j0 * D;
            key_side_dots(p, i0, mq, j0, nk, kband, bq, kp, ket, TK);
          });
        }
      }
      // S = Q K^T (scaled) for the rows [r0, r0 + rows) of the tile, with the key-side term; a
      // row computed alone comes out bitwise the same (the same products summed in the same
      // order, by the dots or on the tiles)
      auto scores = [&](int64_t r0, int64_t rows) {
        if (bdot) {  // S = scale (Q K^T), Q in its bfloat16
          if constexpr (kBf16Dot) {
            gemm_bf16<false>(rows, nk, D2, q_bf + r0 * D, D, kt_of(t), TK, s + r0 * TK, TK, scale);
          }
        } else {
          times_keys(qs + r0 * D, rows, s + r0 * TK, TK);
        }
        if (hd.rel_q == nullptr) return;
        for (int64_t r = r0; r < r0 + rows; ++r) {
          add_key_side(s + r * TK, j0, nk, split_row(p, i0 + r, j0, nk, kband), scale, kq,
                       kq + TK, ket, TK);
        }
      };
      scores(0, mq);
      // Row r of the tile. overwritten: a one-pass attempt on it went over kStaleMax, leaving
      // its logits to compute again.
      auto row = [&](int64_t r, bool overwritten) {
        const int64_t i = i0 + r;
        float* sr = s + r * TK;
        const RowSplit sp = split_row(p, i, j0, nk, band);
        // single rows under dropout take the general path (the bucket sums need the dropped
        // probabilities); whole uniform tiles apply the mask in exp_sum_rows8_stale
        const bool uni = !drop_on && uniform_row(sp, j0, nk, clear);
        const bool lo_side = sp.a == j0 + nk;  // uniform: all keys in bucket 0 (else 2K)
        const float c = uni && key_term ? (lo_side ? qe_lo[r] : qe_hi[r]) : 0.f;
        float rs;
        if (overwritten) {
          scores(r, 1);
        } else if (clear && !drop_on && m[r] != kNegInf) {
          // the common cases in one pass, against the row's running maximum as it stands: a
          // uniform row, or a band row (keys in several buckets)
          const int64_t vis = visible_keys(p, i, j0, nk);
          const bool done =
              uni ? exp_sum_row_stale(sr, nk, vis, c, m[r], rs)
                  : band_row_stale(sr, j0, nk, vis, sp,
                                   key_term ? BandTerm{qe_lo[r], qe_hi[r], qe + r * ld_qe} : BandTerm{},
                                   m[r], rs);
          if (done) {
            l[r] += rs;
            if (hd.rel_v) {
              if (uni) {
                (lo_side ? w_lo[r] : w_hi[r]) += rs;
              } else {
                add_bucket_mass(sr, j0, nk, sp, w_lo[r], w_hi[r], w + r * band.n);
              }
              mref[r * n_ktiles + t] = m[r];
            }
            return;
          }
          scores(r, 1);  // the row was overwritten: its logits again
        }
        // else (first visible tile of the row, a masked tile or dropout, or a maximum that
        // grew by more than kStaleMax): the maximum of this tile first, then the exponentials
        float mt;
        if (uni) {
          mt = fmax_(m[r], logits_row_uniform(sr, nk, visible_keys(p, i, j0, nk), c));
        } else {
          if (key_term) add_rel_logits(sr, j0, nk, sp, qe_lo[r], qe_hi[r], qe + r * ld_qe);
          mask_logits(p, hd, i, j0, nk, clear, sr);
          mt = fmax_(m[r], max_row(sr, nk));
        }
        if (mt == kNegInf) {  // nothing visible yet in this row
          fill_f32(sr, 0.f, nk);
          return;
        }
        const float alpha = m[r] == mt ? 1.f : (m[r] == kNegInf ? 0.f : std::exp(m[r] - mt));
        if (uni) {
          rs = exp_sum_row(sr, nk, mt);
        } else {
          exp_row(sr, nk, mt);
          rs = sum_row(sr, nk);  // the normaliser is the one without dropout
          if (drop_on) dropout_row(RowDropout(p, b, h, i), j0, sr, nk);
        }
        l[r] = l[r] * alpha + rs;
        if (alpha != 1.f) scale_row(alpha, acc + r * D, D);
        if (hd.rel_v) {
          w_lo[r] *= alpha;
          w_hi[r] *= alpha;
          if (uni) {
            (lo_side ? w_lo[r] : w_hi[r]) += rs;
          } else {
            add_bucket_mass(sr, j0, nk, sp, w_lo[r], w_hi[r], w + r * band.n);
          }
          mref[r * n_ktiles + t] = mt;  // the band entries of this tile are relative to mt
        }
        m[r] = mt;
      };
      // P's rows [r0, r0 + n) rounded to bfloat16 for P V by the dots, while they are in L1
      auto round_p = [&](int64_t r0, int64_t n) {
        if constexpr (kBf16Dot) {
          if (bdot && mq > 1) round_rows_bf16(s + r0 * TK, TK, n, nk, p_bf + r0 * 2 * TK2, 2 * TK2);
        }
      };
      int64_t r = 0;
      // Every row of the tile on one clamped side: 8 rows at a time, in one pass each
      if (const int side = uniform_tile(p, clear, i0, mq, j0, nk); side != 0) {
        const float* c = key_term ? (side == 1 ? qe_lo : qe_hi) : nullptr;
        float* ws = hd.rel_v ? (side == 1 ? w_lo : w_hi) : nullptr;
        for (; r + 8 <= mq; r += 8) {
          // A row's first visible tile: its maximum first (max(s) + c is max(s + c), rounding
          // being monotonic), so that it too takes the one pass below instead of the two of the
          // general path (logits_row_uniform, exp_sum_row). Rows whose maximum is not finite
          // (NaN logits) are left to the general path.
          bool started = true;  // every row has a running maximum
          for (int u = 0; u < 8; ++u) {
            if (m[r + u] == kNegInf) {
              const float mx = max_row(s + (r + u) * TK, nk) + (c != nullptr ? c[r + u] : 0.f);
              if (std::isfinite(mx)) m[r + u] = mx;
            }
            started = started && m[r + u] != kNegInf;
          }
          int over = 0;
          if (started && drop_on) {  // the rows' dropout masks, applied in the same pass
            const RowDropout drops[8] = {
                RowDropout(p, b, h, i0 + r), RowDropout(p, b, h, i0 + r + 1),
                RowDropout(p, b, h, i0 + r + 2), RowDropout(p, b, h, i0 + r + 3),
                RowDropout(p, b, h, i0 + r + 4), RowDropout(p, b, h, i0 + r + 5),
                RowDropout(p, b, h, i0 + r + 6), RowDropout(p, b, h, i0 + r + 7)};
            over = exp_sum_rows8_stale<true>(s + r * TK, TK, nk, c ? c + r : nullptr, m + r, l + r,
                                             ws ? ws + r : nullptr, drops, j0);
          } else if (started) {
            over = exp_sum_rows8_stale(s + r * TK, TK, nk, c ? c + r : nullptr, m + r, l + r,
                                       ws ? ws + r : nullptr);
          }
          for (int u = 0; u < 8; ++u) {
            if (!started || (over >> u & 1) != 0) {
              row(r + u, started);
            } else if (hd.rel_v) {
              mref[(r + u) * n_ktiles + t] = m[r + u];
            }
          }
          round_p(r, 8);
        }
      }
      for (; r < mq; ++r) {
        row(r, false);
        round_p(r, 1);
      }
      // acc += P V
      if (mq == 1) {
        dispatch(p.dtype, [&](auto tag) {
          const auto* vp = reinterpret_cast<const decltype(tag)*>(hd.v) + j0 * D;
          gemv_acc(D, nk, s, 1, vp, D, acc, stream);
        });
      } else if (bdot) {  // P in bfloat16 (round_p), its pairs against the packed V
        if constexpr (kBf16Dot) {
          gemm_bf16<true>(mq, D, (nk + 1) / 2, p_bf, 2 * TK2, v_of(t), D, acc, D);
        }
      } else if (f32) {
        gemm(mq, D, nk, s, TK, reinterpret_cast<const float*>(hd.v) + j0 * D, D, acc, D);
      } else if (few_q) {  // this tile's value rows as float
        load_block(p.dtype, hd.v + j0 * D * es, D, nk, D, tmp, D);
        gemm(mq, D, nk, s, TK, tmp, D, acc, D);
      } else {
        gemm(mq, D, nk, s, TK, v_all + j0 * D, D, acc, D);
      }
    }
    if (hd.rel_v) {  // value term: acc += W @ rel_v[band] + the clamped buckets
      for (int64_t r = 0; r < mq; ++r) {
        if (m[r] == kNegInf || band.n == 0) continue;
        float* wr = w + r * band.n;
        // band column c holds key j = c + base of row i; its weight was taken relative to the
        // running max after that key's tile, so rescale each tile's columns to the final max
        const int64_t base = band.lo - K - p.k_offset + p.q_offset + (i0 + r);
        const int64_t t_lo = imax(base, 0) / TK;
        const int64_t t_hi = imin(base + band.n - 1, p.k_len - 1) / TK;
        for (int64_t t = t_lo; t <= t_hi; ++t) {
          const int64_t c0 = imax(t * TK - base, 0);
          const int64_t c1 = imin((t + 1) * TK - base, band.n);
          const float mt = mref[r * n_ktiles + t];
          scale_row(mt == kNegInf ? 0.f : std::exp(mt - m[r]), wr + c0, c1 - c0);
        }
      }
      if (bdot) {  // W rounded to bfloat16, as P
        band_acc_dots(h16.rel_v, D, band, w, mq, acc, D, w_bf, band_pk);
      } else if (band.n > 0) {
        band_v_cache.load(p.dtype, hd.rel_v, D, band, band_v, nullptr);
        gemm(mq, D, band.n, w, band.n, band_v, D, acc, D);
      }
      load_row(p.dtype, hd.rel_v, ek0, D);
      load_row(p.dtype, hd.rel_v + (rows_tab - 1) * D * es, ek1, D);
      for (int64_t r = 0; r < mq; ++r) {
        axpy(w_lo[r], ek0, acc + r * D, D);
        axpy(w_hi[r], ek1, acc + r * D, D);
      }
    }
    const int64_t row0 = (b * p.heads + h) * p.q_len + i0;
    if (chunks > 1) {  // this chunk's share, merged by rel_attention_combine
      const int64_t off = c * p.batch * p.heads * p.q_len + row0;
      std::memcpy(split.m + off, m, sizeof(float) * mq);
      std::memcpy(split.l + off, l, sizeof(float) * mq);
      std::memcpy(split.acc + off * D, acc, sizeof(float) * mq * D);
      continue;
    }
    float* lse = static_cast<float*>(p.lse) + row0;
    char* out = static_cast<char*>(p.out) + row0 * D * es;
    for (int64_t r = 0; r < mq; ++r) {
      if (m[r] == kNegInf || l[r] == 0.f) {
        fill_f32(row, 0.f, D);
        lse[r] = std::numeric_limits<float>::infinity();
      } else {
        const float inv = 1.f / l[r];
        for (int64_t d = 0; d < D; ++d) row[d] = acc[r * D + d] * inv;
        lse[r] = m[r] + std::log(l[r]);
      }
      store_row(p.dtype, row, out + r * D * es, D);
    }
  }
}

}  // namespace

void rel_attention(const RelAttentionParams& p, const AttentionFwdSplit& split, WorkQueue& work) {
  const FlushDenormals ftz;  // small P and dS (vec_avx2.h)
  const AmxTiles amx(split.amx);  // the bfloat16 dots on AMX tiles
  tl_wide_rows = split.wide_rows;
  if (split.tile == kAttentionWideTile) {
    forward_tiles<kAttentionWideTile, kAttentionWideTile>(p, split, work);
  } else {
    forward_tiles<BQ, BK>(p, split, work);
  }
}

// Work items: (b, h) of batch * heads; only for split.chunks > 1. Per query row, the chunks'
// shares merged in chunk order against their common maximum M: l = sum e^(m_c - M) l_c, the
// same for acc; then out = acc / l and lse = M + ln l, as the unsplit forward writes them.
void rel_attention_combine(const RelAttentionParams& p, const AttentionFwdSplit& split,
                           int64_t begin, int64_t end) {
  const int64_t D = p.dim, es = elem_bytes(p.dtype), rows_all = p.batch * p.heads * p.q_len;
  Buffers buf;
  float* acc = buf.take(D);
  for (int64_t row = begin * p.q_len; row < end * p.q_len; ++row) {
    float mx = kNegInf;
    for (int64_t c = 0; c < split.chunks; ++c) {
      const float mc = split.m[c * rows_all + row];
      if (mc > mx || mc != mc) mx = mc;  // a NaN share makes the row NaN
      if (mx != mx) break;
    }
    float l = 0.f;
    fill_f32(acc, 0.f, D);
    if (mx != kNegInf) {
      for (int64_t c = 0; c < split.chunks; ++c) {
        const float mc = split.m[c * rows_all + row];
        if (mc == kNegInf) continue;  // nothing visible in this chunk
        const float wc = std::exp(mc - mx);
        l += wc * split.l[c * rows_all + row];
        axpy(wc, split.acc + (c * rows_all + row) * D, acc, D);
      }
    }
    float* lse = static_cast<float*>(p.lse) + row;
    if (mx == kNegInf || l == 0.f) {
      fill_f32(acc, 0.f, D);
      *lse = std::numeric_limits<float>::infinity();
    } else {
      scale_row(1.f / l, acc, D);
      *lse = mx + std::log(l);
    }
    store_row(p.dtype, acc, static_cast<char*>(p.out) + row * D * es, D);
  }
}

// ------------------------------------------------------------------------------ backward
// Work items: (b, kv head, key chunk) of batch * kv_heads * split.chunks (kernels.h). An item
// owns dk/dv of its keys (accumulated in float here over the query heads of the group); it
// adds its table gradients into the (b, h) partials and writes dq of its keys' contribution:
// with one chunk straight into dq and bp's partials, with several into the split's per-chunk
// float partials, which rel_attention_backward_reduce then sums in chunk order.
// Within an item, the keys go in runs of about kBwdRunBytes (key and value tiles, key rows, dK
// and dV: 5 x D floats a key): each query head of the group sweeps its query tiles once per run,
// so that what the sweep reads and accumulates stays in the core's L2 cache, and the run's dK
// and dV are complete (and written out) when the group is done with it. Sweeping all of a kv
// head's keys per query tile instead left the two threads waiting on the shared L3: L = 8192,
// B = 1, H = 8, D = 64, K = 64, 2 threads, backward 2240 -> 1770 ms (L = 4096 and 2048 within
// the noise). dq accumulates over the runs in place when it is float (a float32 dq, or the
// split's partials), else in a per-thread float buffer of the group's rows; so a thread's
// scratch is O(run + BQ x band) plus, for float16/bfloat16, O(group x q_len x D).
constexpr int64_t kBwdRunBytes = int64_t(640) << 10;
void rel_attention_backward(const RelAttentionBwdParams& bp, const AttentionBwdSplit& split,
                            WorkQueue& work) {
  const FlushDenormals ftz;  // small P and dS (vec_avx2.h)
  const AmxTiles amx(split.amx);  // the bfloat16 dots on AMX tiles
  tl_wide_rows = split.wide_rows;
  const RelAttentionParams& p = bp.fwd;
  const int64_t D = p.dim, K = p.max_distance, rows_tab = num_buckets(K), es = elem_bytes(p.dtype);
  const int64_t group = p.heads / p.kv_heads, chunks = split.chunks;
  const int64_t chunk_keys = chunks == 1 ? p.k_len : split.chunk_keys;
  const int64_t chunk_tiles = (chunk_keys + BK - 1) / BK;
  const int64_t run_tiles = imin(chunk_tiles, imax(1, kBwdRunBytes / (5 * D * int64_t(sizeof(float)) * BK)));
  const int64_t run_keys = run_tiles * BK;
  const int64_t max_band = imin(imax(2 * K - 1, 0), BQ + chunk_keys);
  const bool f32 = p.dtype == DType::Float32;
  // dq accumulates in place where it is float: bp.dq for float32 with one chunk (zeros on
  // entry), else the split's partials; a float16/bfloat16 dq in a per-thread buffer of the group
  const bool dq_own = chunks == 1 && !f32;
  const float scale = static_cast<float>(p.scale);
  const int64_t gq = group * p.q_len;
  const bool drop_on = p.dropout.on;  // the general row path, with dropout factors
  // A few query rows: S and the key-side term by the forward's dots (scores_rows, dot) rather
  // than the matmuls, so that the logits come out bitwise as the forward's. P = e^(s - lse) is
  // only as good as s matches the s behind the forward's lse: a logit one ulp off, at logits of
  // 1e5, makes P 0.8% off, and at 1e9 (an ulp of 64) inf.
  const bool few_q = p.q_len <= kAttentionFewQueries;  // as the forward's
  Buffers buf;
  float* dk_run = buf.take(run_keys * D);  // dK, dV of the run's keys over the group's heads
  float* dv_run = buf.take(run_keys * D);
  // bfloat16 dots (AttentionBwdSplit::bf16_dot, as the forward's) take packed tiles instead of
  // these float ones, but for the K rows rel_q's clamped buckets take in float32 (drel_q rows 0
  // and 2K += the dS mass per key x K, once per run)
  const bool bdot = kBf16Dot && split.bf16_dot;
  float* kt_run = bdot ? nullptr : buf.take(run_tiles * D * BK);  // the run's key and value tiles, transposed
  float* vt_run = bdot ? nullptr : buf.take(run_tiles * D * BK);
  float* k_rows = f32 || (bdot && !p.rel_q) ? nullptr : buf.take(run_tiles * BK * D);
  float* tmp = buf.take(BK * D);
  float* qf = buf.take(BQ * D);
  float* qs = buf.take(BQ * D);
  float* dof = buf.take(BQ * D);
  float* of = buf.take(BQ * D);
  float* dq_buf = dq_own ? buf.take(gq * D) : nullptr;
  float* s = buf.take(BQ * BK);
  float* dp = buf.take(BQ * BK);
  // bfloat16 dots: the run's K^T, V^T (pairs along D) and K (pairs of rows) packed, the query
  // tile's Q and dO (pairs of rows) and Q^T, dO^T (pairs along the rows), P and dS packed in
  // pairs of rows (pq_pk) and dS rounded as it is (a_bf, for dQ). dV and dK accumulate
  // transposed ([D, run keys]: dV^T += dO^T P, dK^T += Q^T dS), which takes P and dS as they
  // are where dV += P^T dO would transpose them on every tile; the run's sums are transposed
  // back once when it is written (rel_q's float32 parts of dK stay in dk_run and join there).
  const int64_t D2 = D / 2, BQ2 = (BQ + 1) / 2, BK2 = (BK + 1) / 2;
  auto* kt_pk = bdot ? reinterpret_cast<uint32_t*>(buf.take(run_tiles * D2 * BK)) : nullptr;
  auto* vt_pk = bdot ? reinterpret_cast<uint32_t*>(buf.take(run_tiles * D2 * BK)) : nullptr;
  auto* k_pk = bdot ? reinterpret_cast<uint32_t*>(buf.take(run_tiles * BK2 * D)) : nullptr;
  auto* q_pk = bdot ? reinterpret_cast<uint32_t*>(buf.take(BQ2 * D)) : nullptr;
  auto* do_pk = bdot ? reinterpret_cast<uint32_t*>(buf.take(BQ2 * D)) : nullptr;
  auto* qt_pk = bdot ? reinterpret_cast<uint32_t*>(buf.take(D * BQ2)) : nullptr;
  auto* dot_pk = bdot ? reinterpret_cast<uint32_t*>(buf.take(D * BQ2)) : nullptr;
  auto* pq_pk = bdot ? reinterpret_cast<uint32_t*>(buf.take(BQ2 * BK)) : nullptr;
  auto* a_bf = bdot ? reinterpret_cast<uint16_t*>(buf.take(BQ * BK2)) : nullptr;
  float* dkt_run = bdot ? buf.take(D * run_keys) : nullptr;
  float* dvt_run = bdot ? buf.take(D * run_keys) : nullptr;
  // float32 inputs (matmul precision "bf16"): a key tile's K or V rows, the query tile and its
  // dO rounded to bfloat16 (as round_rows_bf16 rounds P and dS)
  auto* rows16 = bdot && f32 ? reinterpret_cast<uint16_t*>(buf.take(BK * D / 2 + 1)) : nullptr;
  auto* q16 = bdot && f32 ? reinterpret_cast<uint16_t*>(buf.take(BQ * D / 2 + 1)) : nullptr;
  auto* do16 = bdot && f32 ? reinterpret_cast<uint16_t*>(buf.take(BQ * D / 2 + 1)) : nullptr;
  // and the tables' band matmuls: the band rows packed, the weights W_ds, W_p rounded as they
  // are (dQ) or transposed (the tables' gradients)
  const int64_t band2 = (max_band + 1) / 2;
  auto* band_pk = bdot ? reinterpret_cast<uint32_t*>(buf.take(D2 * max_band + D)) : nullptr;
  float* band_t = bdot ? buf.take(max_band * BQ) : nullptr;
  auto* band_bf = bdot ? reinterpret_cast<uint16_t*>(buf.take(imax(BQ * band2, max_band * BQ2))) : nullptr;
  // per query row of each head of the group ([group, q_len]): the log-sum-exp,
  // D_i = dO_i . O_i, the clamped buckets' key terms (qe) and value terms (de), and the row sums
  // of dS and P in those buckets over all the runs
  float* lse_all = buf.take(gq);
  float* di_all = buf.take(gq);
  float* qe_lo_all = buf.take(gq);
  float* qe_hi_all = buf.take(gq);
  float* de_lo_all = buf.take(gq);
  float* de_hi_all = buf.take(gq);
  float* ds_lo_all = buf.take(gq);
  float* ds_hi_all = buf.take(gq);
  float* p_lo_all = buf.take(gq);
  float* p_hi_all = buf.take(gq);
  float* band_k = buf.take(max_band * D);
  float* band_kt = buf.take(D * max_band);
  float* band_v = buf.take(max_band * D);
  float* band_vt = buf.take(D * max_band);
  BandCache band_k_cache, band_v_cache;  // what band_k / band_kt and band_v / band_vt hold
  float* qe = buf.take(BQ * max_band);
  float* de = buf.take(BQ * max_band);
  float* wds = buf.take(BQ * max_band);
  float* wp = buf.take(BQ * max_band);
  float* ek0 = buf.take(D);
  float* ek1 = buf.take(D);
  float* ev0 = buf.take(D);
  float* ev1 = buf.take(D);
  // the bias over a band (bias_band), then the sums of dS over it (bias_grad_band)
  float* band_row = p.rel_bias ? buf.take(max_band) : nullptr;
  const float inv_scale = static_cast<float>(1.0 / p.scale);  // drel_bias from the scaled dS
  // the key-side table: its rows 0 and 2K; per key of the run (each [2, run_keys], lo then hi)
  // the ends and the dS mass of the clamped buckets; a tile's band rows as float, KE^T and WK^T
  const int64_t tile_band = imin(imax(2 * K - 1, 0), BQ + BK - 1);
  float* eq_ends = p.rel_q ? buf.take(2 * D) : nullptr;
  float* kq = p.rel_q ? buf.take(2 * run_keys) : nullptr;
  float* dsk = p.rel_q ? buf.take(2 * run_keys) : nullptr;
  float* pq_ends = p.rel_q ? buf.take(2 * D) : nullptr;
  float* band_q = p.rel_q && !f32 && !bdot ? buf.take(tile_band * D) : nullptr;
  float* ket = p.rel_q ? buf.take(tile_band * BK) : nullptr;
  float* wk = p.rel_q ? buf.take(tile_band * BK) : nullptr;
  // and by dots: the tile's rel_q band rows in pairs; WK rounded (pairs along keys, for drel_q)
  // and WK^T (through a float transpose, then rounded: pairs along buckets, for dK)
  const int64_t tb2 = (tile_band + 1) / 2;
  const bool q_dots = bdot && p.rel_q;
  auto* eq_pk = q_dots ? reinterpret_cast<uint32_t*>(buf.take(tb2 * D)) : nullptr;
  auto* wk_bf = q_dots ? reinterpret_cast<uint16_t*>(buf.take(tile_band * BK2)) : nullptr;
  float* wkt = q_dots ? buf.take(BK * tile_band) : nullptr;
  auto* wkt_bf = q_dots ? reinterpret_cast<uint16_t*>(buf.take(BK * tb2)) : nullptr;
  ItemCursor cursor(work);
  for (int64_t item; cursor.next(item);) {
    const int64_t c = item % chunks, hk = (item / chunks) % p.kv_heads;
    const int64_t b = item / (chunks * p.kv_heads);
    const int64_t kb = c * chunk_keys, ke = imin(p.k_len, kb + chunk_keys);
    const int64_t tile0 = kb / BK, tile_end = (ke + BK - 1) / BK;  // kb is a multiple of BK
    const Head hd0 = head_of(p, b, hk * group);
    // where head h's dq and table-gradient partials go
    auto dq_of = [&](int64_t h) -> float* {
      const int64_t bh = b * p.heads + h;
      if (chunks > 1) return split.dq_partial + (c * p.batch * p.heads + bh) * p.q_len * D;
      return dq_own ? dq_buf + (h - hk * group) * p.q_len * D : static_cast<float*>(bp.dq) + bh * p.q_len * D;
    };
    // (b, h)'s share of a gradient partial, n floats per (b, h): bp's with one chunk, else this
    // chunk's in the split's (rel_attention_backward_reduce sums those)
    auto partial_of = [&](int64_t h, void* whole, float* parts, int64_t n) -> float* {
      const int64_t bh = b * p.heads + h;
      if (chunks == 1) return whole ? static_cast<float*>(whole) + bh * n : nullptr;
      return parts ? parts + (c * p.batch * p.heads + bh) * n : nullptr;
    };
    // what depends on the query rows alone, once per head (not once per run)
    for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
      const Head hd = head_of(p, b, h, split.mask_tiles);
      const int64_t bh = b * p.heads + h, g0 = (h - hk * group) * p.q_len;
      if (hd.rel_k) {
        load_row(p.dtype, hd.rel_k, ek0, D);
        load_row(p.dtype, hd.rel_k + (rows_tab - 1) * D * es, ek1, D);
      }
      if (hd.rel_v) {
        load_row(p.dtype, hd.rel_v, ev0, D);
        load_row(p.dtype, hd.rel_v + (rows_tab - 1) * D * es, ev1, D);
      }
      for (int64_t i0 = 0; i0 < p.q_len; i0 += BQ) {
        const int64_t mq = imin(BQ, p.q_len - i0), row0 = bh * p.q_len + i0;
        const float* dop = float_rows(p.dtype, static_cast<const char*>(bp.grad_out) + row0 * D * es, mq, D, dof);
        const float* op = float_rows(p.dtype, static_cast<const char*>(p.out) + row0 * D * es, mq, D, of);
        for (int64_t r = 0; r < mq; ++r) {
          lse_all[g0 + i0 + r] = static_cast<const float*>(p.lse)[row0 + r];
          di_all[g0 + i0 + r] = dot(dop + r * D, op + r * D, D);
        }
        if (hd.rel_k) {
          const float* qp = float_rows(p.dtype, hd.q + i0 * D * es, mq, D, qf);
          scale_copy(qp, scale, qs, mq * D);
          table_ends(qs, mq, D, ek0, ek1, qe_lo_all + g0 + i0, qe_hi_all + g0 + i0);
        }
        if (hd.rel_v) table_ends(dop, mq, D, ev0, ev1, de_lo_all + g0 + i0, de_hi_all + g0 + i0);
      }
      if (hd.rel_bias) {
        bias_ends(p.dtype, hd.rel_bias, rows_tab, p.q_len, hd.rel_k != nullptr, qe_lo_all + g0,
                  qe_hi_all + g0);
      }
      if (dq_own) fill_f32(dq_of(h), 0.f, p.q_len * D);
    }
    fill_f32(ds_lo_all, 0.f, gq);
    fill_f32(ds_hi_all, 0.f, gq);
    fill_f32(p_lo_all, 0.f, gq);
    fill_f32(p_hi_all, 0.f, gq);
    // the item's key tiles in runs [r0, r1): the run's keys transposed once, its dK and dV
    // accumulated over every query tile of every head of the group, then written out
    for (int64_t r0 = tile0; r0 < tile_end; r0 += run_tiles) {
      const int64_t r1 = imin(r0 + run_tiles, tile_end);
      const int64_t rb = r0 * BK, re = imin(r1 * BK, ke), nrun = re - rb;  // the run's keys
      if (bdot) {
        if constexpr (kBf16Dot) {
          const Bf16Operands h16 = head16_of(p, split.bf16, b, hk * group);
          for (int64_t t = r0; t < r1; ++t) {
            const int64_t j0 = t * BK, nk = imin(BK, p.k_len - j0), tl = t - r0;
            const uint16_t* k16 = f32 ? rows16 : h16.k + j0 * D;  // float32: the tile rounded
            if (f32) round_rows_bf16(reinterpret_cast<const float*>(hd0.k) + j0 * D, D, nk, D, rows16, D);
            pack_pairs_t(k16, nk, D, kt_pk + tl * D2 * BK, BK);
            pack_row_pairs(k16, nk, D, k_pk + tl * BK2 * D);
            const uint16_t* v16 = f32 ? rows16 : h16.v + j0 * D;
            if (f32) round_rows_bf16(reinterpret_cast<const float*>(hd0.v) + j0 * D, D, nk, D, rows16, D);
            pack_pairs_t(v16, nk, D, vt_pk + tl * D2 * BK, BK);
          }
        }
        if (k_rows != nullptr) build_key_tiles(p.dtype, hd0.k, D, BK, rb, re, 0, r1 - r0, nullptr, k_rows, tmp);
      } else {
        build_key_tiles(p.dtype, hd0.k, D, BK, rb, re, 0, r1 - r0, kt_run, k_rows, tmp);
        build_key_tiles(p.dtype, hd0.v, D, BK, rb, re, 0, r1 - r0, vt_run, nullptr, tmp);
      }
      const float* kp = f32 ? reinterpret_cast<const float*>(hd0.k) + rb * D : k_rows;
      fill_f32(dk_run, 0.f, nrun * D);
      if (bdot) {
        fill_f32(dkt_run, 0.f, D * run_keys);
        fill_f32(dvt_run, 0.f, D * run_keys);
      } else {
        fill_f32(dv_run, 0.f, nrun * D);
      }
      for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
        const Head hd = head_of(p, b, h, split.mask_tiles);
        const Bf16Operands h16 = bdot ? head16_of(p, split.bf16, b, h) : Bf16Operands{};
        const int64_t bh = b * p.heads + h, g0 = (h - hk * group) * p.q_len;
        float* pk = partial_of(h, bp.drel_k_partial, split.drel_k_partial, rows_tab * D);
        float* pv = partial_of(h, bp.drel_v_partial, split.drel_v_partial, rows_tab * D);
        float* pb = partial_of(h, bp.drel_bias_partial, split.drel_bias_partial, rows_tab);
        float* pq = partial_of(h, bp.drel_q_partial, split.drel_q_partial, rows_tab * D);
        float* dq_h = dq_of(h);
        const bool key_term = has_key_term(hd);  // then dS is summed per bucket (wds, ds_lo / hi)
        if (hd.rel_q) {  // the run's ends, k_j . rel_q[0] and k_j . rel_q[2K]
          load_row(p.dtype, hd.rel_q, eq_ends, D);
          load_row(p.dtype, hd.rel_q + (rows_tab - 1) * D * es, eq_ends + D, D);
          for (int64_t t = r0; t < r1; ++t) {
            const int64_t j0 = t * BK, nk = imin(BK, p.k_len - j0);
            if (bdot) {
              if constexpr (kBf16Dot) {  // (rows 0 and 2K as A's two rows, as in the forward)
                gemm_bf16<false>(2, nk, D2, h16.rel_q, (rows_tab - 1) * D,
                                 kt_pk + (t - r0) * D2 * BK, BK, kq + (j0 - rb), run_keys);
              }
            } else if (few_q) {
              dispatch(p.dtype, [&](auto tag) {
                const auto* kt = reinterpret_cast<const decltype(tag)*>(hd0.k) + j0 * D;
                scores_rows(2, nk, D, eq_ends, kt, kq + (j0 - rb), run_keys, false);
              });
            } else {
              gemm0(2, nk, D, eq_ends, D, kt_run + (t - r0) * D * BK, BK, kq + (j0 - rb), run_keys);
            }
          }
          fill_f32(dsk, 0.f, 2 * run_keys);
        }
        for (int64_t i0 = 0; i0 < p.q_len; i0 += BQ) {
          const int64_t mq = imin(BQ, p.q_len - i0);
          const int64_t row0 = bh * p.q_len + i0;
          // key tiles of this run visible from the query tile: [r0, t_end)
          const int64_t t_end = imin(last_key_tile(p, i0 + mq - 1, BK), r1);
          const KeySpan seen = seen_keys(p, hd, i0, mq, r0, t_end, BK);
          if (seen.end <= seen.begin) continue;  // every tile hidden: P = dS = 0
          const float* qp = float_rows(p.dtype, hd.q + i0 * D * es, mq, D, qf);
          const float* dop = float_rows(p.dtype, static_cast<const char*>(bp.grad_out) + row0 * D * es, mq, D, dof);
          // as in the forward, S and QE come from qs = Q * scale
          scale_copy(qp, scale, qs, mq * D);
          const uint16_t* q_bf = nullptr;
          const uint16_t* do_bf = nullptr;
          if (bdot) {
            if constexpr (kBf16Dot) {
              if (f32) {  // float32 inputs: the query tile and its dO rounded
                round_rows_bf16(qp, D, mq, D, q16, D);
                round_rows_bf16(dop, D, mq, D, do16, D);
              }
              q_bf = f32 ? q16 : h16.q + i0 * D;
              do_bf = f32 ? do16 : split.bf16.grad_out + row0 * D;
              pack_row_pairs(q_bf, mq, D, q_pk);
              pack_row_pairs(do_bf, mq, D, do_pk);
              const int64_t mq2 = (mq + 1) / 2;  // the pair words transposed: Q^T, dO^T
              transpose(reinterpret_cast<const float*>(q_pk), D, mq2, D, reinterpret_cast<float*>(qt_pk), BQ2);
              transpose(reinterpret_cast<const float*>(do_pk), D, mq2, D, reinterpret_cast<float*>(dot_pk), BQ2);
            }
          }
          const float* lse = lse_all + g0 + i0;
          const float* di = di_all + g0 + i0;
          const float* qe_lo = qe_lo_all + g0 + i0;
          const float* qe_hi = qe_hi_all + g0 + i0;
          const float* de_lo = de_lo_all + g0 + i0;
          const float* de_hi = de_hi_all + g0 + i0;
          float* ds_lo = ds_lo_all + g0 + i0;
          float* ds_hi = ds_hi_all + g0 + i0;
          float* p_lo = p_lo_all + g0 + i0;
          float* p_hi = p_hi_all + g0 + i0;
          // the band of inside buckets this run's keys reach from the query tile (those it sees)
          const Band band = band_of(p, i0, mq, seen.begin, seen.end);
          // QE = Q @ rel_k^T over the band (by dots as S), and the bias in its units
          if (hd.rel_k && bdot) {
            band_dots(h16.rel_k, D, band, q_bf, D, mq, scale, qe, band_pk);
          } else if (hd.rel_k) {
            table_band(p.dtype, hd.rel_k, D, band, qs, mq, qe, band_k, band_kt, band_k_cache);
          }
          if (hd.rel_bias) bias_band(p.dtype, hd.rel_bias, band, mq, hd.rel_k != nullptr, qe, band_row);
          const int64_t ld_qe = key_term_stride(hd, band);  // and of wds
          if (key_term) fill_f32(wds, 0.f, key_term_rows(hd, mq) * band.n);
          if (hd.rel_v) {  // dO @ rel_v^T: the value term's part of dP
            if (bdot) {
              band_dots(h16.rel_v, D, band, do_bf, D, mq, 1.f, de, band_pk);
            } else {
              table_band(p.dtype, hd.rel_v, D, band, dop, mq, de, band_v, band_vt, band_v_cache);
            }
            fill_f32(wp, 0.f, mq * band.n);
          }
          float* dq = dq_h + i0 * D;
          for (int64_t t = seen.begin / BK; t * BK < seen.end; ++t) {
            const int64_t j0 = t * BK, nk = imin(BK, p.k_len - j0), tl = t - r0;
            const TileMask tm = tile_mask(p, hd, i0, mq, j0, nk);
            if (tm == TileMask::kHidden) continue;  // P = dS = 0 on the whole tile
            const bool clear = tm == TileMask::kClear;
            if (bdot) {
              if constexpr (kBf16Dot) {
                gemm_bf16<false>(mq, nk, D2, q_bf, D, kt_pk + tl * D2 * BK, BK, s, BK, scale);
                gemm_bf16<false>(mq, nk, D2, do_bf, D, vt_pk + tl * D2 * BK, BK, dp, BK);
              }
            } else {
              if (few_q) {  // S = Q K^T (scaled) by the forward's dots
                dispatch(p.dtype, [&](auto tag) {
                  const auto* kt = reinterpret_cast<const decltype(tag)*>(hd0.k) + j0 * D;
                  scores_rows(mq, nk, D, qs, kt, s, BK, false);
                });
              } else {
                gemm0(mq, nk, D, qs, D, kt_run + tl * D * BK, BK, s, BK);  // S = Q K^T (scaled)
              }
              gemm0(mq, nk, D, dop, D, vt_run + tl * D * BK, BK, dp, BK);  // dP = dO V^T
            }
            // the key-side term joins S as in the forward (KE^T over the tile's band)
            Band kband;
            const float* bq = nullptr;  // rel_q[kband] as float
            if (hd.rel_q) {
              kband = band_of(p, i0, mq, j0, j0 + nk);
              if (kband.n > 0) {
                if (bdot) {
                  if constexpr (kBf16Dot) pack_row_pairs(h16.rel_q + kband.lo * D, kband.n, D, eq_pk);
                } else {
                  bq = float_rows(p.dtype, hd.rel_q + kband.lo * D * es, kband.n, D, band_q);
                }
                if (few_q && !bdot) {  // the entries the rows read, by dots as in the forward
                  dispatch(p.dtype, [&](auto tag) {
                    const auto* kt = reinterpret_cast<const decltype(tag)*>(hd0.k) + j0 * D;
                    key_side_dots(p, i0, mq, j0, nk, kband, bq, kt, ket, BK);
                  });
                } else {
                  for_key_strips(p, i0, mq, j0, nk, kband, [&](int64_t s0, int64_t w, int64_t c0,
                                                               int64_t n) {
                    if (bdot) {
                      if constexpr (kBf16Dot) {
                        gemm_bf16<false>(n, w, D2, h16.rel_q + (kband.lo + c0) * D, D,
                                         kt_pk + tl * D2 * BK + s0, BK, ket + c0 * BK + s0, BK);
                      }
                    } else {
                      gemm0(n, w, D, bq + c0 * D, D, kt_run + tl * D * BK + s0, BK,
                            ket + c0 * BK + s0, BK);
                    }
                  }, bdot ? kKeTStripDots : kKeTStrip);
                }
                fill_f32(wk, 0.f, kband.n * BK);
              }
              for (int64_t r = 0; r < mq; ++r) {
                add_key_side(s + r * BK, j0, nk, split_row(p, i0 + r, j0, nk, kband), scale,
                             kq + (j0 - rb), kq + run_keys + (j0 - rb), ket, BK);
              }
            }
            // every row of the tile on one clamped side: 8 rows at a time, as in the forward
            int64_t r = 0;
            if (const int side = uniform_tile(p, clear, i0, mq, j0, nk); side != 0) {
              const bool lo_side = side == 1;
              for (; r + 8 <= mq; r += 8) {
                const float* ck = key_term ? (lo_side ? qe_lo : qe_hi) + r : nullptr;
                const float* cv = hd.rel_v ? (lo_side ? de_lo : de_hi) + r : nullptr;
                float* ps = hd.rel_v ? (lo_side ? p_lo : p_hi) + r : nullptr;
                float* dss = key_term ? (lo_side ? ds_lo : ds_hi) + r : nullptr;
                if (drop_on) {  // the rows' dropout masks, applied in the same pass
                  const int64_t i = i0 + r;
                  const RowDropout drops[8] = {
                      RowDropout(p, b, h, i), RowDropout(p, b, h, i + 1), RowDropout(p, b, h, i + 2),
                      RowDropout(p, b, h, i + 3), RowDropout(p, b, h, i + 4),
                      RowDropout(p, b, h, i + 5), RowDropout(p, b, h, i + 6),
                      RowDropout(p, b, h, i + 7)};
                  grad_rows8_uniform<true>(s + r * BK, dp + r * BK, nk, ck, cv, scale, lse + r,
                                           di + r, ps, dss, drops, j0);
                } else {
                  grad_rows8_uniform(s + r * BK, dp + r * BK, nk, ck, cv, scale, lse + r, di + r,
                                     ps, dss);
                }
              }
            }
            for (; r < mq; ++r) {
              const int64_t i = i0 + r;
              float* sr = s + r * BK;
              float* dpr = dp + r * BK;
              const RowSplit sp = split_row(p, i, j0, nk, band);
              if (!drop_on && uniform_row(sp, j0, nk, clear)) {
                const bool lo_side = sp.a == j0 + nk;
                const float ck = key_term ? (lo_side ? qe_lo[r] : qe_hi[r]) : 0.f;
                const float cv = hd.rel_v ? (lo_side ? de_lo[r] : de_hi[r]) : 0.f;
                float ps = 0.f, dss = 0.f;
                grad_row_uniform(sr, dpr, nk, visible_keys(p, i, j0, nk), ck, cv, scale, lse[r], di[r], ps, dss);
                if (hd.rel_v) (lo_side ? p_lo[r] : p_hi[r]) += ps;
                if (key_term) (lo_side ? ds_lo[r] : ds_hi[r]) += dss;
                continue;
              }
              if (clear && !drop_on) {  // a band row, in one pass
                BandTerm tk, tv;
                BandMass pm, dm;
                if (key_term) {
                  tk = {qe_lo[r], qe_hi[r], qe + r * ld_qe};
                  dm = {ds_lo + r, ds_hi + r, wds + r * ld_qe};
                }
                if (hd.rel_v) {
                  tv = {de_lo[r], de_hi[r], de + r * band.n};
                  pm = {p_lo + r, p_hi + r, wp + r * band.n};
                }
                grad_band_row(sr, dpr, j0, nk, visible_keys(p, i, j0, nk), sp, tk, tv, scale,
                              lse[r], di[r], pm, dm);
                continue;
              }
              // else (a masked tile, or dropout): the terms, the mask, P, dS and the sums apart
              if (key_term) add_rel_logits(sr, j0, nk, sp, qe_lo[r], qe_hi[r], qe + r * ld_qe);
              if (hd.rel_v) add_rel_logits(dpr, j0, nk, sp, de_lo[r], de_hi[r], de + r * band.n);
              mask_logits(p, hd, i, j0, nk, clear, sr);  // P = e^(S - lse)
              exp_row(sr, nk, lse[r]);
              if (drop_on) {  // dS = scale P (f dP - D_i), then P *= f
                softmax_grad_row_dropout(RowDropout(p, b, h, i), j0, sr, dpr, nk, di[r], scale);
              } else {
                softmax_grad_row(sr, dpr, nk, di[r], scale);  // dS = scale P (dP - D_i)
              }
              if (hd.rel_v) add_bucket_mass(sr, j0, nk, sp, p_lo[r], p_hi[r], wp + r * band.n);
              if (key_term) add_bucket_mass(dpr, j0, nk, sp, ds_lo[r], ds_hi[r], wds + r * ld_qe);
            }
            float* dv_t = dv_run + (j0 - rb) * D;
            float* dk_t = dk_run + (j0 - rb) * D;
            if (bdot) {  // the same three by bfloat16 dots
              if constexpr (kBf16Dot) {
                const int64_t mq2 = (mq + 1) / 2;
                round_pack_pairs(s, BK, mq, nk, pq_pk, BK);  // dV^T += dO^T P
                gemm_bf16<true>(D, nk, mq2, reinterpret_cast<const uint16_t*>(dot_pk), 2 * BQ2, pq_pk, BK,
                                dvt_run + (j0 - rb), run_keys);
                round_pack_pairs(dp, BK, mq, nk, pq_pk, BK);  // dK^T += Q^T dS
                gemm_bf16<true>(D, nk, mq2, reinterpret_cast<const uint16_t*>(qt_pk), 2 * BQ2, pq_pk, BK,
                                dkt_run + (j0 - rb), run_keys);
                round_rows_bf16(dp, BK, mq, nk, a_bf, 2 * BK2);
                gemm_bf16<true>(mq, D, (nk + 1) / 2, a_bf, 2 * BK2, k_pk + tl * BK2 * D, D, dq, D);
              }
            } else {
              gemm_at(nk, D, mq, s, BK, dop, D, dv_t, D);          // dV += P^T dO
              gemm_at(nk, D, mq, dp, BK, qp, D, dk_t, D);          // dK += dS^T Q
              gemm(mq, D, nk, dp, BK, kp + (j0 - rb) * D, D, dq, D);  // dQ += dS K
            }
            if (hd.rel_q) {  // the key-side term's dS: per key in the clamped buckets, WK^T inside
              for (int64_t r = 0; r < mq; ++r) {
                key_side_grad(dp + r * BK, j0, nk, split_row(p, i0 + r, j0, nk, kband),
                              dsk + (j0 - rb), dsk + run_keys + (j0 - rb), wk);
              }
              // dK += WK rel_q[band]; drel_q[band] += WK^T K
              if (bdot && kband.n > 0) {
                if constexpr (kBf16Dot) {
                  // WK^T's rows (keys) against the band's row pairs: a strip's first bucket rounded
                  // down to a pair's, the bucket before it zero in WK (outside the strip's buckets)
                  transpose(wk, BK, kband.n, nk, wkt, tile_band);
                  round_rows_bf16(wkt, tile_band, nk, kband.n, wkt_bf, 2 * tb2);
                  if (pq != nullptr) round_rows_bf16(wk, BK, kband.n, nk, wk_bf, 2 * BK2);
                  const uint32_t* kpk = k_pk + tl * BK2 * D;
                  for_key_strips(p, i0, mq, j0, nk, kband, [&](int64_t s0, int64_t w, int64_t c0, int64_t n) {
                    const int64_t ca = c0 & ~int64_t(1);
                    gemm_bf16<true>(w, D, (c0 + n - ca + 1) / 2, wkt_bf + s0 * 2 * tb2 + ca, 2 * tb2,
                                    eq_pk + (ca / 2) * D, D, dk_t + s0 * D, D);
                    if (pq != nullptr) {  // (s0 is even: strips of kKeyStrip keys)
                      gemm_bf16<true>(n, D, (w + 1) / 2, wk_bf + c0 * 2 * BK2 + s0, 2 * BK2,
                                      kpk + (s0 / 2) * D, D, pq + (kband.lo + c0) * D, D);
                    }
                  });
                }
              } else if (!bdot) {  // float32 matmuls (the dots with no band here: nothing to add)
                for_key_strips(p, i0, mq, j0, nk, kband, [&](int64_t s0, int64_t w, int64_t c0, int64_t n) {
                  const float* wks = wk + c0 * BK + s0;
                  gemm_at(w, D, n, wks, BK, bq + c0 * D, D, dk_t + s0 * D, D);
                  if (pq != nullptr) gemm(n, D, w, wks, BK, kp + (j0 - rb + s0) * D, D, pq + (kband.lo + c0) * D, D);
                });
              }
            }
          }
          if (hd.rel_k && band.n > 0 && bdot) {  // the same two (and the next) by dots
            band_acc_dots(h16.rel_k, D, band, wds, mq, dq, D, band_bf, band_pk);
            band_grad_dots(wds, band.n, mq, band.n, q_pk, D, pk + band.lo * D, band_t, BQ, band_bf);
          } else if (hd.rel_k && band.n > 0) {  // dQ += W_ds @ rel_k; drel_k += W_ds^T Q over the band
            gemm(mq, D, band.n, wds, band.n, band_k, D, dq, D);
            gemm_at(band.n, D, mq, wds, band.n, qp, D, pk + band.lo * D, D);
          }
          if (hd.rel_v && band.n > 0 && bdot) {
            band_grad_dots(wp, band.n, mq, band.n, do_pk, D, pv + band.lo * D, band_t, BQ, band_bf);
          } else if (hd.rel_v && band.n > 0) {  // drel_v += W_p^T dO over the band
            gemm_at(band.n, D, mq, wp, band.n, dop, D, pv + band.lo * D, D);
          }
          if (pb != nullptr) bias_grad_band(wds, key_term_rows(hd, mq), band, inv_scale, band_row, pb);
        }
        if (hd.rel_q) {  // the clamped buckets' dS mass per key of the run, over the head's rows:
          // dK += the mass x rel_q rows 0 / 2K; drel_q rows 0 / 2K += the mass x K
          gemm_at(nrun, D, 2, dsk, run_keys, eq_ends, D, dk_run, D);
          if (pq != nullptr) {
            gemm0(2, D, nrun, dsk, run_keys, kp, D, pq_ends, D);
            add_row(pq_ends, pq, D);
            add_row(pq_ends + D, pq + (rows_tab - 1) * D, D);
          }
        }
      }
      if (bdot) {  // the dots' dK^T and dV^T back to rows (dK: onto rel_q's parts in dk_run)
        transpose(dkt_run, run_keys, D, nrun, dv_run, D);
        add_row(dv_run, dk_run, nrun * D);
        transpose(dvt_run, run_keys, D, nrun, dv_run, D);
      }
      const int64_t kv_off = ((b * p.kv_heads + hk) * p.k_len + rb) * D * es;
      for (int64_t j = 0; j < nrun; ++j) {
        store_row(p.dtype, dk_run + j * D, static_cast<char*>(bp.dk) + kv_off + j * D * es, D);
        store_row(p.dtype, dv_run + j * D, static_cast<char*>(bp.dv) + kv_off + j * D * es, D);
      }
    }
    // the clamped buckets, over all the runs: dQ += dS sums x rel_k rows 0 / 2K, drel_k rows
    // 0 / 2K += dS sums x Q, drel_v rows 0 / 2K += P sums x dO (rows without any: skipped),
    // drel_bias[0 / 2K] += the dS sums over the rows / scale
    for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
      const Head hd = head_of(p, b, h, split.mask_tiles);
      const int64_t bh = b * p.heads + h, g0 = (h - hk * group) * p.q_len;
      float* pk = partial_of(h, bp.drel_k_partial, split.drel_k_partial, rows_tab * D);
      float* pv = partial_of(h, bp.drel_v_partial, split.drel_v_partial, rows_tab * D);
      float* dq_h = dq_of(h);
      if (float* pb = partial_of(h, bp.drel_bias_partial, split.drel_bias_partial, rows_tab); pb != nullptr) {
        pb[0] += inv_scale * sum_row(ds_lo_all + g0, p.q_len);
        pb[rows_tab - 1] += inv_scale * sum_row(ds_hi_all + g0, p.q_len);
      }
      if (hd.rel_k) {
        load_row(p.dtype, hd.rel_k, ek0, D);
        load_row(p.dtype, hd.rel_k + (rows_tab - 1) * D * es, ek1, D);
      }
      for (int64_t i0 = 0; i0 < p.q_len && (hd.rel_k || hd.rel_v); i0 += BQ) {
        const int64_t mq = imin(BQ, p.q_len - i0), row0 = bh * p.q_len + i0;
        if (hd.rel_k) {
          const float* qp = float_rows(p.dtype, hd.q + i0 * D * es, mq, D, qf);
          for (int64_t i = i0; i < i0 + mq; ++i) {
            const float* qr = qp + (i - i0) * D;
            const float lo = ds_lo_all[g0 + i], hi = ds_hi_all[g0 + i];
            if (lo != 0.f) {
              axpy(lo, ek0, dq_h + i * D, D);
              axpy(lo, qr, pk, D);
            }
            if (hi != 0.f) {
              axpy(hi, ek1, dq_h + i * D, D);
              axpy(hi, qr, pk + (rows_tab - 1) * D, D);
            }
          }
        }
        if (hd.rel_v) {
          const float* dop = float_rows(p.dtype, static_cast<const char*>(bp.grad_out) + row0 * D * es, mq, D, dof);
          for (int64_t i = i0; i < i0 + mq; ++i) {
            const float lo = p_lo_all[g0 + i], hi = p_hi_all[g0 + i];
            if (lo != 0.f) axpy(lo, dop + (i - i0) * D, pv, D);
            if (hi != 0.f) axpy(hi, dop + (i - i0) * D, pv + (rows_tab - 1) * D, D);
          }
        }
      }
      if (dq_own) {
        char* dq_out = static_cast<char*>(bp.dq) + bh * p.q_len * D * es;
        for (int64_t i = 0; i < p.q_len; ++i) store_row(p.dtype, dq_h + i * D, dq_out + i * D * es, D);
      }
    }
  }
}

// Work items: (b, h) of batch * heads; only for split.chunks > 1. dq = the chunks' partials
// summed in chunk order; the (b, h) table partials likewise.
void rel_attention_backward_reduce(const RelAttentionBwdParams& bp, const AttentionBwdSplit& split,
                                   int64_t begin, int64_t end) {
  const RelAttentionParams& p = bp.fwd;
  const int64_t D = p.dim, rows_tab = num_buckets(p.max_distance), es = elem_bytes(p.dtype);
  const int64_t bh_total = p.batch * p.heads;
  Buffers buf;
  float* row = buf.take(D);
  for (int64_t bh = begin; bh < end; ++bh) {
    for (int64_t i = 0; i < p.q_len; ++i) {
      const int64_t r = bh * p.q_len + i;
      std::memcpy(row, split.dq_partial + r * D, sizeof(float) * D);
      for (int64_t c = 1; c < split.chunks; ++c) add_row(split.dq_partial + (c * bh_total * p.q_len + r) * D, row, D);
      store_row(p.dtype, row, static_cast<char*>(bp.dq) + r * D * es, D);
    }
    auto reduce = [&](float* partials, void* out, int64_t n) {  // n floats per (b, h)
      if (partials == nullptr || out == nullptr) return;
      float* o = static_cast<float*>(out) + bh * n;
      for (int64_t c = 0; c < split.chunks; ++c) add_row(partials + (c * bh_total + bh) * n, o, n);
    };
    reduce(split.drel_k_partial, bp.drel_k_partial, rows_tab * D);
    reduce(split.drel_v_partial, bp.drel_v_partial, rows_tab * D);
    reduce(split.drel_bias_partial, bp.drel_bias_partial, rows_tab);
    reduce(split.drel_q_partial, bp.drel_q_partial, rows_tab * D);
  }
}

// Items (mask slab, query tile): the class of each of the tile's key tiles (kernels.h).
void attn_mask_tiles(const RelAttentionParams& p, const AttnMaskTiles& t, int64_t begin,
                     int64_t end) {
  for (int64_t item = begin; item < end; ++item) {
    const int64_t slab = item / t.q_tiles, i0 = (item % t.q_tiles) * BQ;
    const int64_t mq = imin(BQ, p.q_len - i0);
    const bool* rows = p.attn_mask + slab * p.q_len * p.k_len + i0 * p.k_len;
    for (int64_t kt = 0; kt < t.k_tiles; ++kt) {
      const int64_t j0 = kt * BK, nk = imin(BK, p.k_len - j0);
      int kinds = 0;
      for (int64_t r = 0; r < mq && kinds != 3; ++r) kinds |= bool_kinds(rows + r * p.k_len + j0, nk);
      t.cls[item * t.k_tiles + kt] = (kinds & 1) == 0 ? kTileHidden : (kinds & 2) != 0 ? kTileMixed : kTileClear;
    }
  }
}

}  // namespace relpos::cpu::RELPOS_ISA
