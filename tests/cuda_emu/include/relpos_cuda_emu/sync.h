// Block barriers, warp shuffles and votes with CUDA's signatures. Each is a yield point of the
// scheduler (runtime.h); the trailing source_location argument is filled in at the call site and
// only serves error messages and the check that all threads wait at the same __syncthreads().
#pragma once

#include <cstdint>
#include <cstring>
#include <source_location>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "runtime.h"

inline void __syncthreads(const std::source_location& site = std::source_location::current()) {
  relpos_emu::detail::sync_block(relpos_emu::detail::BlockSync::kSync, 1, site);
}
inline int __syncthreads_count(int predicate,
                               const std::source_location& site = std::source_location::current()) {
  return relpos_emu::detail::sync_block(relpos_emu::detail::BlockSync::kCount, predicate, site);
}
inline int __syncthreads_and(int predicate,
                             const std::source_location& site = std::source_location::current()) {
  return relpos_emu::detail::sync_block(relpos_emu::detail::BlockSync::kAnd, predicate, site);
}
inline int __syncthreads_or(int predicate,
                            const std::source_location& site = std::source_location::current()) {
  return relpos_emu::detail::sync_block(relpos_emu::detail::BlockSync::kOr, predicate, site);
}

inline void __syncwarp(unsigned mask = 0xffffffffu,
                       const std::source_location& site = std::source_location::current()) {
  relpos_emu::detail::sync_warp(relpos_emu::detail::WarpOp::kSync, mask, 0, 0, warpSize, site);
}
inline unsigned __ballot_sync(unsigned mask, int predicate,
                              const std::source_location& site = std::source_location::current()) {
  return static_cast<unsigned>(relpos_emu::detail::sync_warp(
      relpos_emu::detail::WarpOp::kBallot, mask, predicate != 0, 0, warpSize, site));
}
inline int __any_sync(unsigned mask, int predicate,
                      const std::source_location& site = std::source_location::current()) {
  return static_cast<int>(relpos_emu::detail::sync_warp(relpos_emu::detail::WarpOp::kAny, mask,
                                                        predicate != 0, 0, warpSize, site));
}
inline int __all_sync(unsigned mask, int predicate,
                      const std::source_location& site = std::source_location::current()) {
  return static_cast<int>(relpos_emu::detail::sync_warp(relpos_emu::detail::WarpOp::kAll, mask,
                                                        predicate != 0, 0, warpSize, site));
}

namespace relpos_emu {

// A warp operation computed once for the whole warp, where CUDA has one instruction that takes
// every lane's registers (mma.sync: csrc/cuda/mma.cuh). Every lane of `mask` calls it with the same
// `complete` and its own `arg`; it releases as __syncwarp(mask) does (every non-exited lane of the
// mask waits at the same operation), after complete(args, group) has run once with each waiting
// lane's arg (detail::WarpCollective). One yield point where a __syncwarp before and after the
// computation would be two, and one computation where each lane would repeat the gathering.
inline void warp_collective(unsigned mask, detail::WarpCollective complete, void* arg,
                            const std::source_location& site = std::source_location::current()) {
  detail::warp_collective(mask, complete, arg, site);
}

}  // namespace relpos_emu

namespace relpos_emu::detail {

// The value travels as raw bits. __half2 and __nv_bfloat162 are not trivially copyable (they
// declare copy assignment) but are plain standard-layout pairs of 16-bit values.
template <typename T>
T shuffle(WarpOp op, unsigned mask, T var, int lane_arg, int width,
          const std::source_location& site) {
  static_assert(std::is_standard_layout_v<T> && sizeof(T) <= sizeof(uint64_t));
  uint64_t bits = 0;
  std::memcpy(&bits, static_cast<const void*>(&var), sizeof(T));
  bits = sync_warp(op, mask, bits, lane_arg, width, site);
  T out;
  std::memcpy(static_cast<void*>(&out), &bits, sizeof(T));
  return out;
}

}  // namespace relpos_emu::detail

// One overload per type CUDA's sm_30_intrinsics.h, cuda_fp16.h and cuda_bf16.h provide, so that
// overload resolution (and its ambiguities) match nvcc's.
#define RELPOS_EMU_SHUFFLES(T)                                                                  \
  inline T __shfl_sync(unsigned mask, T var, int src_lane, int width = warpSize,              \
                       const std::source_location& site = std::source_location::current()) {  \
    return relpos_emu::detail::shuffle(relpos_emu::detail::WarpOp::kShflIdx, mask, var,       \
                                       src_lane, width, site);                                \
  }                                                                                            \
  inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize,         \
                          const std::source_location& site = std::source_location::current()) { \
    return relpos_emu::detail::shuffle(relpos_emu::detail::WarpOp::kShflUp, mask, var,        \
                                       static_cast<int>(delta), width, site);                 \
  }                                                                                            \
  inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize,       \
                            const std::source_location& site =                                \
                                std::source_location::current()) {                            \
    return relpos_emu::detail::shuffle(relpos_emu::detail::WarpOp::kShflDown, mask, var,      \
                                       static_cast<int>(delta), width, site);                 \
  }                                                                                            \
  inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize,         \
                           const std::source_location& site = std::source_location::current()) { \
    return relpos_emu::detail::shuffle(relpos_emu::detail::WarpOp::kShflXor, mask, var,       \
                                       lane_mask, width, site);                               \
  }

RELPOS_EMU_SHUFFLES(int)
RELPOS_EMU_SHUFFLES(unsigned int)
RELPOS_EMU_SHUFFLES(long)
RELPOS_EMU_SHUFFLES(unsigned long)
RELPOS_EMU_SHUFFLES(long long)
RELPOS_EMU_SHUFFLES(unsigned long long)
RELPOS_EMU_SHUFFLES(float)
RELPOS_EMU_SHUFFLES(double)
RELPOS_EMU_SHUFFLES(__half)
RELPOS_EMU_SHUFFLES(__half2)
RELPOS_EMU_SHUFFLES(__nv_bfloat16)
RELPOS_EMU_SHUFFLES(__nv_bfloat162)

#undef RELPOS_EMU_SHUFFLES
