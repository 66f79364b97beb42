// The float32 FMA throughput of one core running vector FMAs: the ceiling on the speed of any
// float32 kernel (no kernel does more than this machine's FMA units allow), for the benchmarks'
// roofline (fma_peak.cpp runs it on several threads). Compiled with -mavx2 -mfma (8 lanes, Ymm),
// and a second time with AVX-512 flags into namespace avx512 by fma_peak_avx512.cpp (16 lanes,
// Zmm: MatmulVec, the width of that build's matmul blocks). No torch headers.
#include <immintrin.h>

#include <cstdint>

#include "cpu/kernels.h"
#include "cpu/vec_avx2.h"

#ifndef RELPOS_ISA
#define RELPOS_ISA avx2
#endif

namespace relpos::cpu::RELPOS_ISA {
using namespace relpos::cpu::avx2;  // vec_avx2.h's register traits, when compiled as avx512

float fma_spin(int64_t iters) {
  using V = MatmulVec;
  using reg = V::reg;
  // 12 independent chains keep every FMA unit busy: more than units (2) x latency (4 cycles).
  const float xs = 0.9999f, ys = 1e-4f;
  const reg x = V::bcast(&xs), y = V::bcast(&ys);
  reg a[12];
  for (int u = 0; u < 12; ++u) {
    const float s = static_cast<float>(u);
    a[u] = V::bcast(&s);
  }
  for (int64_t k = 0; k < iters; ++k) {
#pragma GCC unroll 12
    for (int u = 0; u < 12; ++u) a[u] = V::fma(a[u], x, y);
  }
  float lanes[12][V::kLanes];
  for (int u = 0; u < 12; ++u) V::store(lanes[u], a[u]);
  float s = 0.f;
  for (int u = 0; u < 12; ++u) s += lanes[u][0];
  return s;
}

}  // namespace relpos::cpu::RELPOS_ISA
