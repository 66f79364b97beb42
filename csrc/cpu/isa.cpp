#include "cpu/isa.h"

#include "common/env.h"
#include "cpu/kernels.h"

#include <c10/util/Exception.h>

#include <string>

#if defined(RELPOS_HAVE_AVX2) && (defined(__x86_64__) || defined(_M_X64))
#include <cpuid.h>
#endif
#if defined(RELPOS_HAVE_AMX) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace relpos::cpu {
namespace {

#if defined(RELPOS_HAVE_AVX2) && (defined(__x86_64__) || defined(_M_X64))
// F16C from CPUID leaf 1 (ECX bit 29): clang before 16 rejects __builtin_cpu_supports("f16c").
// It uses the AVX register state, which __builtin_cpu_supports("avx2") has checked the OS saves.
bool cpu_has_f16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
}
#endif

bool cpu_has_avx2() {
#if defined(RELPOS_HAVE_AVX2) && (defined(__x86_64__) || defined(_M_X64))
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          cpu_has_f16c();
  return has;
#else
  return false;
#endif
}

bool cpu_has_avx512() {
#if defined(RELPOS_HAVE_AVX512) && (defined(__x86_64__) || defined(_M_X64))
  static const bool has = cpu_has_avx2() && __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512dq");
  return has;
#else
  return false;
#endif
}

// AMX-TILE and AMX-BF16 (CPUID leaf 7, EDX bits 24 and 22), the OS saving the tile state (XCR0
// bits 17 and 18), and this process granted that state: Linux hands AMX's 8 KiB of tile data
// only to processes that ask (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA, feature 18; every
// thread of the process then has it). Without the grant the first tile instruction faults. Asked
// once; a refusal leaves the AVX512-BF16 dots.
bool cpu_has_amx() {
#if defined(RELPOS_HAVE_AMX) && defined(__linux__) && (defined(__x86_64__) || defined(_M_X64))
  static const bool has = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) == 0) return false;
    if ((edx & (1u << 24)) == 0 || (edx & (1u << 22)) == 0) return false;
    if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0 || (ecx & bit_OSXSAVE) == 0) return false;
    unsigned lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & (3u << 17)) != (3u << 17)) return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return has;
#else
  return false;
#endif
}

}  // namespace

Isa selected_isa() {
  const std::string want = env_choice("RELPOS_CPU_ISA", {"scalar", "avx2", "avx512", "auto"});
  if (want == "scalar") return Isa::Scalar;
  if (want == "avx2") {
    TORCH_CHECK(cpu_has_avx2(),
                "RELPOS_CPU_ISA=avx2 but the AVX2 kernels are not available on this build/CPU");
    return Isa::Avx2;
  }
  if (want == "avx512") {
    TORCH_CHECK(cpu_has_avx512(),
                "RELPOS_CPU_ISA=avx512 but the AVX-512 kernels are not available on this build/CPU");
    return Isa::Avx512;
  }
  return cpu_has_avx512() ? Isa::Avx512 : cpu_has_avx2() ? Isa::Avx2 : Isa::Scalar;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::Avx512: return "avx512";
    case Isa::Avx2: return "avx2";
    case Isa::Scalar: break;
  }
  return "scalar";
}

bool bf16_dot_enabled(Isa isa) {
  if (isa != Isa::Avx512) return false;
#if defined(RELPOS_HAVE_AVX512) && (defined(__x86_64__) || defined(_M_X64))
  static const bool has = cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
  return has && env_choice("RELPOS_CPU_BF16_DOT", {"0", "1"}) != "0";
#else
  return false;
#endif
}

bool bf16_dot_decode_only(Isa isa) {
  if (!bf16_dot_enabled(isa) || env_choice("RELPOS_CPU_BF16_DOT", {"0", "1"}) == "1" || amx_enabled(isa)) {
    return false;
  }
#if defined(__x86_64__) || defined(_M_X64)
  static const bool intel = __builtin_cpu_is("intel");
  return intel;
#else
  return false;
#endif
}

bool amx_enabled(Isa isa) {
  const bool off = env_choice("RELPOS_CPU_AMX", {"0", "1"}) == "0";
  return !off && bf16_dot_enabled(isa) && cpu_has_amx();
}

int wide_block_rows(Isa isa) {
  if (isa != Isa::Avx512) return 0;
  const std::string want = env_choice("RELPOS_CPU_WIDE_ROWS", {"4", "6"});
  if (!want.empty()) return want == "6" ? 6 : 4;
  // On a Xeon with AVX-512 and AMX (family 6, model 167) 6 x 64 blocks alone in a loop ran 13%
  // faster than 4 x 64 (184 against 163 GFLOP/s a core at the forward's tile shapes); in the
  // attention at L = 2048 (B = 1, H = 8, D = 64, K = 64; alternating processes) the forward gained
  // 0-3% and forward+backward 2-4%, on 1 and 2 threads. On Zen 4, whose 512-bit instructions run
  // as two halves, 4 x 64 was the faster (forward+backward 1.5%).
#if defined(__x86_64__) || defined(_M_X64)
  static const bool intel = __builtin_cpu_is("intel");
  return intel ? 6 : 4;
#else
  return 4;
#endif
}

const char* float64_attention_kernel(Isa isa) {
#if defined(RELPOS_HAVE_F64_AVX2)
  if (isa != Isa::Scalar) return "avx2";
#endif
  (void)isa;
  return "scalar";
}

}  // namespace relpos::cpu
