// CPU backend of the relpos ops: picks the kernel path (cpu/isa.h) and splits the work items
// over threads with parallel_for (cpu/parallel.h: at::parallel_for, or in builds without OpenMP
// torch's OpenMP runtime reached at run time, or std::threads); the op bodies are shared with
// CUDA (common/ops_impl.h).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "common/attention_impl.h"
#include "common/ops_impl.h"
#include "cpu/isa.h"
#include "cpu/kernels.h"
#include "cpu/kernels_scalar.h"
#include "cpu/parallel.h"
#include "cpu/rel_attention_scalar.h"

namespace relpos::cpu {
namespace {

at::ScalarType scalar_type_of(DType d) {
  switch (d) {
    case DType::Float32: return at::kFloat;
    case DType::Float64: return at::kDouble;
    case DType::Float16: return at::kHalf;
    case DType::BFloat16: return at::kBFloat16;
  }
  return at::kFloat;
}

#if defined(RELPOS_HAVE_AVX2)
#define RELPOS_AVX2_FN(name) &avx2::name
#else
#define RELPOS_AVX2_FN(name) nullptr
#endif
#if defined(RELPOS_HAVE_AVX512)
#define RELPOS_AVX512_FN(name) &avx512::name
#else
#define RELPOS_AVX512_FN(name) nullptr
#endif
#if defined(RELPOS_HAVE_F64_AVX2)
#define RELPOS_F64_AVX2_FN(name) &f64_avx2::name
#else
#define RELPOS_F64_AVX2_FN(name) nullptr
#endif

template <typename Params>
DType params_dtype(const Params& p) { return p.dtype; }
DType params_dtype(const RelAttentionBwdParams& p) { return p.fwd.dtype; }

template <typename Params>
using VectorFn = void (*)(const Params&, int64_t, int64_t);

// Runs `avx2_fn` (float32/float16/bfloat16 on the AVX2 path; on the AVX-512 path `avx512_fn`
// where the op has one, else `avx2_fn`), `f64_fn` (float64 on either path, where the op has
// one) or the scalar template over [0, items) in parallel. `grain` is the number of items worth
// a task.
template <typename Params, typename ScalarFn>
void run(const Params& p, int64_t items, int64_t grain,
         std::type_identity_t<VectorFn<Params>> avx2_fn, ScalarFn scalar_fn,
         std::type_identity_t<VectorFn<Params>> avx512_fn = nullptr,
         std::type_identity_t<VectorFn<Params>> f64_fn = nullptr) {
  if (items <= 0) return;
  const Isa isa = selected_isa();  // validates RELPOS_CPU_ISA on every call
  const bool f64 = params_dtype(p) == DType::Float64;
  const VectorFn<Params> vector_fn = isa == Isa::Scalar ? nullptr
                                     : f64                ? f64_fn
                                     : isa == Isa::Avx512 && avx512_fn != nullptr ? avx512_fn
                                                                                   : avx2_fn;
  if (vector_fn != nullptr) {
    parallel_for(0, items, grain, [&](int64_t b, int64_t e) { vector_fn(p, b, e); });
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, scalar_type_of(params_dtype(p)), "relpos_cpu",
                                  [&] {
                                    parallel_for(0, items, grain, [&](int64_t b, int64_t e) {
                                      scalar_fn.template operator()<scalar_t>(p, b, e);
                                    });
                                  });
}

// Runs fn(work) on up to get_num_threads() threads that all take their items from one
// WorkQueue of `items` in chunks of `chunk` (kernels.h): for kernels whose items write disjoint
// outputs, so the results do not depend on which thread takes what. `serial`: on the calling
// thread only (a call too small to split, kSerialMacs).
template <typename Fn>
void run_queue(int64_t items, int64_t chunk, bool serial, const Fn& fn) {
  if (items <= 0) return;
  WorkQueue work(items, chunk);
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), work.chunks());
  if (serial || workers <= 1 || in_parallel_region()) {
    fn(work);
    return;
  }
  parallel_for(0, workers, 1, [&](int64_t, int64_t) { fn(work); });  // each drains the queue
}

