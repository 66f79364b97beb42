#include "kernel_symbols.h"

#include <cxxabi.h>
#include <dlfcn.h>
#include <elf.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <unordered_map>

namespace relpos_emu::detail {

namespace {

struct FileMapping {
  void* data;
  size_t bytes;
  ~FileMapping() { munmap(data, bytes); }
};

struct ObjectSymbol {
  std::string name;
  uintptr_t address;
  size_t bytes;
};

// The C++ functions and the writable function statics of one loaded library.
struct SymbolTable {
  std::unordered_map<uintptr_t, std::string> functions;  // address -> mangled name
  std::vector<ObjectSymbol> function_statics;            // mangled "_ZZ..."
};

// Reads the library file's .symtab, which also lists local symbols (kernels have internal linkage
// under AddressSanitizer), or its .dynsym if it was stripped. `base` is where it is loaded.
SymbolTable read_symbol_table(const char* path, uintptr_t base) {
  SymbolTable table;
  const int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return table;
  struct stat st {};
  const bool ok = fstat(fd, &st) == 0 && st.st_size > static_cast<off_t>(sizeof(Elf64_Ehdr));
  void* map = ok ? mmap(nullptr, st.st_size, PROT_READ, MAP_PRIVATE, fd, 0) : MAP_FAILED;
  close(fd);
  if (map == MAP_FAILED) return table;
  const FileMapping mapping{map, static_cast<size_t>(st.st_size)};

  const auto* file = static_cast<const unsigned char*>(map);
  const size_t file_bytes = mapping.bytes;
  const auto within = [&](uint64_t offset, uint64_t bytes) {
    return offset <= file_bytes && bytes <= file_bytes - offset;
  };
  const auto& header = *reinterpret_cast<const Elf64_Ehdr*>(file);
  if (std::memcmp(header.e_ident, ELFMAG, SELFMAG) != 0 || header.e_ident[EI_CLASS] != ELFCLASS64 ||
      header.e_shentsize != sizeof(Elf64_Shdr) ||
      !within(header.e_shoff, uint64_t{header.e_shnum} * sizeof(Elf64_Shdr))) {
    return table;
  }
  const auto* sections = reinterpret_cast<const Elf64_Shdr*>(file + header.e_shoff);
  const Elf64_Shdr* symtab = nullptr;
  for (unsigned i = 0; i < header.e_shnum && symtab == nullptr; ++i) {
    if (sections[i].sh_type == SHT_SYMTAB) symtab = &sections[i];
  }
  for (unsigned i = 0; i < header.e_shnum && symtab == nullptr; ++i) {
    if (sections[i].sh_type == SHT_DYNSYM) symtab = &sections[i];
  }
  if (symtab == nullptr || symtab->sh_link >= header.e_shnum ||
      !within(symtab->sh_offset, symtab->sh_size)) {
    return table;
  }
  const Elf64_Shdr& strtab = sections[symtab->sh_link];
  if (strtab.sh_size == 0 || !within(strtab.sh_offset, strtab.sh_size)) return table;
  const char* names = reinterpret_cast<const char*>(file + strtab.sh_offset);
  if (names[strtab.sh_size - 1] != '\0') return table;

  const auto* symbols = reinterpret_cast<const Elf64_Sym*>(file + symtab->sh_offset);
  const size_t count = symtab->sh_size / sizeof(Elf64_Sym);
  for (size_t i = 0; i < count; ++i) {
    const Elf64_Sym& sym = symbols[i];
    if (sym.st_shndx == SHN_UNDEF || sym.st_shndx >= header.e_shnum ||
        sym.st_name >= strtab.sh_size) {
      continue;
    }
    const char* name = names + sym.st_name;
    const unsigned type = ELF64_ST_TYPE(sym.st_info);
    if (type == STT_FUNC && std::strncmp(name, "_Z", 2) == 0) {
      table.functions.emplace(base + sym.st_value, name);
    } else if (type == STT_OBJECT && std::strncmp(name, "_ZZ", 3) == 0 && sym.st_size > 0 &&
               (sections[sym.st_shndx].sh_flags & SHF_WRITE) != 0) {
      table.function_statics.push_back({name, base + sym.st_value, sym.st_size});
    }
  }
  return table;
}

std::string demangle(const std::string& mangled) {
  int status = 0;
  const std::unique_ptr<char, decltype(&std::free)> out(
      abi::__cxa_demangle(mangled.c_str(), nullptr, nullptr, &status), &std::free);
  return status == 0 ? std::string(out.get()) : mangled;
}

}  // namespace

const KernelSymbols& kernel_symbols(const void* entry) {
  static std::unordered_map<const void*, KernelSymbols> kernels;
  static std::unordered_map<std::string, SymbolTable> libraries;  // by path
  if (const auto it = kernels.find(entry); it != kernels.end()) return it->second;

  KernelSymbols info;
  std::string mangled;
  Dl_info dl{};
  if (dladdr(entry, &dl) != 0 && dl.dli_fname != nullptr) {
    auto [lib, inserted] = libraries.try_emplace(dl.dli_fname);
    if (inserted) {
      lib->second = read_symbol_table(dl.dli_fname, reinterpret_cast<uintptr_t>(dl.dli_fbase));
    }
    const SymbolTable& table = lib->second;
    if (const auto f = table.functions.find(reinterpret_cast<uintptr_t>(entry));
        f != table.functions.end()) {
      mangled = f->second;
      // A function's statics are mangled as _ZZ <the function's encoding> E <name>.
      const std::string prefix = "_ZZ" + mangled.substr(2) + "E";
      for (const ObjectSymbol& s : table.function_statics) {
        if (s.name.starts_with(prefix)) {
          info.static_smem.push_back({reinterpret_cast<void*>(s.address), s.bytes});
        }
      }
    }
  }
  if (mangled.empty()) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%p", entry);
    info.name = buf;
  } else {
    info.name = demangle(mangled);
  }
  return kernels.emplace(entry, std::move(info)).first->second;
}

}  // namespace relpos_emu::detail
