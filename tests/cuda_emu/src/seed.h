// The seed of a launch's schedule and the pseudo-random stream drawn from it.
#pragma once

#include <cstdint>
#include <utility>

namespace relpos_emu::detail {

// set_seed()'s value if set, else RELPOS_EMU_SEED, else 0; throws on a malformed RELPOS_EMU_SEED.
uint64_t launch_seed();

// SplitMix64 (Steele, Lea and Flood 2014): tiny, fast and good enough to shuffle schedules.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}

  uint64_t next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }

  // Uniform in [0, n) up to a bias of n / 2^64 (Lemire's multiply-shift), n > 0.
  uint64_t below(uint64_t n) {
    return static_cast<uint64_t>((static_cast<unsigned __int128>(next()) * n) >> 64);
  }

  template <typename T>
  void shuffle(T* items, uint64_t count) {  // Fisher-Yates
    for (uint64_t i = count; i > 1; --i) std::swap(items[i - 1], items[below(i)]);
  }

 private:
  uint64_t state_;
};

}  // namespace relpos_emu::detail
