// The scalar fused attention kernels (rel_attention_scalar.h) compiled a second time for float64
// with AVX2 and FMA, for x86 CPUs that have them: float64 has no kernel in *_avx2.cpp, and with
// the baseline x86-64 flags its matmul loops get 2-lane SSE2 vectors and no fused multiply-add.
// Here they get 4-lane vectors and FMA. The same loops, so the same sums in the same order,
// except that a multiply and an add may now be one FMA (one rounding instead of two).
//
// Not an *_avx2.cpp file: those are compiled with -mavx2 and must not include torch headers or
// instantiate std templates, as an inline function or template instance compiled with AVX2 is a
// weak symbol the linker may pick for the scalar path too (cmake/check_no_weak_symbols.cmake).
// This file is compiled with the baseline flags, and only the functions defined between the
// target pragmas below - the attention kernels, in their own namespace - get AVX2 code.
// Everything they call from other headers (std::, at::, relpos_index.h) is included before the
// pragmas and so keeps its baseline code; the compiler may inline it into the AVX2 functions.
// So every header rel_attention_scalar.h includes must be included here first. The build checks
// it: this file is an object of its own, built without LTO, and cmake/check_isa_confined.py fails
// the build if its machine code has AVX instructions outside the f64_avx2 namespaces.
// GCC and clang (RELPOS_HAVE_F64_AVX2, kernels.h).
#include "cpu/kernels.h"

#if defined(RELPOS_HAVE_F64_AVX2)

#include <ATen/OpMathType.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "common/dropout.h"
#include "common/params.h"
#include "common/relpos_index.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif
#define RELPOS_SCALAR_ATTENTION_NS f64_avx2_kernels
#include "cpu/rel_attention_scalar.h"
#undef RELPOS_SCALAR_ATTENTION_NS

namespace relpos::cpu::f64_avx2 {

void rel_attention(const RelAttentionParams& p, int64_t begin, int64_t end) {
  f64_avx2_kernels::rel_attention<double>(p, begin, end);
}

void rel_attention_backward(const RelAttentionBwdParams& p, int64_t begin, int64_t end) {
  f64_avx2_kernels::rel_attention_backward<double>(p, begin, end);
}

}  // namespace relpos::cpu::f64_avx2
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#endif  // RELPOS_HAVE_F64_AVX2
