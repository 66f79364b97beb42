// The relpos op schemas, declared again in the `relpos_emu` namespace: the CUDA glue of csrc/cuda,
// compiled in emulator mode, registers the emulated kernels there on the CPU key
// (csrc/cuda/glue_config.h), so tests call torch.ops.relpos_emu.rel_gather(...) on CPU tensors
// with exactly the signatures of the real ops.
#include <torch/library.h>

#include "schemas.h"

#define RELPOS_EMU_DEFINE_SCHEMA(schema) m.def(schema);

TORCH_LIBRARY(relpos_emu, m) { RELPOS_FOR_EACH_SCHEMA(RELPOS_EMU_DEFINE_SCHEMA) }