// The fused attention's forward runs a call whose matmuls come to at most this many
// multiply-adds on the calling thread. Starting a parallel region costs microseconds on idle
// cores, and where the other cores are busy it waits until its threads are scheduled (a time
// slice: milliseconds), for a decoding step that takes 15 us on one thread. 2 threads against
// 1, B = 1, H = 8, D = 64, one row, 2-core Zen 4, idle: 16-64 keys (16k-66k multiply-adds)
// 0.97-1.16x the time, 128 keys (131k) 1.00x, 256 keys 0.82x; 4 rows x 64 keys (262k) 1.01x;
// 1 head x 2048 keys 0.80x. With the other core busy (a spinning process; 400 calls, two
// threads): at 16-128 keys the mean went from 22-36 to 13-19 us (the calls that waited for the
// second thread are gone), the median from 11-15 to 12-19.
constexpr int64_t kSerialMacs = int64_t(1) << 17;

// Roughly 32k elements of output per task, at least one item.
int64_t grain_for(int64_t elems_per_item) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, elems_per_item));
}

struct CpuBackend {
  static bool device_ok(const at::Tensor& t) { return t.device().is_cpu(); }
  static const char* device_name() { return "cpu"; }

  static void rel_gather(const RelGatherParams& p) {
    run(p, p.heads * p.q_len, grain_for(p.k_len * p.dim), RELPOS_AVX2_FN(rel_gather),
        []<typename T>(const RelGatherParams& pp, int64_t b, int64_t e) {
          scalar::rel_gather<T>(pp, b, e);
        });
  }
  static void rel_gather_backward(const RelGatherBwdParams& p) {
    run(p, gather_bwd_items(p), 1, RELPOS_AVX2_FN(rel_gather_backward),
        []<typename T>(const RelGatherBwdParams& pp, int64_t b, int64_t e) {
          scalar::rel_gather_backward<T>(pp, b, e);
        });
  }
  static void skew(const SkewParams& p) {
    run(p, p.batch * p.q_len, grain_for(p.k_len), RELPOS_AVX2_FN(skew),
        []<typename T>(const SkewParams& pp, int64_t b, int64_t e) { scalar::skew<T>(pp, b, e); });
  }
  static void skew_backward(const SkewParams& p) {
    run(p, p.batch * p.q_len, grain_for(p.k_len), RELPOS_AVX2_FN(skew_backward),
        []<typename T>(const SkewParams& pp, int64_t b, int64_t e) {
          scalar::skew_backward<T>(pp, b, e);
        });
  }
  static void rel_logits(const RelLogitsParams& p) {
    run(p, p.batch * p.heads * p.q_len, grain_for(p.k_len + p.dim * 8), RELPOS_AVX2_FN(rel_logits),
        []<typename T>(const RelLogitsParams& pp, int64_t b, int64_t e) {
          scalar::rel_logits<T>(pp, b, e);
        },
        RELPOS_AVX512_FN(rel_logits));
  }
  static void bucket_sum(const BucketSumParams& p) {
    run(p, p.batch * p.heads * p.q_len, grain_for(p.k_len), RELPOS_AVX2_FN(bucket_sum),
        []<typename T>(const BucketSumParams& pp, int64_t b, int64_t e) {
          scalar::bucket_sum<T>(pp, b, e);
        },
        RELPOS_AVX512_FN(bucket_sum));
  }
  static void rope(const RopeParams& p) {
    run(p, p.n0 * p.n1 * p.n2, grain_for(p.dim), RELPOS_AVX2_FN(rope),
        []<typename T>(const RopeParams& pp, int64_t b, int64_t e) { scalar::rope<T>(pp, b, e); });
  }
  // The AVX2 attention kernels tile the work differently from the scalar ones (kernels.h).
  static void rel_attention(const RelAttentionParams& p) {
#if defined(RELPOS_HAVE_AVX2)
    if (const Isa isa = selected_isa(); p.dtype != DType::Float64 && isa != Isa::Scalar) {
      rel_attention_avx2(p, attention_kernels(isa));
      return;
    }
#endif
    run(p, p.batch * p.heads * scalar::fwd_row_blocks(p.q_len),
        grain_for(p.k_len * p.dim * 4 * scalar::kFwdRows), nullptr,
        []<typename T>(const RelAttentionParams& pp, int64_t b, int64_t e) {
          scalar::rel_attention<T>(pp, b, e);
        },
        nullptr, RELPOS_F64_AVX2_FN(rel_attention));
  }
  static void rel_attention_backward(const RelAttentionBwdParams& p) {
#if defined(RELPOS_HAVE_AVX2)
    if (const Isa isa = selected_isa(); p.fwd.dtype != DType::Float64 && isa != Isa::Scalar) {
      rel_attention_backward_avx2(p, attention_kernels(isa));
      return;
    }
#endif
    // scalar: work items are (b, kv head)
    run(p, p.fwd.batch * p.fwd.kv_heads, 1, nullptr,
        []<typename T>(const RelAttentionBwdParams& pp, int64_t b, int64_t e) {
          scalar::rel_attention_backward<T>(pp, b, e);
        },
        nullptr, RELPOS_F64_AVX2_FN(rel_attention_backward));
  }

#if defined(RELPOS_HAVE_AVX2)
  // Decoding (at most kAttentionFewQueries rows) with fewer than kFwdTargetItems (b, h) pairs
  // splits the keys into chunks of at least kFwdMinChunkTiles key tiles, so that a batch with
  // few heads still streams its cache on every thread (flash-decoding); the chunks' shares are
  // merged by rel_attention_combine. Shapes alone decide the split, so it is sized for machines
  // with many cores; chunks of 1024 keys or more keep its cost out of sight on two (B=1, H=8,
  // D=64, 1-16 rows, 1k-16k keys: unchanged within the noise), while one head there gains
  // 1.4-1.9x from 4k keys on (16k keys, one row: 163 -> 95 us).
  static constexpr int64_t kFwdTargetItems = 64;
  static constexpr int64_t kFwdMinChunkTiles = 16;

