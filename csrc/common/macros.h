// Function qualifiers shared by host C++, nvcc and the CUDA emulator.
// RELPOS_HD marks index math that must be callable from CPU kernels, CUDA kernels and the
// emulator (which compiles the CUDA sources as plain C++, so there it is just `inline`).
#pragma once

#if defined(__CUDACC__)
#define RELPOS_HD __host__ __device__ __forceinline__
#else
#define RELPOS_HD inline
#endif
