// The emulator's execution model and the interface between the inline kernel-side code (sync.h,
// launch.h) and the runtime in tests/cuda_emu/src. Kernel code uses the CUDA names, not these.
//
// Execution model. A launch runs its blocks one after another on the calling OS thread, in a
// seeded pseudo-random order. The threads of the running block are cooperative fibers. A thread
// runs uninterrupted until it reaches a synchronisation point (__syncthreads*, __syncwarp, a
// shuffle, a vote or a warp_collective) or returns; the threads that are ready run one after
// another in a freshly shuffled order. __syncthreads() releases when every thread of the block
// has arrived at it; a warp operation releases when every non-exited lane in its mask has arrived
// at the same operation with the same mask (the PTX rule for shfl.sync, vote.sync and
// bar.warp.sync). A kernel that misses a barrier therefore reads values that depend on the seed,
// which is what the tests look for.
//
// Reported as std::runtime_error from the launch (a RuntimeError in Python), never a hang:
//   - a __syncthreads() that not every thread reaches: some exited, or some wait at another
//     __syncthreads() call site or at a warp operation that cannot complete;
//   - a warp operation whose mask excludes the calling lane, or a shuffle width that is not a
//     power of two in [1, 32];
//   - a launch configuration that CUDA rejects (block or grid too large, too much shared memory).
// Values CUDA leaves undefined are poisoned so that using them shows: dynamic shared memory starts
// as 0xff bytes (NaN in every floating-point type) and a shuffle that reads an exited or
// non-participating lane returns all-ones bits.
//
// The seed of the schedule: set_seed(s) with s >= 0 when called, otherwise the environment
// variable RELPOS_EMU_SEED (read at every launch), otherwise 0. Same seed, same results.
#pragma once

#include <cstddef>
#include <cstdint>
#include <source_location>

#include <vector_types.h>

inline constexpr int warpSize = 32;

namespace relpos_emu {

void set_seed(int64_t seed);  // seed < 0 clears the override: RELPOS_EMU_SEED applies again
int64_t seed_override();      // the seed given to set_seed, -1 when none

namespace detail {

// What CUDA's builtin variables read. The scheduler rewrites it before it resumes a thread.
struct ThreadContext {
  uint3 thread_idx;
  uint3 block_idx;
  dim3 block_dim;
  dim3 grid_dim;
  void* dynamic_smem;  // this block's dynamic shared memory, exactly as many bytes as launched
};
extern ThreadContext g_current;

inline const ThreadContext& current() { return g_current; }

// Yield points; called from inside a kernel thread (fiber) only.
enum class BlockSync : uint8_t { kSync, kCount, kAnd, kOr };
int sync_block(BlockSync op, int predicate, const std::source_location& site);

enum class WarpOp : uint8_t {
  kSync, kShflIdx, kShflUp, kShflDown, kShflXor, kBallot, kAny, kAll, kCollective
};
// `value` carries a shuffled value's bits or a vote's predicate; returns the shuffled bits, the
// ballot mask or the vote's result.
uint64_t sync_warp(WarpOp op, unsigned mask, uint64_t value, int lane_arg, int width,
                   const std::source_location& site);

// A warp operation whose result one function computes for all its lanes (relpos_emu::
// warp_collective in sync.h): args[l] is lane l's argument for the lanes of `group` (the lanes of
// the mask that had not exited), nullptr for the others. It runs on the scheduler's stack while
// the lanes wait, so it must not throw or reach a yield point.
using WarpCollective = void (*)(void* const* args, uint32_t group);
void warp_collective(unsigned mask, WarpCollective complete, void* arg,
                     const std::source_location& site);

// A launch, type-erased: `run(closure)` runs the kernel body for the current thread; `entry` is the
// __global__ function, named in error messages.
struct Kernel {
  void (*run)(const void* closure);
  const void* closure;
  const void* entry;
};
void run_grid(const Kernel& kernel, dim3 grid, dim3 block, size_t smem_bytes);

}  // namespace detail

// The running block's dynamic shared memory (RELPOS_DYNAMIC_SMEM in launch.cuh): a fresh heap
// buffer of the launch's size per block, so that AddressSanitizer sees an overflow.
inline void* dynamic_smem() { return detail::current().dynamic_smem; }

}  // namespace relpos_emu

#define threadIdx (::relpos_emu::detail::current().thread_idx)
#define blockIdx (::relpos_emu::detail::current().block_idx)
#define blockDim (::relpos_emu::detail::current().block_dim)
#define gridDim (::relpos_emu::detail::current().grid_dim)
