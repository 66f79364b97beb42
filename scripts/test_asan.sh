#!/usr/bin/env bash
# Runs every emulator-backed test (pytest -m emu: tests/test_cuda_emu.py and the cuda-emu backend of
# the op tests) against the CUDA emulator built with AddressSanitizer, so that out-of-bounds
# accesses of the CUDA kernels to global, shared and dynamic shared memory are reported.
# Extra arguments go to pytest.
#
# Python and torch are not instrumented, so the ASan runtime must be preloaded; libstdc++ is
# preloaded with it because ASan resolves the real __cxa_throw when it starts, and a plain python
# process has not loaded libstdc++ yet (without it every C++ throw aborts in ASan's interceptor).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
lib="$(bash "$repo/scripts/build_cuda_emu.sh" --asan)"

cxx="${CXX:-g++}"
asan_runtime="$("$cxx" -print-file-name=libasan.so)"
libstdcxx="$("$cxx" -print-file-name=libstdc++.so)"
if [[ ! -f "$asan_runtime" || ! -f "$libstdcxx" ]]; then
  echo "test_asan.sh: $cxx does not know libasan.so or libstdc++.so" >&2
  exit 1
fi

export LD_PRELOAD="$asan_runtime $libstdcxx${LD_PRELOAD:+ $LD_PRELOAD}"
# detect_leaks=0: CPython and torch keep allocations until exit by design.
export ASAN_OPTIONS="detect_leaks=0${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export RELPOS_CUDA_EMU_LIB="$lib"
export RELPOS_EMU_ASAN=1
export RELPOS_REQUIRE_CUDA_EMU=1

cd "$repo"
# pytest-xdist: the emulator runs a kernel on one core; a worker per core, one torch thread each.
OMP_NUM_THREADS=1 exec python -m pytest -m emu -n "${RELPOS_TEST_WORKERS:-auto}" "$@"  # testpaths = ["tests"] (pyproject.toml)