  // The fused attention kernels of a vector path: avx2, or avx512 (the same code with 16-lane
  // matmul blocks, kernels.h).
  struct AttentionKernels {
    decltype(&avx2::rel_attention) fwd;
    decltype(&avx2::rel_attention_combine) combine;
    decltype(&avx2::rel_attention_backward) bwd;
    decltype(&avx2::rel_attention_backward_reduce) reduce;
    decltype(&avx2::attn_mask_tiles) mask_tiles;
    bool bf16_dot;  // bfloat16 inputs' matmuls by AVX512-BF16 dots (cpu/isa.h bf16_dot_enabled)
    bool amx;       // those dots on AMX tiles (cpu/isa.h amx_enabled)
    int wide_rows;  // matmul block rows of full 64-column strips (cpu/isa.h wide_block_rows)
    bool dot_decode_only;  // the dots for decoding calls only (cpu/isa.h bf16_dot_decode_only)

    // Whether a call takes the dots for matmuls of `dot_dtype` operands (from min_rows query
    // rows on: kAttentionDotMinRows in the forward; the backward of a single row takes them
    // too): decided from the call's shape alone, so both passes decide alike.
    bool dots(bool dot_dtype, const RelAttentionParams& f, int64_t min_rows) const {
      const bool decoding = f.q_len <= kAttentionFewQueries && f.k_len >= kAttentionDotDecodeMinKeys;
      return dot_dtype && bf16_dot && f.dim % 2 == 0 && f.q_len >= min_rows &&
             (!dot_decode_only || decoding);
    }
  };
  static AttentionKernels attention_kernels(Isa isa) {
#if defined(RELPOS_HAVE_AVX512)
    if (isa == Isa::Avx512) {
      return {&avx512::rel_attention, &avx512::rel_attention_combine, &avx512::rel_attention_backward,
              &avx512::rel_attention_backward_reduce, &avx512::attn_mask_tiles, bf16_dot_enabled(isa),
              amx_enabled(isa), wide_block_rows(isa), bf16_dot_decode_only(isa)};
    }
#endif
    (void)isa;
    return {&avx2::rel_attention, &avx2::rel_attention_combine, &avx2::rel_attention_backward,
            &avx2::rel_attention_backward_reduce, &avx2::attn_mask_tiles, false, false, 0, false};
  }

