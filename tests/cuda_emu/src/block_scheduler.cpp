#include "block_scheduler.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <map>
#include <numeric>
#include <stdexcept>
#include <tuple>

#include "diagnostics.h"
#include "warp_semantics.h"

namespace relpos_emu::detail {

ThreadContext g_current{};

namespace {

constexpr unsigned kLanes = 32;

// The scheduler whose block is running. Not thread_local (whose access from a shared library costs
// a call per use): run_grid lets one grid run at a time in the whole process.
BlockScheduler* g_running = nullptr;

// Thrown at a yield point to unwind a thread of a block that failed, so that its stack is left
// cleanly; deliberately not a std::exception, so kernel code cannot catch it by accident.
struct FiberAbort {};

bool same_site(const std::source_location& a, const std::source_location& b) {
  return a.line() == b.line() && a.column() == b.column() &&
         (a.file_name() == b.file_name() || std::strcmp(a.file_name(), b.file_name()) == 0);
}

struct RunningGuard {
  explicit RunningGuard(BlockScheduler* s) { g_running = s; }
  ~RunningGuard() { g_running = nullptr; }
};

}  // namespace

BlockScheduler& BlockScheduler::running(const char* what, const std::source_location& site) {
  if (g_running == nullptr) {
    throw std::logic_error(std::string("relpos CUDA emulator: ") + what + "() at " +
                           format_site(site) + " called outside a kernel");
  }
  return *g_running;
}

int sync_block(BlockSync op, int predicate, const std::source_location& site) {
  return BlockScheduler::running(block_sync_name(op), site).sync_block(op, predicate, site);
}

uint64_t sync_warp(WarpOp op, unsigned mask, uint64_t value, int lane_arg, int width,
                   const std::source_location& site) {
  return BlockScheduler::running(warp_op_name(op), site)
      .sync_warp(op, mask, value, lane_arg, width, site);
}

void warp_collective(unsigned mask, WarpCollective complete, void* arg,
                     const std::source_location& site) {
  BlockScheduler::running(warp_op_name(WarpOp::kCollective), site)
      .sync_warp(WarpOp::kCollective, mask, reinterpret_cast<uintptr_t>(arg), 0, kLanes, site,
                 complete);
}

void BlockScheduler::run(const Kernel& kernel, dim3 block_dim, Rng& rng) {
  kernel_ = &kernel;
  num_threads_ = block_dim.x * block_dim.y * block_dim.z;
  const unsigned num_warps = (num_threads_ + kLanes - 1) / kLanes;
  threads_.resize(num_threads_);
  while (fibers_.size() < num_threads_) {
    fibers_.push_back(std::make_unique<Fiber>(kFiberStackBytes));
  }
  warp_marked_.assign(num_warps, 0);
  marked_warps_.clear();
  for (unsigned t = 0; t < num_threads_; ++t) {
    Thread& th = threads_[t];
    th = Thread{};
    th.idx = uint3{t % block_dim.x, (t / block_dim.x) % block_dim.y,
                   t / (block_dim.x * block_dim.y)};
    th.state = State::kReady;
  }
  ready_.resize(num_threads_);
  std::iota(ready_.begin(), ready_.end(), 0u);
  num_done_ = 0;
  num_at_block_sync_ = 0;
  aborting_ = false;
  error_ = nullptr;

  const RunningGuard guard(this);
  for (;;) {
    // One phase: every ready thread runs, in a fresh random order, to its next yield point.
    rng.shuffle(ready_.data(), ready_.size());
    for (const unsigned t : ready_) {
      if (error_) break;
      resume(t);
    }
    ready_.clear();
    if (error_) {
      std::string what = "unknown exception";
      try {
        std::rethrow_exception(error_);
      } catch (const std::exception& e) {
        what = e.what();
      } catch (...) {
      }
      fail("thread " + format_index(threads_[error_thread_].idx) + ": " + what);
    }
    if (num_done_ == num_threads_) return;
    release_warps();
    if (ready_.empty()) release_block_barrier();
  }
}

void BlockScheduler::thread_entry(void* self) {
  static_cast<BlockScheduler*>(self)->run_current_thread();
}

void BlockScheduler::run_current_thread() {
  const unsigned t = current_;
  try {
    kernel_->run(kernel_->closure);
  } catch (const FiberAbort&) {
  } catch (...) {
    if (!error_) {
      error_ = std::current_exception();
      error_thread_ = t;
    }
  }
  threads_[t].state = State::kDone;
  ++num_done_;
  mark_warp(t / kLanes);
}

void BlockScheduler::resume(unsigned t) {
  Thread& th = threads_[t];
  current_ = t;
  g_current.thread_idx = th.idx;
  if (!th.started) {
    th.started = true;
    fibers_[t]->start(&BlockScheduler::thread_entry, this);
  }
  fibers_[t]->resume();
}

void BlockScheduler::wait(unsigned t) {
  fibers_[t]->suspend();
  if (aborting_) throw FiberAbort{};
}

int BlockScheduler::sync_block(BlockSync op, int predicate, const std::source_location& site) {
  const unsigned t = current_;
  if (aborting_) throw FiberAbort{};
  Thread& th = threads_[t];
  th.state = State::kBlockSync;
  th.block_op = op;
  th.value = predicate != 0;
  th.site = site;
  ++num_at_block_sync_;
  wait(t);
  return static_cast<int>(th.result);
}

uint64_t BlockScheduler::sync_warp(WarpOp op, unsigned mask, uint64_t value, int lane_arg,
                                   int width, const std::source_location& site,
                                   WarpCollective collective) {
  const unsigned t = current_;
  if (aborting_) throw FiberAbort{};
  const unsigned lane = t % kLanes;
  if (((mask >> lane) & 1u) == 0) {
    throw std::runtime_error(std::string(warp_op_name(op)) + "(mask " + format_mask(mask) +
                             ") at " + format_site(site) + " is called by lane " +
                             std::to_string(lane) + ", which its mask excludes");
  }
  if (is_shuffle(op) && !is_valid_shuffle_width(width)) {
    throw std::runtime_error(std::string(warp_op_name(op)) + " at " + format_site(site) +
                             ": width " + std::to_string(width) +
                             " is not a power of two in [1, 32]");
  }
  Thread& th = threads_[t];
  th.state = State::kWarpOp;
  th.warp_op = op;
  th.mask = mask;
  th.value = value;
  th.collective = collective;
  th.lane_arg = lane_arg;
  th.width = width;
  th.site = site;
  mark_warp(t / kLanes);
  wait(t);
  return th.result;
}

void BlockScheduler::mark_warp(unsigned warp) {
  if (!warp_marked_[warp]) {
    warp_marked_[warp] = 1;
    marked_warps_.push_back(warp);
  }
}

void BlockScheduler::release_warps() {
  for (const unsigned w : marked_warps_) {
    warp_marked_[w] = 0;
    release_warp(w);
  }
  marked_warps_.clear();
}

// A warp operation completes when every non-exited lane of its mask waits at the same operation
// with the same mask (for a collective, the same function); lanes that exited are not waited for
// (PTX: "all non-exited threads").
void BlockScheduler::release_warp(unsigned warp) {
  const unsigned base = warp * kLanes;
  const unsigned lanes = std::min(kLanes, num_threads_ - base);
  uint32_t alive = 0;
  uint32_t waiting = 0;
  for (unsigned l = 0; l < lanes; ++l) {
    const State s = threads_[base + l].state;
    if (s != State::kDone) alive |= 1u << l;
    if (s == State::kWarpOp) waiting |= 1u << l;
  }
  uint32_t pending = waiting;
  while (pending != 0) {
    const Thread& first = threads_[base + std::countr_zero(pending)];
    uint32_t same = 0;
    for (uint32_t m = pending; m != 0; m &= m - 1) {
      const unsigned l = std::countr_zero(m);
      const Thread& th = threads_[base + l];
      if (th.warp_op == first.warp_op && th.mask == first.mask &&
          th.collective == first.collective) {
        same |= 1u << l;
      }
    }
    pending &= ~same;
    const uint32_t group = first.mask & alive;
    if (same == group) complete_warp_op(base, group);
  }
}

void BlockScheduler::complete_warp_op(unsigned base, uint32_t group) {
  const Thread& first = threads_[base + std::countr_zero(group)];
  const WarpOp op = first.warp_op;
  if (op == WarpOp::kCollective) {
    void* args[kLanes] = {};
    for (uint32_t m = group; m != 0; m &= m - 1) {
      const unsigned l = std::countr_zero(m);
      args[l] = reinterpret_cast<void*>(static_cast<uintptr_t>(threads_[base + l].value));
    }
    first.collective(args, group);
  }
  uint32_t ballot = 0;
  for (uint32_t m = group; m != 0; m &= m - 1) {
    const unsigned l = std::countr_zero(m);
    if (threads_[base + l].value != 0) ballot |= 1u << l;
  }
  for (uint32_t m = group; m != 0; m &= m - 1) {
    const unsigned l = std::countr_zero(m);
    Thread& th = threads_[base + l];
    switch (op) {
      case WarpOp::kSync:
      case WarpOp::kCollective:
        th.result = 0;
        break;
      case WarpOp::kBallot:
        th.result = ballot;
        break;
      case WarpOp::kAny:
        th.result = ballot != 0;
        break;
      case WarpOp::kAll:
        th.result = ballot == group;
        break;
      default: {
        const int src = shuffle_source_lane(op, static_cast<int>(l), th.lane_arg, th.width);
        th.result = ((group >> src) & 1u) != 0 ? threads_[base + src].value : kUndefinedBits;
      }
    }
    th.state = State::kReady;
    ready_.push_back(base + l);
  }
}

// Called when no thread can run and no warp operation can complete: either every thread waits at
// the same __syncthreads(), which then releases, or the block can never finish.
void BlockScheduler::release_block_barrier() {
  const unsigned n = num_threads_;
  if (num_at_block_sync_ == 0 || num_at_block_sync_ + num_done_ != n) {
    fail("deadlock, no thread can continue: " + describe_waits());
  }
  const Thread& first = threads_[0].state == State::kBlockSync
                            ? threads_[0]
                            : *std::find_if(threads_.begin(), threads_.end(), [](const Thread& th) {
                                return th.state == State::kBlockSync;
                              });
  const std::string barrier =
      std::string(block_sync_name(first.block_op)) + "() at " + format_site(first.site);
  if (num_done_ != 0) {
    unsigned exited = 0;
    while (threads_[exited].state != State::kDone) ++exited;
    fail(barrier + " is not reached by every thread of the block: " + std::to_string(num_done_) +
         " of " + std::to_string(n) + " threads exited without reaching it (e.g. thread " +
         format_index(threads_[exited].idx) +
         "); CUDA requires every thread of a block to reach the same __syncthreads()");
  }
  uint64_t count = 0;
  for (const Thread& th : threads_) {
    if (th.block_op != first.block_op || !same_site(th.site, first.site)) {
      fail("divergent __syncthreads(): threads of one block wait at different barriers: " +
           describe_waits());
    }
    count += th.value;
  }
  uint64_t result = 0;
  switch (first.block_op) {
    case BlockSync::kSync: break;
    case BlockSync::kCount: result = count; break;
    case BlockSync::kAnd: result = count == n; break;
    case BlockSync::kOr: result = count != 0; break;
  }
  for (unsigned t = 0; t < n; ++t) {
    threads_[t].result = result;
    threads_[t].state = State::kReady;
    ready_.push_back(t);
  }
  num_at_block_sync_ = 0;
}

// "128 threads at __syncthreads() at k.cuh:40 (e.g. thread (0, 0, 0)); 32 exited ..."
std::string BlockScheduler::describe_waits() const {
  std::map<std::tuple<int, std::string>, std::pair<unsigned, unsigned>> groups;  // -> count, first
  for (unsigned t = 0; t < num_threads_; ++t) {
    const Thread& th = threads_[t];
    std::string where;
    switch (th.state) {
      case State::kBlockSync:
        where = "at " + std::string(block_sync_name(th.block_op)) + "() at " + format_site(th.site);
        break;
      case State::kWarpOp:
        where = "at " + std::string(warp_op_name(th.warp_op)) + "(mask " + format_mask(th.mask) +
                ") at " + format_site(th.site);
        break;
      case State::kDone:
        where = "exited";
        break;
      case State::kReady:
        where = "ready";
        break;
    }
    auto [it, inserted] = groups.try_emplace({static_cast<int>(th.state), where}, 0u, t);
    ++it->second.first;
  }
  std::string out;
  for (const auto& [key, value] : groups) {
    if (!out.empty()) out += "; ";
    out += std::to_string(value.first) + " threads " + std::get<1>(key) + " (e.g. thread " +
           format_index(threads_[value.second].idx) + ")";
  }
  return out;
}

void BlockScheduler::fail(const std::string& message) {
  // Unwind every suspended thread (FiberAbort from its yield point) so no stack is left mid-call.
  aborting_ = true;
  for (unsigned t = 0; t < num_threads_; ++t) {
    if (threads_[t].started && threads_[t].state != State::kDone) resume(t);
  }
  aborting_ = false;
  throw std::runtime_error(message);
}

}  // namespace relpos_emu::detail
