// The fused attention kernels (rel_attention_avx2.cpp) compiled again with AVX-512 flags
// (-mavx512f -mavx512vl -mavx512bw -mavx512dq, plus AVX2/FMA/F16C) into namespace avx512: the
// matmul blocks become 16 lanes wide (gemm_block with Zmm), which doubles their FMA rate on CPUs
// with two 512-bit FMA units, and the one-pass softmax rows of clamped tiles (exp_sum_rows8_stale,
// grad_rows8_uniform) take 16 keys at a time; the rest of the file is the AVX2 code as it is.
// Same FMA chains and exponentials, and the same sums in the same order (the AVX2 rows keep the
// halves of a 16-lane sum as two accumulators), so the results are bitwise those of the AVX2
// build (tests/test_attention.py checks it). The one exception is opt-out: on CPUs with
// AVX512-BF16 the kernels take bfloat16 inputs' big matmuls by bfloat16 dot products
// (AttentionFwdSplit / AttentionBwdSplit::bf16_dot; RELPOS_CPU_BF16_DOT=0 gives the bitwise AVX2
// results back), on AMX tiles where the CPU has AMX (::amx; RELPOS_HAVE_AMX builds only).
#define RELPOS_ISA avx512
#include "cpu/rel_attention_avx2.cpp"
