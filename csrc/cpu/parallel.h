// How the CPU backend splits work over threads (register_cpu.cpp): parallel_for, with
// at::parallel_for's contract, on one of three thread sources.
//
// torch's Linux wheels run at::parallel_for on OpenMP, and at::parallel_for is an inline template
// around `#pragma omp parallel` (ATen/ParallelOpenMP.h): it is compiled into this extension, so
// an extension built without -fopenmp runs it on one thread whatever torch.set_num_threads says.
// That is the case wherever CMake finds no OpenMP that is torch's runtime (CMakeLists.txt): clang
// without libomp headers, Apple clang, clang with LLVM's libomp (a second runtime whose spinning
// threads compete with torch's), or RELPOS_OPENMP=OFF. Such builds reach torch's OpenMP runtime
// at run time instead, through the entry point GCC's `#pragma omp parallel` compiles to
// (GOMP_parallel, found in the libgomp torch loaded), or else split the work on std::threads.
//
//   aten  at::parallel_for: torch's OpenMP threads where this file is compiled with OpenMP (or
//         torch's own pool where torch is not built on OpenMP); one thread otherwise
//   gomp  GOMP_parallel of the OpenMP runtime torch loaded: the same threads as aten's
//   std   a std::thread per chunk (the calling thread takes the first)
//
// RELPOS_CPU_THREADS=auto|aten|gomp|std picks one, read at every call (as RELPOS_CPU_ISA) so the
// tests can run the kernels on each in one process; auto (the default) is the first of aten, gomp,
// std that runs in parallel here. Every source makes the same chunks: results never depend on it.
#pragma once

#include <ATen/Parallel.h>

#include <cstdint>
#include <functional>

namespace relpos::cpu {

enum class Threads { Aten, Gomp, Std };

// The source for this call: RELPOS_CPU_THREADS if set (error if it names one that cannot run
// here), else the default.
Threads selected_threads();
const char* threads_name(Threads t);
// Whether GOMP_parallel was found in the process (the gomp source can run).
bool gomp_available();

// f(b, e) over [begin, end) in at::parallel_for's chunks: where end - begin > grain, the caller is
// not inside another split and max_threads > 1, n = min(team, ceil((end - begin) / grain)) chunks
// of ceil((end - begin) / n) items, one per thread of a team of max_threads (std) or of the
// OpenMP runtime's default size (gomp: torch's thread count); else f(begin, end) on the calling
// thread. The first exception a chunk throws is rethrown once all chunks finish.
void gomp_parallel_for(int64_t begin, int64_t end, int64_t grain, int64_t max_threads,
                       const std::function<void(int64_t, int64_t)>& f);
void thread_parallel_for(int64_t begin, int64_t end, int64_t grain, int64_t max_threads,
                         const std::function<void(int64_t, int64_t)>& f);

// Inside a chunk of any of the three sources.
bool in_parallel_region();

template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  switch (selected_threads()) {
    case Threads::Aten: at::parallel_for(begin, end, grain, f); return;
    case Threads::Gomp: gomp_parallel_for(begin, end, grain, at::get_num_threads(), f); return;
    case Threads::Std: thread_parallel_for(begin, end, grain, at::get_num_threads(), f); return;
  }
}

}  // namespace relpos::cpu
