// The float32 FMA throughput of one core running AVX2: the ceiling on the speed of any float32
// kernel (no kernel does more than this machine's FMA units allow), for the benchmarks' roofline
// (fma_peak.cpp runs it on several threads). Compiled with -mavx2 -mfma; no torch headers.
#include <immintrin.h>

#include <cstdint>

#include "cpu/kernels.h"

namespace relpos::cpu::avx2 {

float fma_spin(int64_t iters) {
  // 12 independent chains keep every FMA unit busy: more than units (2) x latency (4 cycles).
  const __m256 x = _mm256_set1_ps(0.9999f), y = _mm256_set1_ps(1e-4f);
  __m256 a0 = _mm256_set1_ps(0.f), a1 = _mm256_set1_ps(1.f), a2 = _mm256_set1_ps(2.f);
  __m256 a3 = _mm256_set1_ps(3.f), a4 = _mm256_set1_ps(4.f), a5 = _mm256_set1_ps(5.f);
  __m256 a6 = _mm256_set1_ps(6.f), a7 = _mm256_set1_ps(7.f), a8 = _mm256_set1_ps(8.f);
  __m256 a9 = _mm256_set1_ps(9.f), a10 = _mm256_set1_ps(10.f), a11 = _mm256_set1_ps(11.f);
  for (int64_t k = 0; k < iters; ++k) {
    a0 = _mm256_fmadd_ps(a0, x, y);
    a1 = _mm256_fmadd_ps(a1, x, y);
    a2 = _mm256_fmadd_ps(a2, x, y);
    a3 = _mm256_fmadd_ps(a3, x, y);
    a4 = _mm256_fmadd_ps(a4, x, y);
    a5 = _mm256_fmadd_ps(a5, x, y);
    a6 = _mm256_fmadd_ps(a6, x, y);
    a7 = _mm256_fmadd_ps(a7, x, y);
    a8 = _mm256_fmadd_ps(a8, x, y);
    a9 = _mm256_fmadd_ps(a9, x, y);
    a10 = _mm256_fmadd_ps(a10, x, y);
    a11 = _mm256_fmadd_ps(a11, x, y);
  }
  const __m256 s = _mm256_add_ps(
      _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
      _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)),
                    _mm256_add_ps(_mm256_add_ps(a8, a9), _mm256_add_ps(a10, a11))));
  float lanes[8];
  _mm256_storeu_ps(lanes, s);
  return lanes[0];
}

}  // namespace relpos::cpu::avx2