  // Whether float32 inputs may take the bfloat16 dots: torch's float32 matmul precision for the
  // CPU is "bf16" (torch.set_float32_matmul_precision("medium"), or
  // torch.backends.mkldnn.matmul.fp32_precision = "bf16"), under which torch's own CPU matmuls
  // may compute in bfloat16 too. Read at every call; the default ("highest") keeps float32.
  static bool fp32_matmul_bf16() {
    return at::globalContext().float32Precision(at::Float32Backend::MKLDNN, at::Float32Op::MATMUL) ==
           at::Float32Precision::BF16;
  }

  // Whether a float32 call takes the bfloat16 dots (both passes decide alike): under matmul
  // precision "bf16", past kAttentionFewQueries query rows. Decoding reads each key once, in
  // place, where the dots would read the float32 keys once more to round them first: B = 1,
  // H = 8, D = 64, 1k-4k keys, 2-16 rows, the dots ran 1.1-2.4x slower; 33-256 rows, 1.1-1.6x
  // faster (16k keys: 0.85-1.2x).
  static bool fp32_dots(const RelAttentionParams& p) {
    return p.q_len > kAttentionFewQueries && fp32_matmul_bf16();
  }

  // The bfloat16 dots' operands (kernels.h Bf16Operands) of a call that takes them: bfloat16
  // inputs as they are; for float32 inputs the tables rounded to bfloat16 (to nearest even, as the
  // kernels round P, dS and float32 q, k, v, dO tile by tile) into tensors that `keep` holds for
  // the call: O(K D), where whole copies of q, k, v and dO would take O(L D).
  static Bf16Operands bf16_operands(const RelAttentionParams& p, const void* grad_out,
                                    std::vector<at::Tensor>& keep) {
    Bf16Operands o;
    if (p.dtype == DType::BFloat16) {
      auto as16 = [](const void* x) { return static_cast<const uint16_t*>(x); };
      o = {as16(p.q), as16(p.k), as16(p.v), as16(p.rel_k), as16(p.rel_v), as16(p.rel_q),
           as16(grad_out), p.kv_stride};
      return o;
    }
    TORCH_INTERNAL_ASSERT(p.dtype == DType::Float32);
    const int64_t rows_d = num_buckets(p.max_distance) * p.dim;
    auto round = [&](const void* x, bool per_head) -> const uint16_t* {
      if (x == nullptr) return nullptr;
      const int64_t n = (per_head ? p.heads : 1) * rows_d;
      keep.push_back(at::from_blob(const_cast<void*>(x), {n}, at::kFloat).to(at::kBFloat16));
      return static_cast<const uint16_t*>(keep.back().data_ptr());
    };
    o.rel_k = round(p.rel_k, p.rel_k_per_head);
    o.rel_v = round(p.rel_v, p.rel_v_per_head);
    o.rel_q = round(p.rel_q, p.rel_q_per_head);
    return o;
  }

  // Multiply-adds of the forward's two matmuls (q k^T and P v), which kSerialMacs bounds.
  static int64_t forward_macs(const RelAttentionParams& p) {
    return 2 * p.batch * p.heads * p.q_len * p.k_len * p.dim;
  }

  // The attention mask's tile classes (kernels.h), in a tensor kept alive by the caller.
  static AttnMaskTiles mask_tiles(const RelAttentionParams& p, const AttentionKernels& kern,
                                  bool serial, at::Tensor& storage) {
    AttnMaskTiles t;
    if (p.attn_mask == nullptr) return t;
    t.slabs = (p.attn_mask_b_stride != 0 ? p.batch : 1) * (p.attn_mask_h_stride != 0 ? p.heads : 1);
    t.q_tiles = (p.q_len + kAttentionTileQ - 1) / kAttentionTileQ;
    t.k_tiles = (p.k_len + kAttentionTileK - 1) / kAttentionTileK;
    storage = at::empty({t.slabs * t.q_tiles * t.k_tiles}, at::TensorOptions().dtype(at::kByte));
    t.cls = storage.data_ptr<uint8_t>();
    const int64_t items = t.slabs * t.q_tiles;
    parallel_for(0, items, serial ? items : 1, [&](int64_t b, int64_t e) {
      kern.mask_tiles(p, t, b, e);
    });
    return t;
  }

