# Fails when an object compiled with AVX2 (or AVX-512) flags defines a weak (W/V) or unique (u) symbol.
# Such a symbol (an inline function or template instance) may be the copy the linker keeps for
# the scalar path too, which would then execute AVX2 instructions on CPUs without them.
# Usage: cmake -DNM=<nm> -DOBJECTS="a.o|b.o" -P check_no_weak_symbols.cmake
string(REPLACE "|" ";" _objects "${OBJECTS}")
set(_bad "")
foreach(_obj IN LISTS _objects)
  execute_process(COMMAND "${NM}" -C --defined-only "${_obj}" OUTPUT_VARIABLE _syms)
  string(REPLACE "\n" ";" _lines "${_syms}")
  foreach(_line IN LISTS _lines)
    # DW.ref.__gxx_personality_v0 is data (the exception personality pointer), not code.
    if(_line MATCHES " [WVu] " AND NOT _line MATCHES "DW\\.ref\\.")
      string(APPEND _bad "\n  ${_obj}: ${_line}")
    endif()
  endforeach()
endforeach()
if(_bad)
  message(FATAL_ERROR "relpos_ext: AVX2 objects define weak/shared symbols (see csrc/cpu/vec_avx2.h):${_bad}")
endif()
