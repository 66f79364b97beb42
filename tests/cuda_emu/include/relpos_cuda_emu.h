// CUDA as host C++: the emulator that runs the kernels of csrc/cuda on the CPU for the tests
// (DESIGN.md §4). Kernel headers (*.cuh) and launchers (*.cu) compile unchanged with
// `g++ -x c++ -DRELPOS_CUDA_EMU`; csrc/cuda/launch.cuh includes this header in that mode.
//
// What kernel code may use (anything else is a compile error here, which is the point):
//   qualifiers   __global__ __device__ __host__ __forceinline__ __restrict__ __launch_bounds__(...)
//                __align__(n) __constant__; __shared__ for static shared memory and
//                RELPOS_DYNAMIC_SMEM(T, name) (launch.cuh) for dynamic shared memory
//   builtins     threadIdx blockIdx blockDim gridDim warpSize                  (runtime.h)
//   block sync   __syncthreads() __syncthreads_count/_and/_or(pred)            (sync.h)
//   warp         __syncwarp(mask) __shfl_sync __shfl_up_sync __shfl_down_sync
//                __shfl_xor_sync __ballot_sync __any_sync __all_sync           (sync.h)
//   device fns   atomics, fences, __ldg, bit tricks, fast math, min/max       (device_functions.h)
//   math         the C math library (expf, logf, fmaxf, INFINITY, ...)
//   types        dim3 uint3 float2/float4/... __half __half2 __nv_bfloat16 __nv_bfloat162 and their
//                conversions (__float2half_rn, __bfloat162float, ...): the CUDA headers' own host
//                code, included below.
// Not provided: inline PTX, __CUDA_ARCH__ (undefined here, so arch-specific branches take their
// generic path), __noinline__ (libstdc++ uses that name inside __attribute__), __activemask()
// (convergence is not modelled), cooperative groups. See tests/cuda_emu/README.md.
#pragma once

#if defined(__CUDACC__)
#error "relpos_cuda_emu.h emulates CUDA for host compilers; nvcc compiles the kernels natively"
#endif

// cuda_fp16.h and cuda_bf16.h compile with g++ and give their host implementations; through
// crt/host_defines.h they also define __host__ __device__ __global__ __constant__ as nothing and
// __forceinline__ and __align__ as GCC attributes, and vector_types.h gives dim3, uint3, float4...
#include <cuda_bf16.h>
#include <cuda_fp16.h>

// Static shared memory: blocks run one at a time (runtime.h), so one function-static array is the
// shared memory of whichever block is running. Before each block the runtime fills the kernel's
// own static __shared__ arrays with 0xff bytes, as uninitialised memory (src/kernel_symbols.h).
// `extern __shared__` does not compile: dynamic shared memory goes through RELPOS_DYNAMIC_SMEM.
#undef __shared__
#define __shared__ static
#define __launch_bounds__(...)

#if defined(__SANITIZE_ADDRESS__)
// GCC gives no redzones to the statics of functions with vague linkage (templates, inline), which
// is what a kernel's __shared__ arrays are. Under AddressSanitizer kernels therefore get internal
// linkage, so that an overflow of static shared memory is reported too. Kernels must not be
// explicitly instantiated, which a storage class forbids; launchers just call them.
#undef __global__
#define __global__ static
#endif

#include "relpos_cuda_emu/runtime.h"
#include "relpos_cuda_emu/sync.h"
#include "relpos_cuda_emu/device_functions.h"
#include "relpos_cuda_emu/launch.h"
