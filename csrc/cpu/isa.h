// Runtime choice of the CPU kernel path. AVX2 (with FMA and F16C) is used when it was compiled in
// and the CPU has it; AVX-512 (F, VL, BW, DQ) on top of that selects the fused attention and
// rel_logits kernels built with 16-lane matmul blocks (*_avx512.cpp; every other op runs its AVX2
// kernel). RELPOS_CPU_ISA=scalar|avx2|avx512|auto overrides, read at every call so tests can
// cover each path in one process (torchao does the same with its own variable).
#pragma once

#include <cstdint>
#include <optional>

namespace relpos::cpu {

enum class Isa { Scalar, Avx2, Avx512 };

// The path for this call: RELPOS_CPU_ISA if set (error if it names a path that cannot run here),
// else the best available.
Isa selected_isa();
const char* isa_name(Isa isa);

// The kernel float64 rel_attention runs on for `isa`: "avx2" where the scalar kernels were also
// compiled with AVX2/FMA (rel_attention_f64.cpp) and `isa` is a vector path, else "scalar".
const char* float64_attention_kernel(Isa isa);

// Whether the AVX-512 attention kernels take bfloat16 inputs' big matmuls (forward S = Q K^T and
// P V, the backward's five) by AVX512-BF16 dot products (AttentionFwdSplit / AttentionBwdSplit
// ::bf16_dot) on `isa`: the AVX-512 path on a CPU with AVX512-BF16, unless RELPOS_CPU_BF16_DOT=0
// (read at every call, as RELPOS_CPU_ISA) asks for the float32 matmuls, whose results are bitwise
// those of the AVX2 path. Which calls take them: bf16_dot_decode_only.
bool bf16_dot_enabled(Isa isa);

// Whether only decoding calls take those dots (where bf16_dot_enabled): calls of at most
// kAttentionFewQueries query rows against at least kAttentionDotDecodeMinKeys keys (kernels.h).
// True on Intel CPUs whose dots do not run on AMX tiles (amx_enabled false: no AMX, an OS that
// refuses the tile state, RELPOS_CPU_AMX=0), unless RELPOS_CPU_BF16_DOT=1 asks for the dots in
// every call; false elsewhere. On a Xeon with AMX switched off (family 6, model 167; B = 1, H = 8,
// D = 64, K = 64, 2 threads, forward, the float32 matmuls' time over the dots') `vdpbf16ps` lost
// to float32 FMAs from 64 query rows on (0.86x at 64 rows against 4096 keys, 0.76-0.78x at
// 128-256, 0.60-0.67x at L = 2048) and with few keys (32 rows, 64 keys: 0.95x; training at
// L = 16-32, B = 32-64: 0.87-0.96x, forward+backward 0.82-0.86x), and won decoding 2-32 rows
// against 256-16k keys (1.02-1.23x), where the float32 path converts the bfloat16 cache row by
// row. On AMD's Zen 4 the dots won at every size (1.6-1.7x).
bool bf16_dot_decode_only(Isa isa);

// Whether those bfloat16 dots run on AMX tiles (TDPBF16PS: a 16 x 16 float32 block += 16 x 32
// bfloat16 times 32 x 16, 8192 products per instruction where vdpbf16ps does 32): where
// bf16_dot_enabled, the CPU has AMX-TILE and AMX-BF16, the build has the AMX code (GCC 11,
// Clang 12) and the OS grants this process the tile state (Linux's arch_prctl
// ARCH_REQ_XCOMP_PERM, asked once), unless RELPOS_CPU_AMX=0 (read at every call, as
// RELPOS_CPU_ISA) keeps the AVX512-BF16 dots. The two sum the same exact products in other
// orders: results agree to float32 rounding of the sums, not bitwise.
bool amx_enabled(Isa isa);

// Rows per matmul block of the AVX-512 attention kernels' full 64-column strips (gemm_wide in
// rel_attention_avx2.cpp): RELPOS_CPU_WIDE_ROWS=4|6 if set (read at every call, as
// RELPOS_CPU_ISA), else 6 on Intel CPUs and 4 on others. Either gives the same results, bitwise.
// 0 on the other paths, which do not use it.
int wide_block_rows(Isa isa);

// The float32 FMA rate of `threads` cores each running independent FMAs of the selected path's
// width (8 lanes, or 16 on the AVX-512 path) for about `seconds`, in GFLOP/s (2 FLOP per FMA
// lane): this machine's ceiling for the selected kernels, the benchmarks' roofline
// (fma_peak.cpp). nullopt on the scalar path.
std::optional<double> fma_peak_gflops(int threads, double seconds);

}  // namespace relpos::cpu
