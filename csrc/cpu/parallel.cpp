// The thread sources of parallel.h: gomp (torch's OpenMP runtime reached at run time) and std
// (a std::thread per chunk), and the choice between them and at::parallel_for.
#include "cpu/parallel.h"

#include "common/env.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <dlfcn.h>
#endif

namespace relpos::cpu {
namespace {

thread_local bool t_in_region = false;

struct RegionGuard {
  bool saved = t_in_region;
  RegionGuard() { t_in_region = true; }
  ~RegionGuard() { t_in_region = saved; }
};

// at::parallel_for is parallel where this file is compiled with OpenMP, or where torch does not
// build it on OpenMP (ATen/Parallel-inl.h: without _OPENMP its OpenMP form runs f(begin, end)).
constexpr bool kAtenParallel =
#if defined(_OPENMP) || !AT_PARALLEL_OPENMP
    true;
#else
    false;
#endif

// The GNU OpenMP entry points of the runtime torch loaded: GOMP_parallel(fn, data, 0, 0) is what
// GCC compiles `#pragma omp parallel` to (fn(data) on every thread of a team of the default size,
// the caller included, returning when all are done); LLVM's and Intel's runtimes export the same.
// Looked up from this module (RTLD_DEFAULT searches its dependencies, torch's libraries and their
// libgomp among them), so the copy torch runs on is the one found, whatever its file is called.
struct Gomp {
  void (*parallel)(void (*)(void*), void*, unsigned, unsigned) = nullptr;
  int (*thread_num)() = nullptr;
  int (*num_threads)() = nullptr;
};

const Gomp& gomp() {
  static const Gomp g = [] {
    Gomp r;
#if defined(__linux__)
    r.parallel = reinterpret_cast<decltype(r.parallel)>(dlsym(RTLD_DEFAULT, "GOMP_parallel"));
    r.thread_num = reinterpret_cast<decltype(r.thread_num)>(dlsym(RTLD_DEFAULT, "omp_get_thread_num"));
    r.num_threads = reinterpret_cast<decltype(r.num_threads)>(dlsym(RTLD_DEFAULT, "omp_get_num_threads"));
    if (r.parallel == nullptr || r.thread_num == nullptr || r.num_threads == nullptr) r = Gomp{};
#endif
    return r;
  }();
  return g;
}

int64_t divup(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The serial case of at::parallel_for: one item, no more than a grain, one thread, or nested.
bool run_serially(int64_t begin, int64_t end, int64_t grain, int64_t max_threads,
                  const std::function<void(int64_t, int64_t)>& f) {
  const int64_t items = end - begin;
  if (items > grain && items > 1 && max_threads > 1 && !in_parallel_region()) return false;
  RegionGuard guard;
  f(begin, end);
  return true;
}

struct GompCall {
  int64_t begin, end, grain;
  const std::function<void(int64_t, int64_t)>* f;
  std::atomic_flag failed = ATOMIC_FLAG_INIT;
  std::exception_ptr error;
};

void gomp_chunk(void* data) {
  auto& c = *static_cast<GompCall*>(data);
  RegionGuard guard;
  int64_t n = gomp().num_threads();
  if (c.grain > 0) n = std::min(n, divup(c.end - c.begin, c.grain));
  const int64_t tid = gomp().thread_num();
  const int64_t chunk = divup(c.end - c.begin, n);
  const int64_t b = c.begin + tid * chunk;
  if (b >= c.end) return;
  try {
    (*c.f)(b, std::min(c.end, b + chunk));
  } catch (...) {
    if (!c.failed.test_and_set()) c.error = std::current_exception();
  }
}

}  // namespace

bool gomp_available() { return gomp().parallel != nullptr; }

Threads selected_threads() {
  const std::string v = env_choice("RELPOS_CPU_THREADS", {"auto", "aten", "gomp", "std"});
  if (v.empty() || v == "auto") {
    return kAtenParallel ? Threads::Aten : gomp_available() ? Threads::Gomp : Threads::Std;
  }
  if (v == "aten") return Threads::Aten;
  if (v == "std") return Threads::Std;
  TORCH_CHECK(gomp_available(), "RELPOS_CPU_THREADS=gomp: no OpenMP runtime with GOMP_parallel is loaded");
  return Threads::Gomp;
}

const char* threads_name(Threads t) {
  switch (t) {
    case Threads::Aten: return "aten";
    case Threads::Gomp: return "gomp";
    case Threads::Std: return "std";
  }
  return "?";
}

bool in_parallel_region() { return t_in_region || at::in_parallel_region(); }

void gomp_parallel_for(int64_t begin, int64_t end, int64_t grain, int64_t max_threads,
                       const std::function<void(int64_t, int64_t)>& f) {
  if (begin >= end || run_serially(begin, end, grain, max_threads, f)) return;
  TORCH_CHECK(gomp_available(), "relpos: GOMP_parallel is not loaded");
  GompCall call{begin, end, grain, &f};
  // team of the default size, as at::parallel_for's `#pragma omp parallel` (no num_threads
  // clause: torch avoids it for GOMP's thread pool, pytorch#32008)
  gomp().parallel(&gomp_chunk, &call, 0, 0);
  if (call.error) std::rethrow_exception(call.error);
}

// A thread per chunk and call, no pool: nothing outlives the call, so there is nothing to rebuild
// after fork() (DataLoader workers) or to tear down at exit. Starting and joining the threads costs
// about 0.1 ms a call on the 2-core test machine (README), which small calls feel: the fallback
// for where no OpenMP runtime is loaded.
void thread_parallel_for(int64_t begin, int64_t end, int64_t grain, int64_t max_threads,
                         const std::function<void(int64_t, int64_t)>& f) {
  if (begin >= end || run_serially(begin, end, grain, max_threads, f)) return;
  const int64_t n = std::min(max_threads, divup(end - begin, std::max<int64_t>(grain, 1)));
  const int64_t chunk = divup(end - begin, n);
  std::vector<std::exception_ptr> errors(n);
  auto body = [&](int64_t t) {
    RegionGuard guard;
    const int64_t b = begin + t * chunk;
    if (b >= end) return;
    try {
      f(b, std::min(end, b + chunk));
    } catch (...) {
      errors[t] = std::current_exception();
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(n - 1);
  for (int64_t t = 1; t < n; ++t) {
    try {
      threads.emplace_back(body, t);
    } catch (const std::system_error&) {
      body(t);  // no thread to be had (resource limits): this chunk on the calling thread
    }
  }
  body(0);
  for (auto& th : threads) th.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

}  // namespace relpos::cpu
