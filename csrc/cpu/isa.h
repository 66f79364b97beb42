// Runtime choice of the CPU kernel path. AVX2 (with FMA and F16C) is used when it was compiled in
// and the CPU has it; RELPOS_CPU_ISA=scalar|avx2|auto overrides, read at every call so tests can
// cover each path in one process (torchao does the same with its own variable).
#pragma once

#include <optional>

namespace relpos::cpu {

enum class Isa { Scalar, Avx2 };

// The path for this call: RELPOS_CPU_ISA if set (error if it names a path that cannot run here),
// else the best available.
Isa selected_isa();
const char* isa_name(Isa isa);

// The float32 FMA rate of `threads` cores each running independent 8-lane FMAs for about
// `seconds`, in GFLOP/s (2 FLOP per FMA lane): this machine's ceiling for any float32 kernel, the
// benchmarks' roofline (fma_peak.cpp). nullopt where the AVX2 kernels cannot run.
std::optional<double> fma_peak_gflops(int threads, double seconds);

}  // namespace relpos::cpu