  static void rel_attention_avx2(const RelAttentionParams& p, const AttentionKernels& kern) {
    AttentionFwdSplit split;
    // wide tiles (kernels.h) where nothing hides keys tile by tile; decoding keeps the small ones
    const bool wide = p.q_len > kAttentionFewQueries && p.attn_mask == nullptr &&
                      p.q_segment_ids == nullptr && p.key_padding_mask == nullptr &&
                      p.window_left < 0 && p.window_right < 0;
    split.tile = wide ? kAttentionWideTile : kAttentionTileQ;
    const bool dot_dtype = p.dtype == DType::BFloat16 || (p.dtype == DType::Float32 && fp32_dots(p));
    split.bf16_dot = kern.dots(dot_dtype, p, kAttentionDotMinRows);
    std::vector<at::Tensor> rounded;  // float32 tables rounded for the dots
    split.amx = split.bf16_dot && kern.amx && p.q_len >= kAttentionAmxMinRows;
    if (split.bf16_dot) split.bf16 = bf16_operands(p, nullptr, rounded);
    split.wide_rows = kern.wide_rows;
    const int64_t tiles = p.batch * p.heads * ((p.q_len + split.tile - 1) / split.tile);
    const int64_t k_tiles = (p.k_len + kAttentionTileK - 1) / kAttentionTileK;
    at::Tensor m, l, acc;
    if (p.q_len <= kAttentionFewQueries && tiles > 0 && tiles < kFwdTargetItems) {
      const int64_t chunks = std::min((kFwdTargetItems + tiles - 1) / tiles, k_tiles / kFwdMinChunkTiles);
      if (chunks > 1) {
        split.chunk_keys = (k_tiles + chunks - 1) / chunks * kAttentionTileK;
        split.chunks = (p.k_len + split.chunk_keys - 1) / split.chunk_keys;
      }
    }
    if (split.chunks > 1) {  // every entry is written by its item
      const auto opts = at::TensorOptions().dtype(at::kFloat);
      const int64_t c = split.chunks;
      m = at::empty({c, p.batch, p.heads, p.q_len}, opts);
      l = at::empty({c, p.batch, p.heads, p.q_len}, opts);
      acc = at::empty({c, p.batch, p.heads, p.q_len, p.dim}, opts);
      split.m = m.data_ptr<float>();
      split.l = l.data_ptr<float>();
      split.acc = acc.data_ptr<float>();
    }
    const bool serial = forward_macs(p) <= kSerialMacs;
    at::Tensor tile_classes;
    split.mask_tiles = mask_tiles(p, kern, serial, tile_classes);
    const int64_t items = tiles * split.chunks;
    // about 8 chunks per thread: small enough to balance, large enough that a thread seldom
    // moves to another kv head (whose keys it then transposes again)
    const int64_t chunk = std::max<int64_t>(1, items / (8 * at::get_num_threads()));
    run_queue(items, chunk, serial, [&](WorkQueue& work) { kern.fwd(p, split, work); });
    if (split.chunks > 1) {
      parallel_for(0, p.batch * p.heads, 1, [&](int64_t b, int64_t e) {
        kern.combine(p, split, b, e);
      });
    }
  }

  // Work items (b, kv head, key chunk): when batch * kv_heads is small (few kv heads, B = 1),
  // the keys of each kv head are split into chunks so that up to kBwdTargetItems items exist,
  // with per-chunk float partials for dq and the table and bias gradients (at most
  // kBwdPartialBytes for the dq partials) reduced in chunk order. Shapes alone decide the split,
  // so the results are the same for any thread count.
  static constexpr int64_t kBwdTargetItems = 8;
  static constexpr int64_t kBwdPartialBytes = int64_t(32) << 20;

