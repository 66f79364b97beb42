# Fails when the linked module defines members of std::locale: then it holds its own copy of
# libstdc++ (linked from libstdc++.a) beside the shared one torch loads, and the two copies'
# locale facets do not match (formatting a number in an error message segfaults). CMakeLists.txt
# links torch's libstdc++.so first to prevent it.
# Usage: cmake -DNM=<nm> -DMODULE=<_C.so> -P check_cxx_runtime.cmake
execute_process(COMMAND "${NM}" -D --defined-only "${MODULE}" OUTPUT_VARIABLE _syms
                RESULT_VARIABLE _rc)
if(NOT _rc EQUAL 0)
  message(FATAL_ERROR "relpos_ext: ${NM} -D could not read ${MODULE}")
endif()
string(REGEX MATCHALL "[^\n]* _ZNSt6locale[^\n]*" _copies "${_syms}")
if(_copies)
  list(LENGTH _copies _n)
  list(GET _copies 0 _first)
  message(FATAL_ERROR "relpos_ext: ${MODULE} defines ${_n} std::locale symbols (first: ${_first}): "
                      "it links its own copy of libstdc++, which crashes beside torch's. Link the "
                      "shared libstdc++ (CMakeLists.txt: RELPOS_TORCH_LIBSTDCXX).")
endif()
