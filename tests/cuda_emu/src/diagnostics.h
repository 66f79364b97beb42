// How the emulator's error messages name threads, blocks, masks and source locations.
#pragma once

#include <cstdio>
#include <cstring>
#include <source_location>
#include <string>

#include <vector_types.h>

namespace relpos_emu::detail {

inline std::string format_index(uint3 i) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "(%u, %u, %u)", i.x, i.y, i.z);
  return buf;
}

inline std::string format_dim(dim3 d) { return format_index(uint3{d.x, d.y, d.z}); }

inline std::string format_site(const std::source_location& site) {
  const char* file = site.file_name();
  const char* slash = std::strrchr(file, '/');
  return std::string(slash ? slash + 1 : file) + ":" + std::to_string(site.line());
}

inline std::string format_mask(unsigned mask) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", mask);
  return buf;
}

}  // namespace relpos_emu::detail
