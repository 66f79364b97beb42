// Runtime choice of the CPU kernel path. AVX2 (with FMA and F16C) is used when it was compiled in
// and the CPU has it; RELPOS_CPU_ISA=scalar|avx2|auto overrides, read at every call so tests can
// cover each path in one process (torchao does the same with its own variable).
#pragma once

namespace relpos::cpu {

enum class Isa { Scalar, Avx2 };

// The path for this call: RELPOS_CPU_ISA if set (error if it names a path that cannot run here),
// else the best available.
Isa selected_isa();
const char* isa_name(Isa isa);

}  // namespace relpos::cpu
