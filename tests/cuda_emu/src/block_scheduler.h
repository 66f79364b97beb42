// Runs the threads of one block as fibers and implements the block's synchronisation points: the
// schedule, the barrier rules and the misuse checks described in relpos_cuda_emu/runtime.h.
#pragma once

#include <cstdint>
#include <exception>
#include <memory>
#include <source_location>
#include <string>
#include <vector>

#include "fiber.h"
#include "relpos_cuda_emu/runtime.h"
#include "seed.h"

namespace relpos_emu::detail {

class BlockScheduler {
 public:
  // Runs `kernel` for every thread of a block of `block_dim` threads; the caller has set
  // g_current's block fields. Throws std::runtime_error describing the failure (which thread,
  // which barrier) when a thread throws or the threads cannot all reach the end.
  void run(const Kernel& kernel, dim3 block_dim, Rng& rng);

  // The yield points, called on the running kernel thread.
  int sync_block(BlockSync op, int predicate, const std::source_location& site);
  uint64_t sync_warp(WarpOp op, unsigned mask, uint64_t value, int lane_arg, int width,
                     const std::source_location& site, WarpCollective collective = nullptr);

  // The scheduler whose block is running; throws if none is (a synchronisation function called
  // outside a kernel).
  static BlockScheduler& running(const char* what, const std::source_location& site);

 private:
  enum class State : uint8_t { kReady, kBlockSync, kWarpOp, kDone };

  struct Thread {
    uint3 idx;
    State state;
    bool started;
    // the synchronisation point the thread waits at
    std::source_location site;
    BlockSync block_op;
    WarpOp warp_op;
    unsigned mask;
    int lane_arg;
    int width;
    uint64_t value;   // shuffled bits, predicate, or a collective's argument
    WarpCollective collective;  // kCollective: the function that completes it
    uint64_t result;  // filled in when the barrier or warp operation releases
  };

  static void thread_entry(void* self);
  void run_current_thread();
  void resume(unsigned t);
  void wait(unsigned t);
  void mark_warp(unsigned warp);
  void release_warps();
  void release_warp(unsigned warp);
  void complete_warp_op(unsigned base, uint32_t group);
  void release_block_barrier();
  [[noreturn]] void fail(const std::string& message);
  std::string describe_waits() const;

  const Kernel* kernel_ = nullptr;
  unsigned num_threads_ = 0;
  unsigned current_ = 0;
  std::vector<Thread> threads_;
  std::vector<std::unique_ptr<Fiber>> fibers_;  // grows to the largest block, reused
  std::vector<unsigned> ready_;
  std::vector<unsigned> marked_warps_;  // warps whose lanes arrived at or left a warp operation
  std::vector<uint8_t> warp_marked_;
  unsigned num_done_ = 0;
  unsigned num_at_block_sync_ = 0;
  bool aborting_ = false;
  std::exception_ptr error_;
  unsigned error_thread_ = 0;
};

}  // namespace relpos_emu::detail
