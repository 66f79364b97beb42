// What the emulator learns about a kernel from the ELF symbol table of the library holding it:
// its name, for messages, and its static __shared__ arrays. Those are the kernel's function
// statics (symbols `_ZZ<kernel>E<name>`); every block gets them filled with 0xff bytes like fresh,
// uninitialised shared memory, so that a read before the first write shows (NaN) and results
// never depend on what an earlier block or launch left there.
//
// Statics of __device__ helpers called by a kernel are not found this way: they keep whatever the
// previous block left.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace relpos_emu::detail {

struct StaticArray {
  void* address;
  size_t bytes;
};

struct KernelSymbols {
  std::string name;                      // demangled; the address if the symbol is unknown
  std::vector<StaticArray> static_smem;  // the kernel's own writable function statics
};

// Looked up once per kernel and cached; call under run_grid's lock.
const KernelSymbols& kernel_symbols(const void* entry);

}  // namespace relpos_emu::detail
