// fma_peak_gflops (isa.h): fma_spin (fma_peak_avx2.cpp, or fma_peak_avx512.cpp on the AVX-512
// path) on `threads` threads at once.
#include <chrono>
#include <thread>
#include <vector>

#include "cpu/isa.h"
#include "cpu/kernels.h"

namespace relpos::cpu {

std::optional<double> fma_peak_gflops(int threads, double seconds) {
#if defined(RELPOS_HAVE_AVX2)
  const Isa isa = selected_isa();
  if (isa == Isa::Scalar || threads < 1) return std::nullopt;
  using clock = std::chrono::steady_clock;
  float (*fma_spin)(int64_t) = &avx2::fma_spin;
  double lanes = 8;
#if defined(RELPOS_HAVE_AVX512)
  if (isa == Isa::Avx512) {
    fma_spin = &avx512::fma_spin;
    lanes = 16;
  }
#endif
  const double kFlopPerIter = 12 * lanes * 2;  // 12 FMAs of 8 or 16 lanes
  // calibrate on one thread, then the timed runs: the best of three
  int64_t iters = 1 << 20;
  auto t0 = clock::now();
  volatile float sink = fma_spin(iters);
  const double t_cal = std::chrono::duration<double>(clock::now() - t0).count();
  iters = static_cast<int64_t>(iters * (seconds / 3) / (t_cal > 1e-6 ? t_cal : 1e-6)) + 1;
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    std::vector<std::thread> pool;
    std::vector<float> out(threads);
    t0 = clock::now();
    for (int t = 0; t < threads; ++t) pool.emplace_back([&, t] { out[t] = fma_spin(iters); });
    for (auto& th : pool) th.join();
    const double dt = std::chrono::duration<double>(clock::now() - t0).count();
    sink = sink + out[0];
    const double rate = threads * kFlopPerIter * static_cast<double>(iters) / dt / 1e9;
    if (rate > best) best = rate;
  }
  return best;
#else
  (void)threads;
  (void)seconds;
  return std::nullopt;
#endif
}

}  // namespace relpos::cpu
