// Kernels that test the CUDA emulator itself (tests/test_cuda_emu.py), written as ordinary CUDA
// kernels: a deliberately racy one, one per warp primitive, reductions over static and dynamic
// shared memory, out-of-bounds reads for AddressSanitizer, and synchronisation misuse.
#pragma once

#include <cstdint>

#include "cuda/mma.cuh"
#include "emu_test_kernels.h"
#include "launch.cuh"

namespace relpos_emu_test {

// ---- races -----------------------------------------------------------------------------------
// out[b*128 + t] = x[b*128 + 127 - t] through static shared memory. Without the barrier a thread
// may read its mirror's slot before the mirror wrote it (uninitialised: NaN in the emulator): the
// missing-__syncthreads() bug the emulator must make visible.
template <bool kBarrier>
__global__ void __launch_bounds__(kReverseBlock)
    reverse_in_block_kernel(const float* __restrict__ x, float* __restrict__ out) {
  __shared__ float tile[kReverseBlock];
  const int64_t base = int64_t{blockIdx.x} * kReverseBlock;
  tile[threadIdx.x] = x[base + threadIdx.x];
  if constexpr (kBarrier) __syncthreads();
  out[base + threadIdx.x] = tile[kReverseBlock - 1 - threadIdx.x];
}

// ---- block-level primitives ------------------------------------------------------------------
// Per block: the sum of its elements (tree reduction in dynamic shared memory, blockDim.x a power
// of two), the number of positive elements (__syncthreads_count), and the grand total (atomicAdd).
template <typename T>
__global__ void block_reduce_kernel(const T* __restrict__ x, int64_t n, T* __restrict__ sums,
                                    int* __restrict__ positives, T* __restrict__ total) {
  RELPOS_DYNAMIC_SMEM(T, partial);
  const unsigned t = threadIdx.x;
  const int64_t i = int64_t{blockIdx.x} * blockDim.x + t;
  const T v = i < n ? x[i] : T(0);
  partial[t] = v;
  const int count = __syncthreads_count(v > T(0));
  for (unsigned s = blockDim.x / 2; s > 0; s /= 2) {
    if (t < s) partial[t] += partial[t + s];
    __syncthreads();
  }
  if (t == 0) {
    sums[blockIdx.x] = partial[0];
    positives[blockIdx.x] = count;
    atomicAdd(total, partial[0]);
  }
}

// out[block][thread] = (blockIdx.xyz, threadIdx.xyz) for 3-D grids and blocks, to check indexing.
template <typename Index>
__global__ void index_map_kernel(Index* __restrict__ out) {
  const int64_t block = (int64_t{blockIdx.z} * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  const int64_t thread =
      (int64_t{threadIdx.z} * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
  Index* o = out + (block * blockDim.x * blockDim.y * blockDim.z + thread) * 6;
  o[0] = blockIdx.x;
  o[1] = blockIdx.y;
  o[2] = blockIdx.z;
  o[3] = threadIdx.x;
  o[4] = threadIdx.y;
  o[5] = threadIdx.z;
}

// ---- warp primitives -------------------------------------------------------------------------
// Each thread contributes x[i]; every lane writes what the primitive gave it, in segments of
// `width` lanes: butterfly sum, shfl_down tree sum, shfl_up inclusive scan, a rotation through
// __shfl_sync with source lanes past the segment (taken modulo width), and the three votes.
template <typename T>
__global__ void warp_test_kernel(const T* __restrict__ x, T* __restrict__ out, WarpTest op,
                                 int width) {
  constexpr unsigned kFull = 0xffffffffu;
  const int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const int lane = static_cast<int>(threadIdx.x % warpSize);
  T v = x[i];
  switch (op) {
    case WarpTest::kXorSum:
      for (int m = width / 2; m > 0; m /= 2) v += __shfl_xor_sync(kFull, v, m, width);
      break;
    case WarpTest::kDownSum:
      for (int d = width / 2; d > 0; d /= 2) v += __shfl_down_sync(kFull, v, d, width);
      break;
    case WarpTest::kUpScan:
      for (int d = 1; d < width; d *= 2) {
        const T up = __shfl_up_sync(kFull, v, d, width);
        if (lane % width >= d) v += up;
      }
      break;
    case WarpTest::kIdxRotate:
      v = __shfl_sync(kFull, v, lane * 3 + 1, width);
      break;
    case WarpTest::kBallot:
      v = static_cast<T>(__popc(__ballot_sync(kFull, v > T(0))));
      break;
    case WarpTest::kAny:
      v = static_cast<T>(__any_sync(kFull, v > T(0)));
      break;
    case WarpTest::kAll:
      v = static_cast<T>(__all_sync(kFull, v > T(0)));
      break;
  }
  out[i] = v;
}

// ---- half precision --------------------------------------------------------------------------
// out = float(half(x)) or float(bfloat16(x)), rounding to nearest even.
template <bool kBFloat16>
__global__ void round_trip_kernel(const float* __restrict__ x, float* __restrict__ out, int64_t n) {
  const int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (i >= n) return;
  if constexpr (kBFloat16) {
    out[i] = __bfloat162float(__float2bfloat16_rn(x[i]));
  } else {
    out[i] = __half2float(__float2half_rn(x[i]));
  }
}

// ---- tensor cores ----------------------------------------------------------------------------
// Warp w: d[w] += a[w] b[w] by one mma_16816, the fragments read element by element as the PTX
// ISA places them (lane = 4 g + t; a[0] = A[g][2t, 2t+1], a[1] = A[g+8][2t, 2t+1], a[2] =
// A[g][2t+8, 2t+9], a[3] = A[g+8][2t+8, 2t+9]; b[0] = B[2t, 2t+1][g], b[1] = B[2t+8, 2t+9][g];
// d[0], d[1] = D[g][2t, 2t+1], d[2], d[3] = D[g+8][2t, 2t+1]), not with mma.cuh's loaders.
template <typename T>
__global__ void mma_test_kernel(const uint16_t* __restrict__ a, const uint16_t* __restrict__ b,
                                float* __restrict__ d) {
  const unsigned warp = threadIdx.x / warpSize, lane = threadIdx.x % warpSize;
  const unsigned g = lane / 4, t = lane % 4;
  const uint16_t* aw = a + warp * 256;
  const uint16_t* bw = b + warp * 128;
  float* dw = d + warp * 128;
  const auto pair = [](uint16_t lo, uint16_t hi) {
    return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
  };
  const auto a_at = [&](unsigned r, unsigned c) {
    return pair(aw[r * 16 + c], aw[r * 16 + c + 1]);
  };
  const auto b_at = [&](unsigned k, unsigned n) {
    return pair(bw[k * 8 + n], bw[(k + 1) * 8 + n]);
  };
  const uint32_t af[4] = {a_at(g, 2 * t), a_at(g + 8, 2 * t), a_at(g, 2 * t + 8),
                          a_at(g + 8, 2 * t + 8)};
  const uint32_t bf[2] = {b_at(2 * t, g), b_at(2 * t + 8, g)};
  float acc[4] = {dw[g * 8 + 2 * t], dw[g * 8 + 2 * t + 1], dw[(g + 8) * 8 + 2 * t],
                  dw[(g + 8) * 8 + 2 * t + 1]};
  relpos::cuda::mma_16816<T>(acc, af, bf);
  dw[g * 8 + 2 * t] = acc[0];
  dw[g * 8 + 2 * t + 1] = acc[1];
  dw[(g + 8) * 8 + 2 * t] = acc[2];
  dw[(g + 8) * 8 + 2 * t + 1] = acc[3];
}

// ---- memory errors for AddressSanitizer ------------------------------------------------------
// One block of 64 threads; the last thread reads one element past the end of `x` (n elements),
// of a static shared array or of the dynamic shared memory (64 floats).
template <OobMemory kMemory>
__global__ void __launch_bounds__(kOobBlock)
    oob_read_kernel(const float* __restrict__ x, int64_t n, float* __restrict__ out) {
  __shared__ float tile[kOobBlock];
  RELPOS_DYNAMIC_SMEM(float, dynamic_tile);
  const unsigned t = threadIdx.x;
  tile[t] = x[t];
  dynamic_tile[t] = x[t];
  __syncthreads();
  const bool last = t == kOobBlock - 1;
  switch (kMemory) {
    case OobMemory::kGlobal:
      out[t] = x[last ? n : t];
      break;
    case OobMemory::kStaticShared:
      out[t] = tile[t + (last ? 1 : 0)];
      break;
    case OobMemory::kDynamicShared:
      out[t] = dynamic_tile[t + (last ? 1 : 0)];
      break;
  }
}

// ---- synchronisation misuse (each must be reported, not hang) --------------------------------
template <Misuse kMisuse>
__global__ void misuse_kernel(float* __restrict__ out) {
  const unsigned t = threadIdx.x;
  float v = static_cast<float>(t);
  switch (kMisuse) {
    case Misuse::kEarlyExit:
      if (t % 2 == 1) return;
      __syncthreads();
      break;
    case Misuse::kTwoBarriers:
      if (t < blockDim.x / 2) {
        __syncthreads();
      } else {
        __syncthreads();
      }
      break;
    case Misuse::kWarpVsBlock:
      if (t % warpSize < 16) {
        __syncwarp();
      } else {
        __syncthreads();
      }
      break;
    case Misuse::kMaskExcludesLane:
      v = __shfl_sync(0x1u, v, 0);
      break;
    case Misuse::kBadWidth:
      v = __shfl_xor_sync(0xffffffffu, v, 1, 3);
      break;
    case Misuse::kMmaDivergent:
      if (t % warpSize < 16) {
        float acc[4] = {};
        const uint32_t af[4] = {}, bf[2] = {};
        relpos::cuda::mma_16816<__nv_bfloat16>(acc, af, bf);
        v = acc[0];
      } else {
        __syncwarp();
      }
      break;
  }
  out[t] = v;
}

}  // namespace relpos_emu_test
