#include "seed.h"

#include <atomic>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "relpos_cuda_emu/runtime.h"

namespace relpos_emu {

namespace {
std::atomic<int64_t> g_seed_override{-1};
}

void set_seed(int64_t seed) { g_seed_override.store(seed < 0 ? -1 : seed); }

int64_t seed_override() { return g_seed_override.load(); }

namespace detail {

uint64_t launch_seed() {
  if (const int64_t seed = g_seed_override.load(); seed >= 0) return static_cast<uint64_t>(seed);
  const char* env = std::getenv("RELPOS_EMU_SEED");
  if (env == nullptr || *env == '\0') return 0;
  uint64_t seed = 0;
  const char* end = env + std::strlen(env);
  const auto [ptr, ec] = std::from_chars(env, end, seed);
  if (ec != std::errc() || ptr != end) {
    throw std::runtime_error(
        "relpos CUDA emulator: RELPOS_EMU_SEED must be a non-negative integer, got '" +
        std::string(env) + "'");
  }
  return seed;
}

}  // namespace detail
}  // namespace relpos_emu
