// run_grid: check the launch configuration as CUDA would, then run the blocks one after another
// in a seeded order under the BlockScheduler, each with fresh (uninitialised: 0xff bytes) dynamic
// and static shared memory.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <numeric>
#include <stdexcept>
#include <string>

#include "block_scheduler.h"
#include "diagnostics.h"
#include "kernel_symbols.h"
#include "relpos_cuda_emu/runtime.h"
#include "seed.h"

namespace relpos_emu::detail {

namespace {

// Limits of compute capabilities 8.0 and 9.0 (CUDA C++ Programming Guide, "Technical
// Specifications per Compute Capability").
constexpr uint64_t kMaxThreadsPerBlock = 1024;
constexpr unsigned kMaxBlockDimXY = 1024;
constexpr unsigned kMaxBlockDimZ = 64;
constexpr unsigned kMaxGridDimX = 0x7fffffffu;
constexpr unsigned kMaxGridDimYZ = 65535;
// The most dynamic shared memory a block can opt into: 163 KiB on sm_80, 227 KiB on sm_90. The
// project builds for both, so the smaller one is the limit.
constexpr size_t kMaxDynamicSmemBytes = 163 * 1024;

thread_local bool t_in_grid = false;

struct InGridGuard {
  InGridGuard() { t_in_grid = true; }
  ~InGridGuard() { t_in_grid = false; }
};

[[noreturn]] void invalid_configuration(const std::string& why) {
  throw std::runtime_error("relpos CUDA launch failed: invalid configuration argument: " + why);
}

void check_configuration(dim3 grid, dim3 block, size_t smem_bytes) {
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  if (threads == 0 || threads > kMaxThreadsPerBlock || block.x > kMaxBlockDimXY ||
      block.y > kMaxBlockDimXY || block.z > kMaxBlockDimZ) {
    invalid_configuration("block " + format_dim(block) + " (at most (1024, 1024, 64) and 1024 " +
                          "threads, at least 1)");
  }
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > kMaxGridDimX ||
      grid.y > kMaxGridDimYZ || grid.z > kMaxGridDimYZ) {
    invalid_configuration("grid " + format_dim(grid) + " (at most (2^31 - 1, 65535, 65535))");
  }
  if (smem_bytes > kMaxDynamicSmemBytes) {
    invalid_configuration(std::to_string(smem_bytes) + " bytes of dynamic shared memory (at most " +
                          std::to_string(kMaxDynamicSmemBytes) + " on sm_80)");
  }
}

// Shared memory is uninitialised on the device; 0xff bytes are a NaN in every floating-point
// type, so reading it before writing shows. Allocated with exactly the launch's size so that
// AddressSanitizer reports an overflow. (Static shared memory is poisoned the same way, through
// kernel_symbols.)
std::unique_ptr<void, decltype(&std::free)> allocate_dynamic_smem(size_t bytes) {
  void* p = nullptr;
  if (posix_memalign(&p, 16, bytes) != 0) throw std::bad_alloc();
  std::memset(p, 0xff, bytes);
  return {p, &std::free};
}

}  // namespace

void run_grid(const Kernel& kernel, dim3 grid, dim3 block, size_t smem_bytes) {
  if (t_in_grid) {
    throw std::runtime_error(
        "relpos CUDA emulator: a kernel launched another kernel (dynamic parallelism is not "
        "emulated)");
  }
  check_configuration(grid, block, smem_bytes);

  // One grid at a time: __shared__ variables (function statics) and g_current are process-wide.
  static std::mutex mutex;
  const std::lock_guard lock(mutex);
  static BlockScheduler scheduler;  // keeps its fiber stacks from launch to launch
  const InGridGuard in_grid;
  const KernelSymbols& symbols = kernel_symbols(kernel.entry);

  Rng rng(launch_seed());
  // Blocks in a seeded order: k -> (stride * k + offset) mod n is a permutation of [0, n) when
  // stride and n are coprime. Not uniform over all orders, but it breaks any assumption that
  // block b runs before block b + 1.
  const uint64_t num_blocks = uint64_t{grid.x} * grid.y * grid.z;
  uint64_t stride = 1;
  uint64_t offset = 0;
  if (num_blocks > 1) {
    do {
      stride = 1 + rng.below(num_blocks - 1);
    } while (std::gcd(stride, num_blocks) != 1);
    offset = rng.below(num_blocks);
  }

  g_current.grid_dim = grid;
  g_current.block_dim = block;
  for (uint64_t k = 0; k < num_blocks; ++k) {
    const uint64_t b =
        static_cast<uint64_t>((static_cast<unsigned __int128>(stride) * k + offset) % num_blocks);
    g_current.block_idx = uint3{static_cast<unsigned>(b % grid.x),
                                static_cast<unsigned>(b / grid.x % grid.y),
                                static_cast<unsigned>(b / (uint64_t{grid.x} * grid.y))};
    const auto smem = allocate_dynamic_smem(smem_bytes);
    g_current.dynamic_smem = smem.get();
    for (const StaticArray& array : symbols.static_smem) {
      std::memset(array.address, 0xff, array.bytes);
    }
    try {
      scheduler.run(kernel, block, rng);
    } catch (const std::exception& e) {
      g_current.dynamic_smem = nullptr;
      throw std::runtime_error("relpos CUDA emulator: kernel " + symbols.name +
                               ", block " + format_index(g_current.block_idx) + ": " + e.what());
    }
  }
  g_current.dynamic_smem = nullptr;
}

}  // namespace relpos_emu::detail
