// CPU kernels: one function per op and ISA, each computing a range [begin, end) of independent
// work items so the caller can split them with parallel_for (parallel.h; the AVX2 attention
// kernels take theirs from a WorkQueue). The work items:
//   rel_gather            rows (h, i)            of heads * q_len
//   rel_gather_backward   (h, 16-wide d block)   of heads * ceil(dim / 16)   (deterministic)
//   skew, skew_backward   rows (n, i)            of batch * q_len
//   rel_logits            rows (b, h, i)         of batch * heads * q_len
//   bucket_sum            rows (b, h, i)         of batch * heads * q_len
//   rope                  rows of x              of n0 * n1 * n2
// scalar:: handles every dtype (float64 included) and any CPU; avx2:: handles float32, float16
// and bfloat16 (float32 arithmetic) and lives in *_avx2.cpp, compiled with -mavx2 -mfma -mf16c,
// which therefore include no torch headers.
#pragma once

#include <atomic>
#include <cstdint>

#include "common/params.h"

namespace relpos::cpu {

constexpr int64_t kGatherBwdDBlock = 16;

inline int64_t gather_bwd_items(const RelGatherBwdParams& p) {
  return p.heads * ((p.dim + kGatherBwdDBlock - 1) / kGatherBwdDBlock);
}

constexpr int64_t kAttentionTileQ = 64;
constexpr int64_t kAttentionTileK = 64;
// The AVX2 forward's query rows and keys per tile when nothing in the call hides keys tile by
// tile (no attention mask, segment ids, window or padding) and it is not decoding: a 128 x 128
// tile halves the passes over each key and value tile and the per-tile work of each row. B = 1,
// H = 8, D = 64, K = 64, 2 threads, 3 alternating runs: L = 2048 AVX-512 forward 37.0-37.9 ->
// 35.9-36.1 ms (and one noisy run at 40.0), AVX2 65.3-66.7 -> 63.7-65.2 ms; L = 4096
// 144-146 -> 135-137 and 252-257 -> 244-249 ms; causal, L <= 1024: within the noise. Masks and
// windows skip whole tiles and are better off with the small ones (a window of 128 on either
// side ran 3-15% slower with wide tiles); the backward keeps BQ x BK (no gain with 128).
constexpr int64_t kAttentionWideTile = 128;
// The AVX2 forward scores up to this many query rows (decoding) from the key rows in place
// instead of transposed key tiles (at L = 4096 it was faster up to 32 rows and even at 64).
constexpr int64_t kAttentionFewQueries = 32;
// bfloat16 dots (AttentionFwdSplit::bf16_dot) from this many query rows on, decoding included:
// B = 1, H = 8, D = 64, K = 64, 1k-16k keys, 2 threads, forward over the float32 path's, 2 rows
// 1.04-1.11x, 4-8 rows 1.23-1.40x, 16-32 rows 1.39-1.68x (benchmarks/bench_bf16.py --lq; one
// call after another of the same kind, 1.3-1.9x from 4 rows); a single row 1.2-1.5x slower
// (its scores read each key once, in place, where the dots would first pack them)
constexpr int64_t kAttentionDotMinRows = 2;
// Where only decoding takes the dots (cpu/isa.h bf16_dot_decode_only): calls of at most
// kAttentionFewQueries query rows against at least this many keys.
constexpr int64_t kAttentionDotDecodeMinKeys = 256;
// ... and on AMX tiles (AttentionFwdSplit / AttentionBwdSplit::amx) from this many query rows
// on: a product of fewer rows pads them to the tile's 16, where the dots take only the rows
// there are. bfloat16, B = 1, H = 8, D = 64, K = 64, 4k and 16k keys, 2 threads, the tiles over
// the dots: 1 row (backward only; the forward keeps float32) 0.92x and 0.81x forward+backward,
// 4 rows 0.94-0.95x forward and 0.92-0.96x forward+backward, 8 rows 1.11-1.34x and 1.02-1.11x,
// 16-32 rows 1.76-2.45x and 1.24-1.61x (benchmarks/bench_bf16.py --lq, 11 rounds). Decided per
// call from q_len, so both passes compute every logit alike.
constexpr int64_t kAttentionAmxMinRows = 8;

// What the attention mask does to each (query tile, key tile) of kAttentionTileQ x
// kAttentionTileK, per mask slab (a [q_len, k_len] matrix of the contiguous [B or 1, H or 1,
// q_len, k_len] mask): kTileClear (every pair visible), kTileMixed or kTileHidden (none
// visible). Computed once per call by avx2::attn_mask_tiles, so that the kernels do not read
// the mask bytes of every tile again for every head sharing the slab and in every pass.
enum : uint8_t { kTileClear = 0, kTileMixed = 1, kTileHidden = 2 };
struct AttnMaskTiles {
  uint8_t* cls = nullptr;  // [slabs, q_tiles, k_tiles]; null when there is no attention mask
  int64_t slabs = 0, q_tiles = 0, k_tiles = 0;
};

// What the bfloat16 dots read (AttentionFwdSplit / AttentionBwdSplit::bf16_dot): the call's
// q, k, v, tables and (backward) grad_out as bfloat16, laid out as the params' (k and v in slabs
// of kv_stride elements). For bfloat16 inputs, the inputs themselves. For float32 inputs under
// torch's float32 matmul precision "bf16" (register_cpu.cpp), the tables rounded to bfloat16
// and null q, k, v and grad_out: the kernels round those a tile at a time, while everything
// else (the softmax, the clamped buckets, the outputs) reads and writes the float32 tensors.
// Null where the call has no such input.
struct Bf16Operands {
  const uint16_t* q = nullptr;
  const uint16_t* k = nullptr;
  const uint16_t* v = nullptr;
  const uint16_t* rel_k = nullptr;
  const uint16_t* rel_v = nullptr;
  const uint16_t* rel_q = nullptr;
  const uint16_t* grad_out = nullptr;
  int64_t kv_stride = 0;
};

// How the AVX2 attention forward splits the keys of each (b, h, query tile) into chunks when
// there are few such items (decoding a batch with few heads): each chunk keeps its own running
// maximum m, sum l and unnormalised output acc (value term included) in the float
// buffers below, which rel_attention_combine merges in chunk order. Chosen from the shapes only,
// like AttentionBwdSplit, so results do not depend on the number of threads.
struct AttentionFwdSplit {
  // query rows and keys per tile: kAttentionTileQ (= kAttentionTileK), or kAttentionWideTile
  // (then chunks is 1 and there is no attention mask)
  int64_t tile = kAttentionTileQ;
  int64_t chunks = 1;
  int64_t chunk_keys = 0;  // keys per chunk, a multiple of kAttentionTileK
  float* m = nullptr;      // [chunks, batch, heads, q_len]
  float* l = nullptr;      // [chunks, batch, heads, q_len]
  float* acc = nullptr;    // [chunks, batch, heads, q_len, dim]
  AttnMaskTiles mask_tiles;
  // bfloat16 inputs: S = Q K^T, P V and the relative terms' band matmuls by AVX512-BF16 dot
  // products (the avx512 build only; from kAttentionDotMinRows query rows, with an even head
  // dim), cpu/isa.h bf16_dot_enabled; float32 inputs too under matmul precision "bf16"
  bool bf16_dot = false;
  bool amx = false;   // those dots on AMX tiles (with bf16_dot; cpu/isa.h amx_enabled)
  Bf16Operands bf16;  // the dots' operands (with bf16_dot)
  int wide_rows = 4;  // the avx512 build's matmul block rows (cpu/isa.h wide_block_rows)
};

// How the AVX2 attention backward splits the keys of a (b, kv head) into chunks, so that a batch
// with few kv heads still has work for every thread. Chosen from the shapes only (never from the
// thread count), so results do not depend on the number of threads. With chunks > 1 each chunk
// writes its dq contribution and table-gradient partials into the float buffers below (zeros on
// entry), which rel_attention_backward_reduce sums in chunk order.
struct AttentionBwdSplit {
  int64_t chunks = 1;
  int64_t chunk_keys = 0;             // keys per chunk, a multiple of kAttentionTileK
  float* dq_partial = nullptr;        // [chunks, batch, heads, q_len, dim]
  float* drel_k_partial = nullptr;    // [chunks, batch, heads, 2K+1, dim], or null
  float* drel_v_partial = nullptr;    // [chunks, batch, heads, 2K+1, dim], or null
  float* drel_bias_partial = nullptr;  // [chunks, batch, heads, 2K+1], or null
  float* drel_q_partial = nullptr;    // [chunks, batch, heads, 2K+1, dim], or null
  AttnMaskTiles mask_tiles;
  // bfloat16 inputs: the five big matmuls (S, dP, dV, dK, dQ) and the relative terms' band
  // matmuls by AVX512-BF16 dot products, P, dS and the weights per bucket rounded to bfloat16
  // (the avx512 build only; not with an odd head dim); float32 inputs too under matmul
  // precision "bf16"
  bool bf16_dot = false;
  bool amx = false;   // those dots on AMX tiles (with bf16_dot; cpu/isa.h amx_enabled)
  Bf16Operands bf16;  // the dots' operands (with bf16_dot)
  int wide_rows = 4;  // the avx512 build's matmul block rows (cpu/isa.h wide_block_rows)
};

// Chunks of `chunk` work items of [0, items), handed out one at a time to whichever thread asks
// (the AVX2 attention kernels): a thread slowed by other load does less of the work instead of
// holding up the call, and each thread keeps its buffers for all the chunks it takes. The AVX2
// sources only call pop(), which is defined in register_cpu.cpp, so they emit no copy of any of
// this class compiled with AVX2 flags (see cmake/check_no_weak_symbols.cmake).
class WorkQueue {
 public:
  WorkQueue(int64_t items, int64_t chunk)
      : items_(items), chunk_(chunk > 0 ? chunk : 1), chunks_((items + chunk_ - 1) / chunk_) {}
  int64_t chunks() const { return chunks_; }
  // The next chunk [begin, end); false when none is left.
  bool pop(int64_t& begin, int64_t& end);

