// Small device-side helpers shared by the kernel headers: qualifiers that also compile as host C++
// under the emulator (RELPOS_CUDA_EMU, DESIGN.md §4) and the bitwise copy units
// used by the pure data-movement kernels (rel_gather, skew), which depend only on element size.
#pragma once

#include <cstdint>

#include "cuda/launch.cuh"

#if defined(__CUDACC__)
#define RELPOS_DEVICE __device__ __forceinline__
#define RELPOS_UNROLL _Pragma("unroll")
#define RELPOS_UNROLL4 _Pragma("unroll 4")
#define RELPOS_NO_UNROLL _Pragma("unroll 1")
#else
#define RELPOS_DEVICE inline
#define RELPOS_UNROLL
#define RELPOS_UNROLL4
#define RELPOS_NO_UNROLL
#endif

namespace relpos::cuda {

// Bit patterns moved by the copy kernels: one element of 2, 4 or 8 bytes, or 16 bytes at once
// when rows allow it. Zero bits are +0.0 in every floating type, so copies can also zero-fill.
struct alignas(16) Bits16 {
  uint32_t w[4];
};

// Butterfly reductions over the 32 lanes of a warp (all lanes take part). Every lane ends with
// the same bits: each step adds (or compares) the same two partials in either order.
template <typename A>
RELPOS_DEVICE A warp_sum(A v) {
  RELPOS_UNROLL
  for (int m = 16; m > 0; m /= 2) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}

template <typename A>
RELPOS_DEVICE A warp_max(A v) {
  RELPOS_UNROLL
  for (int m = 16; m > 0; m /= 2) {
    const A o = __shfl_xor_sync(0xffffffffu, v, m);
    v = o > v || o != o ? o : v;  // NaN wins, so that every lane ends with the same value
  }
  return v;
}

template <typename U>
RELPOS_DEVICE U zero_bits() {
  U u;
  unsigned char* p = reinterpret_cast<unsigned char*>(&u);
  for (unsigned k = 0; k < sizeof(U); ++k) p[k] = 0;
  return u;
}

}  // namespace relpos::cuda
