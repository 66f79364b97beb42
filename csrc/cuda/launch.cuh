// The one way CUDA kernels are launched in this project. With nvcc it is a <<<>>> launch on the
// given stream; with RELPOS_CUDA_EMU (tests/cuda_emu) the same launcher code runs the kernel on
// the CPU through the emulator, grid and all. Kernel headers (*.cuh) include this file and use
// only what the emulator provides (DESIGN.md §4).
#pragma once

#include <cstddef>

#if defined(RELPOS_CUDA_EMU)
#include "relpos_cuda_emu.h"  // tests/cuda_emu/include: dim3, threadIdx, __syncthreads, ...
#else
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdexcept>
#include <string>
#endif

// Dynamic shared memory as a typed pointer: `RELPOS_DYNAMIC_SMEM(float, buf);`
#if defined(RELPOS_CUDA_EMU)
#define RELPOS_DYNAMIC_SMEM(T, name) T* name = reinterpret_cast<T*>(relpos_emu::dynamic_smem())
#else
#define RELPOS_DYNAMIC_SMEM(T, name)                          \
  extern __shared__ __align__(16) unsigned char relpos_smem_raw_[]; \
  T* name = reinterpret_cast<T*>(relpos_smem_raw_)
#endif

namespace relpos::cuda {

#if defined(RELPOS_CUDA_EMU)
using Stream = void*;
#else
using Stream = cudaStream_t;
#endif

// Launch `kernel<<<grid, block, smem_bytes, stream>>>(args...)`; throws std::runtime_error with the
// CUDA error string if the launch fails (the torch glue turns it into a RuntimeError).
template <typename... KArgs, typename... Args>
inline void launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem_bytes,
                   Stream stream, Args... args) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return;  // empty problem: nothing to run
#if defined(RELPOS_CUDA_EMU)
  (void)stream;
  relpos_emu::launch(kernel, grid, block, smem_bytes, static_cast<KArgs>(args)...);
#else
  if (smem_bytes > 48 * 1024) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                         static_cast<int>(smem_bytes));
  }
  kernel<<<grid, block, smem_bytes, stream>>>(static_cast<KArgs>(args)...);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("relpos CUDA launch failed: ") + cudaGetErrorString(err));
  }
#endif
}

}  // namespace relpos::cuda