  static void rel_attention_backward_avx2(const RelAttentionBwdParams& p, const AttentionKernels& kern) {
    const RelAttentionParams& f = p.fwd;
    const int64_t units = f.batch * f.kv_heads;
    const int64_t k_tiles = (f.k_len + kAttentionTileK - 1) / kAttentionTileK;
    const int64_t dq_bytes = f.batch * f.heads * f.q_len * f.dim * int64_t(sizeof(float));
    int64_t chunks = 1;
    if (units < kBwdTargetItems && k_tiles > 1) {
      chunks = std::min((kBwdTargetItems + units - 1) / units, k_tiles);
      chunks = std::min(chunks, std::max<int64_t>(1, kBwdPartialBytes / std::max<int64_t>(1, dq_bytes)));
    }
    AttentionBwdSplit split;
    const bool dot_dtype = f.dtype == DType::BFloat16 || (f.dtype == DType::Float32 && fp32_dots(f));
    split.bf16_dot = kern.dots(dot_dtype, f, 0);
    std::vector<at::Tensor> rounded;  // float32 tables rounded for the dots
    split.amx = split.bf16_dot && kern.amx && f.q_len >= kAttentionAmxMinRows;  // as the forward's
    if (split.bf16_dot) split.bf16 = bf16_operands(f, p.grad_out, rounded);
    split.wide_rows = kern.wide_rows;
    at::Tensor partials[5];  // dq and the table / bias gradients' per-chunk partials, kept alive
    if (chunks > 1) {
      const int64_t tiles_per_chunk = (k_tiles + chunks - 1) / chunks;
      split.chunk_keys = tiles_per_chunk * kAttentionTileK;
      split.chunks = (f.k_len + split.chunk_keys - 1) / split.chunk_keys;
    }
    if (split.chunks > 1) {
      const auto opts = at::TensorOptions().dtype(at::kFloat);
      const int64_t c = split.chunks, rows = num_buckets(f.max_distance);
      // a partial per chunk for each gradient the call has: [c, B, H, per-head shape...]
      int used = 0;
      auto partial = [&](bool has, at::IntArrayRef per_head, float*& out) {
        if (!has) return;
        std::vector<int64_t> shape{c, f.batch, f.heads};
        shape.insert(shape.end(), per_head.begin(), per_head.end());
        partials[used] = at::zeros(shape, opts);
        out = partials[used++].data_ptr<float>();
      };
      partial(true, {f.q_len, f.dim}, split.dq_partial);
      partial(p.drel_k_partial != nullptr, {rows, f.dim}, split.drel_k_partial);
      partial(p.drel_v_partial != nullptr, {rows, f.dim}, split.drel_v_partial);
      partial(p.drel_bias_partial != nullptr, {rows}, split.drel_bias_partial);
      partial(p.drel_q_partial != nullptr, {rows, f.dim}, split.drel_q_partial);
    }
    // (no serial cut-off: the backward's items carry more fixed work, and two threads took
    // 0.84-0.96x one's time even at B = 1, H = 8, D = 64, one row and 16-64 keys)
    at::Tensor tile_classes;
    split.mask_tiles = mask_tiles(f, kern, /*serial=*/false, tile_classes);
    run_queue(units * split.chunks, 1, /*serial=*/false,
              [&](WorkQueue& work) { kern.bwd(p, split, work); });
    if (split.chunks > 1) {
      parallel_for(0, f.batch * f.heads, 1, [&](int64_t b, int64_t e) {
        kern.reduce(p, split, b, e);
      });
    }
  }
#endif
};

using Impl = OpsImpl<CpuBackend>;
using Attention = AttentionImpl<CpuBackend>;

}  // namespace

bool WorkQueue::pop(int64_t& begin, int64_t& end) {
  const int64_t c = next_.fetch_add(1, std::memory_order_relaxed);
  if (c >= chunks_) return false;
  begin = c * chunk_;
  end = std::min(items_, begin + chunk_);
  return true;
}

}  // namespace relpos::cpu

TORCH_LIBRARY_IMPL(relpos, CPU, m) {
  using relpos::cpu::Attention;
  using relpos::cpu::Impl;
  m.impl("rel_gather", &Impl::rel_gather);
  m.impl("rel_gather_backward", &Impl::rel_gather_backward);
  m.impl("skew", &Impl::skew);
  m.impl("skew_backward", &Impl::skew_backward);
  m.impl("rel_logits", &Impl::rel_logits);
  m.impl("rel_logits_backward", &Impl::rel_logits_backward);
  m.impl("rope", &Impl::rope);
  m.impl("rel_attention", &Attention::rel_attention);
  m.impl("rel_attention_backward", &Attention::rel_attention_backward);
}
