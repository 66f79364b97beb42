// What a completed warp operation returns to each lane, following the PTX ISA's definitions of
// shfl.sync and vote.sync (the instructions behind __shfl_*_sync and __ballot/__any/__all_sync).
#pragma once

#include <cstdint>

#include "relpos_cuda_emu/runtime.h"

namespace relpos_emu::detail {

inline bool is_shuffle(WarpOp op) {
  return op == WarpOp::kShflIdx || op == WarpOp::kShflUp || op == WarpOp::kShflDown ||
         op == WarpOp::kShflXor;
}

inline bool is_valid_shuffle_width(int width) {
  return width >= 1 && width <= 32 && (width & (width - 1)) == 0;
}

// The lane whose value `lane` receives from __shfl*_sync(mask, var, lane_arg, width). CUDA passes
// c = ((32 - width) << 8) | (up ? 0 : 31) to shfl.sync, whose pseudocode is:
//   segmask = c[12:8], maxLane = (lane & segmask) | (c[4:0] & ~segmask), minLane = lane & segmask
//   up:   j = lane - b,                          ok = j >= maxLane
//   down: j = lane + b,                          ok = j <= maxLane
//   bfly: j = lane ^ b,                          ok = j <= maxLane
//   idx:  j = minLane | (b[4:0] & ~segmask),     ok = j <= maxLane
//   a lane for which !ok reads its own value.
// Hence a lane never reads a later segment, while __shfl_xor_sync may read an earlier one.
inline int shuffle_source_lane(WarpOp op, int lane, int lane_arg, int width) {
  const int b = lane_arg & 31;
  const int segmask = (32 - width) & 31;
  const int clamp = op == WarpOp::kShflUp ? 0 : 31;
  const int max_lane = (lane & segmask) | (clamp & ~segmask);
  const int min_lane = lane & segmask;
  int j = lane;
  bool ok = false;
  switch (op) {
    case WarpOp::kShflUp:
      j = lane - b;
      ok = j >= max_lane;
      break;
    case WarpOp::kShflDown:
      j = lane + b;
      ok = j <= max_lane;
      break;
    case WarpOp::kShflXor:
      j = lane ^ b;
      ok = j <= max_lane;
      break;
    case WarpOp::kShflIdx:
      j = min_lane | (b & ~segmask);
      ok = j <= max_lane;
      break;
    default:
      break;
  }
  return ok ? j : lane;
}

// Bits a shuffle returns when its source lane has exited or does not take part: PTX leaves the
// value undefined; all ones is a NaN in every floating-point type, so misuse shows in results.
inline constexpr uint64_t kUndefinedBits = ~uint64_t{0};

inline const char* warp_op_name(WarpOp op) {
  switch (op) {
    case WarpOp::kSync: return "__syncwarp";
    case WarpOp::kShflIdx: return "__shfl_sync";
    case WarpOp::kShflUp: return "__shfl_up_sync";
    case WarpOp::kShflDown: return "__shfl_down_sync";
    case WarpOp::kShflXor: return "__shfl_xor_sync";
    case WarpOp::kBallot: return "__ballot_sync";
    case WarpOp::kAny: return "__any_sync";
    case WarpOp::kAll: return "__all_sync";
    case WarpOp::kCollective: return "warp_collective";
  }
  return "?";
}

inline const char* block_sync_name(BlockSync op) {
  switch (op) {
    case BlockSync::kSync: return "__syncthreads";
    case BlockSync::kCount: return "__syncthreads_count";
    case BlockSync::kAnd: return "__syncthreads_and";
    case BlockSync::kOr: return "__syncthreads_or";
  }
  return "?";
}

}  // namespace relpos_emu::detail
