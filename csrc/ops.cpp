// The relpos operator library: every schema (from schemas.h) and the Python module `_C`.
// Backends implement the schemas elsewhere: csrc/cpu/*.cpp (CPU key), csrc/cuda/*.cpp (CUDA key).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "cpu/isa.h"
#include "cpu/parallel.h"
#include "schemas.h"

#ifndef RELPOS_VERSION
#define RELPOS_VERSION "0.0.0+unknown"
#endif

TORCH_LIBRARY(relpos, m) {
#define RELPOS_DEF(schema) m.def(schema);
  RELPOS_FOR_EACH_SCHEMA(RELPOS_DEF)
#undef RELPOS_DEF
}

namespace {

std::vector<std::string> split_csv(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

pybind11::dict build_info() {
  pybind11::dict info;
  info["version"] = RELPOS_VERSION;
  info["torch_version"] = RELPOS_TORCH_VERSION;
  info["cpu_kernels"] = split_csv(RELPOS_CPU_ISAS);
  const relpos::cpu::Isa isa = relpos::cpu::selected_isa();
  info["cpu_kernel_in_use"] = relpos::cpu::isa_name(isa);
  info["cpu_float64_attention"] = relpos::cpu::float64_attention_kernel(isa);
  info["cpu_bf16_dot"] = relpos::cpu::bf16_dot_enabled(isa);
  info["cpu_amx"] = relpos::cpu::amx_enabled(isa);
  info["cpu_bf16_dot_decode_only"] = relpos::cpu::bf16_dot_decode_only(isa);
  info["cpu_wide_rows"] = relpos::cpu::wide_block_rows(isa);
  info["cpu_threads"] = relpos::cpu::threads_name(relpos::cpu::selected_threads());
#if defined(RELPOS_WITH_CUDA)
  info["cuda_archs"] = split_csv(RELPOS_CUDA_ARCHS);
#else
  info["cuda_archs"] = pybind11::none();
#endif
  return info;
}

// For tests of the thread sources of parallel.h: the chunks (begin, end, thread) that
// gomp_parallel_for (`source` "gomp") or thread_parallel_for ("std") ran f on over [begin, end),
// threads numbered by first appearance (the calling thread is 0). A chunk holding `throw_at`
// throws; `nested` makes each chunk split its own range again, recording those chunks instead.
std::vector<std::tuple<int64_t, int64_t, int64_t>> parallel_probe(
    const std::string& source, int64_t begin, int64_t end, int64_t grain, int64_t max_threads,
    int64_t throw_at, bool nested) {
  TORCH_CHECK(source == "gomp" || source == "std", "source must be 'gomp' or 'std'");
  auto split = [&](int64_t b, int64_t e, int64_t g, const std::function<void(int64_t, int64_t)>& f) {
    if (source == "gomp") {
      relpos::cpu::gomp_parallel_for(b, e, g, max_threads, f);
    } else {
      relpos::cpu::thread_parallel_for(b, e, g, max_threads, f);
    }
  };
  std::mutex mu;
  std::vector<std::thread::id> ids{std::this_thread::get_id()};
  std::vector<std::tuple<int64_t, int64_t, int64_t>> chunks;
  auto record = [&](int64_t b, int64_t e) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // so that chunks overlap in time
    std::lock_guard<std::mutex> lock(mu);
    const auto it = std::find(ids.begin(), ids.end(), std::this_thread::get_id());
    const auto tid = static_cast<int64_t>(it - ids.begin());
    if (it == ids.end()) ids.push_back(std::this_thread::get_id());
    chunks.emplace_back(b, e, tid);
    if (b <= throw_at && throw_at < e) throw std::runtime_error("chunk " + std::to_string(b) + " failed");
  };
  split(begin, end, grain, [&](int64_t b, int64_t e) {
    if (nested) {
      split(b, e, 1, record);
    } else {
      record(b, e);
    }
  });
  std::sort(chunks.begin(), chunks.end());
  return chunks;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "relpos_ext compiled core: registers torch.ops.relpos.* on import";
  m.def("build_info", &build_info,
        "Version, torch version built against, CPU kernel paths compiled in, the CPU path the "
        "dispatcher would pick now (and the one float64 attention would take), what the CPU "
        "kernels' threads run on, and CUDA architectures (None when CUDA was not built).");
  m.def("_fma_peak_gflops", &relpos::cpu::fma_peak_gflops, pybind11::arg("threads"),
        pybind11::arg("seconds") = 0.5,
        pybind11::call_guard<pybind11::gil_scoped_release>(),
        "For the benchmarks: the float32 FMA rate, GFLOP/s, of `threads` cores running independent "
        "AVX2 FMAs for about `seconds` (best of three), the ceiling for any float32 kernel on this "
        "machine; None where the AVX2 kernels cannot run.");
  m.def("_parallel_probe", &parallel_probe, pybind11::arg("source"), pybind11::arg("begin"),
        pybind11::arg("end"), pybind11::arg("grain"), pybind11::arg("max_threads"),
        pybind11::arg("throw_at") = -1, pybind11::arg("nested") = false,
        pybind11::call_guard<pybind11::gil_scoped_release>(),
        "For tests: the sorted chunks (begin, end, thread) that the 'gomp' or 'std' thread source "
        "ran over [begin, end), threads numbered by first appearance (0: the calling thread).");
  m.def("_gomp_available", &relpos::cpu::gomp_available,
        "For tests: whether the OpenMP runtime torch loaded exports GOMP_parallel.");
}
