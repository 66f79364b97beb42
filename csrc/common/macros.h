// Function qualifiers shared by host C++, nvcc and the CUDA emulator.
// RELPOS_HD marks index math that must be callable from CPU kernels, CUDA kernels and the
// emulator (which compiles the CUDA sources as plain C++, so there it is a plain function).
#pragma once

#if defined(__CUDACC__)
#define RELPOS_HD __host__ __device__ __forceinline__
#else
// `static`: internal linkage, so an AVX2 translation unit's copy can never be the one the linker
// keeps for the scalar path (an inline function is a weak symbol shared by every TU).
#define RELPOS_HD static inline
#endif
