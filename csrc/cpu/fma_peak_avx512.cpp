// fma_spin with 16-lane AVX-512 FMAs: the float32 FMA throughput of one core where the AVX-512
// attention kernels run (fma_peak.cpp picks it then). Compiled with AVX-512 flags; no torch
// headers.
#include <immintrin.h>

#include <cstdint>

#include "cpu/kernels.h"

namespace relpos::cpu::avx512 {

float fma_spin(int64_t iters) {
  // 12 independent chains, as the AVX2 fma_spin: more than units (2) x latency (4 cycles).
  const __m512 x = _mm512_set1_ps(0.9999f), y = _mm512_set1_ps(1e-4f);
  __m512 a[12];
  for (int u = 0; u < 12; ++u) a[u] = _mm512_set1_ps(static_cast<float>(u));
  for (int64_t k = 0; k < iters; ++k) {
#pragma GCC unroll 12
    for (int u = 0; u < 12; ++u) a[u] = _mm512_fmadd_ps(a[u], x, y);
  }
  __m512 s = a[0];
  for (int u = 1; u < 12; ++u) s = _mm512_add_ps(s, a[u]);
  return _mm512_reduce_add_ps(s);
}

}  // namespace relpos::cpu::avx512
