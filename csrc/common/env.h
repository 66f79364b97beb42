// Environment variables that choose among a few fixed values (README "Environment variables":
// RELPOS_CPU_ISA, RELPOS_CPU_THREADS, RELPOS_CPU_BF16_DOT, RELPOS_CPU_AMX, RELPOS_CPU_WIDE_ROWS,
// RELPOS_CUDA_TC).
// They are read at every call, so that tests and A/B timings can switch paths in one process, and
// a value outside the list is an error, never a silent fallback to the default. No torch headers:
// the CUDA sources read RELPOS_CUDA_TC here too. The error is a std::runtime_error, which the CUDA
// glue turns into a TORCH_CHECK error and pybind11 / torch raise as RuntimeError on the CPU path.
#pragma once

#include <cstdlib>
#include <initializer_list>
#include <stdexcept>
#include <string>

namespace relpos {

// The value of environment variable `name`: "" when it is unset or empty, else one of `allowed`;
// anything else throws "NAME must be A or B; got 'x'" (one of A, B, C for three or more).
inline std::string env_choice(const char* name, std::initializer_list<const char*> allowed) {
  const char* env = std::getenv(name);
  const std::string value = env != nullptr ? env : "";
  if (value.empty()) return value;
  for (const char* a : allowed) {
    if (value == a) return value;
  }
  std::string msg = std::string(name) + (allowed.size() > 2 ? " must be one of " : " must be ");
  size_t i = 0;
  for (const char* a : allowed) {
    if (i > 0) msg += allowed.size() > 2 ? ", " : " or ";
    msg += a;
    ++i;
  }
  throw std::runtime_error(msg + "; got '" + value + "'");
}

}  // namespace relpos
