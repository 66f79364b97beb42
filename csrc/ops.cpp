// The relpos operator library: every schema (from schemas.h) and the Python module `_C`.
// Backends implement the schemas elsewhere: csrc/cpu/*.cpp (CPU key), csrc/cuda/*.cpp (CUDA key).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/library.h>

#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "cpu/isa.h"
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
#if defined(RELPOS_WITH_CUDA)
  info["cuda_archs"] = split_csv(RELPOS_CUDA_ARCHS);
#else
  info["cuda_archs"] = pybind11::none();
#endif
  return info;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "relpos_ext compiled core: registers torch.ops.relpos.* on import";
  m.def("build_info", &build_info,
        "Version, torch version built against, CPU kernel paths compiled in, the CPU path the "
        "dispatcher would pick now (and the one float64 attention would take), and CUDA "
        "architectures (None when CUDA was not built).");
  m.def("_fma_peak_gflops", &relpos::cpu::fma_peak_gflops, pybind11::arg("threads"),
        pybind11::arg("seconds") = 0.5,
        pybind11::call_guard<pybind11::gil_scoped_release>(),
        "For the benchmarks: the float32 FMA rate, GFLOP/s, of `threads` cores running independent "
        "AVX2 FMAs for about `seconds` (best of three), the ceiling for any float32 kernel on this "
        "machine; None where the AVX2 kernels cannot run.");
}
