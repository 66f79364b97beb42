// The emulator's own test kernels (emu_test_kernels.cuh): their parameters and launchers, callable
// without CUDA or torch headers. emu_test_ops.cpp exposes them as torch ops.
#pragma once

#include <cstdint>

namespace relpos_emu_test {

inline constexpr int kReverseBlock = 128;
inline constexpr int kOobBlock = 64;

enum class WarpTest : int { kXorSum, kDownSum, kUpScan, kIdxRotate, kBallot, kAny, kAll };
enum class OobMemory : int { kGlobal, kStaticShared, kDynamicShared };
enum class Misuse : int {
  kEarlyExit,         // odd threads return before a __syncthreads()
  kTwoBarriers,       // the two halves of the block wait at different __syncthreads() calls
  kWarpVsBlock,       // half of each warp at __syncwarp(), the other half at __syncthreads()
  kMaskExcludesLane,  // __shfl_sync(0x1, ...) called by every lane
  kBadWidth,          // __shfl_xor_sync(..., width = 3)
  kMmaDivergent,      // half of each warp at an mma.sync (relpos::cuda::mma_16816), half not
};

// out = x reversed within each block of kReverseBlock elements; n a multiple of kReverseBlock.
void reverse_in_block(const float* x, float* out, int64_t n, bool with_barrier);

// Per block of `block` elements (a power of two): sums[b], positives[b]; total[0] = sum of all.
void block_reduce(const float* x, int64_t n, int block, float* sums, int* positives, float* total);

// out[gz][gy][gx][bz][by][bx] = (blockIdx.xyz, threadIdx.xyz).
void index_map(int32_t* out, const int64_t grid[3], const int64_t block[3]);

// A WarpTest over x (n a multiple of `block`) in segments of `width` lanes.
template <typename T>
void warp_test(const T* x, T* out, int64_t n, int block, WarpTest op, int width);

// out = float(half(x)) or float(bfloat16(x)).
void round_trip(const float* x, float* out, int64_t n, bool bfloat16);

// relpos::cuda::mma_16816 (mma.sync m16n8k16, emulated by one warp_collective) per warp of one
// block of `block` threads: d[w] += a[w] b[w] with a [warps][16][16] and b [warps][16][8] float16
// or bfloat16 bits, d [warps][16][8]; each lane loads its fragments by the PTX ISA's layout.
void mma_test(const uint16_t* a, const uint16_t* b, float* d, int block, bool bfloat16);

// One block of kOobBlock threads reading x[0..kOobBlock) (n >= kOobBlock) and, in its last thread,
// one element past the end of `memory`; x must hold exactly n elements.
void oob_read(const float* x, int64_t n, float* out, OobMemory memory);

// Launches a kernel that misuses synchronisation; throws the emulator's report
// (std::runtime_error).
void misuse(float* out, int block, Misuse kind);

}  // namespace relpos_emu_test