 private:
  const int64_t items_, chunk_, chunks_;
  std::atomic<int64_t> next_{0};
};

// The fused attention kernels of rel_attention_avx2.cpp, declared for each namespace that file
// is compiled into: avx2, and avx512 (rel_attention_avx512.cpp: the same code with 16-lane
// matmul blocks, for CPUs with AVX-512).
#define RELPOS_ATTENTION_KERNELS                                                                  \
  void rel_attention(const RelAttentionParams& p, const AttentionFwdSplit& split,                 \
                     WorkQueue& work);                                                            \
  void rel_attention_combine(const RelAttentionParams& p, const AttentionFwdSplit& split,         \
                             int64_t begin, int64_t end);                                         \
  void rel_attention_backward(const RelAttentionBwdParams& p, const AttentionBwdSplit& split,     \
                              WorkQueue& work);                                                   \
  void rel_attention_backward_reduce(const RelAttentionBwdParams& p,                              \
                                     const AttentionBwdSplit& split, int64_t begin, int64_t end); \
  void attn_mask_tiles(const RelAttentionParams& p, const AttnMaskTiles& t, int64_t begin,        \
                       int64_t end);

namespace avx2 {
void rel_gather(const RelGatherParams& p, int64_t begin, int64_t end);
void rel_gather_backward(const RelGatherBwdParams& p, int64_t begin, int64_t end);
void skew(const SkewParams& p, int64_t begin, int64_t end);
void skew_backward(const SkewParams& p, int64_t begin, int64_t end);
void rel_logits(const RelLogitsParams& p, int64_t begin, int64_t end);
void bucket_sum(const BucketSumParams& p, int64_t begin, int64_t end);
void rope(const RopeParams& p, int64_t begin, int64_t end);
// Fused attention; work items differ from the scalar kernels (rel_attention_avx2.cpp), and the
// first two take them from a WorkQueue until it is empty:
//   rel_attention: (b, h, tile of split.tile query rows, key chunk) of
//     batch * heads * ceil(q_len / split.tile) * split.chunks;
//   rel_attention_combine (only when split.chunks > 1): (b, h) of batch * heads;
//   rel_attention_backward: (b, kv head, key chunk) of batch * kv_heads * split.chunks;
//   rel_attention_backward_reduce (only when split.chunks > 1): (b, h) of batch * heads;
//   attn_mask_tiles: (mask slab, query tile) of t.slabs * t.q_tiles, filling t.cls.
RELPOS_ATTENTION_KERNELS
// 12 * iters independent vector FMAs (fma_peak_avx2.cpp: 8 lanes here, 16 in avx512); returns a
// value of them so that none is optimised away. For fma_peak_gflops (isa.h).
float fma_spin(int64_t iters);
}  // namespace avx2

namespace avx512 {
// rel_logits_avx2.cpp with a 16-lane register tile (rel_logits_avx512.cpp; bucket_sum is the
// AVX2 code as it is).
void rel_logits(const RelLogitsParams& p, int64_t begin, int64_t end);
void bucket_sum(const BucketSumParams& p, int64_t begin, int64_t end);
RELPOS_ATTENTION_KERNELS
// fma_spin with 16-lane FMAs (fma_peak_avx512.cpp: fma_peak_avx2.cpp compiled again).
float fma_spin(int64_t iters);
}  // namespace avx512

#undef RELPOS_ATTENTION_KERNELS

// The scalar fused attention kernels for float64 compiled with AVX2 and FMA (rel_attention_f64.cpp;
// GCC's or clang's target pragmas), run on CPUs that have the AVX2 path; work items as in scalar::.
#if defined(RELPOS_HAVE_AVX2) && defined(__GNUC__)
#define RELPOS_HAVE_F64_AVX2 1
namespace f64_avx2 {
void rel_attention(const RelAttentionParams& p, int64_t begin, int64_t end);
void rel_attention_backward(const RelAttentionBwdParams& p, int64_t begin, int64_t end);
}  // namespace f64_avx2
#endif

}  // namespace relpos::cpu
