// rel_logits and bucket_sum (rel_logits_avx2.cpp) compiled again with AVX-512 flags into namespace
// avx512: the register tile of QE = q @ table^T becomes 16 lanes wide (panels of 32 buckets), which
// doubles its FMA rate on CPUs with two 512-bit FMA units. Same FMA chains, so the results are
// bitwise those of the AVX2 build (tests/test_ops.py checks it).
#define RELPOS_ISA avx512
#include "cpu/rel_logits_avx2.cpp"
