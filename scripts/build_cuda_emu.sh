#!/usr/bin/env bash
# Builds the CUDA emulator library of the test suite (tests/cuda_emu) with the active Python's
# torch and prints its path. Re-running rebuilds only what changed (ninja; the build re-globs
# csrc/cuda for new files).
#   scripts/build_cuda_emu.sh          -> build/cuda_emu/librelpos_cuda_emu.so
#   scripts/build_cuda_emu.sh --asan   -> build/cuda_emu_asan/librelpos_cuda_emu.so
#                                         (with AddressSanitizer, for scripts/test_asan.sh)
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="$repo/build/cuda_emu"
asan=OFF
build_type=Release
case "${1:-}" in
  "") ;;
  --asan)
    build="$repo/build/cuda_emu_asan"
    asan=ON
    build_type=RelWithDebInfo  # line numbers in AddressSanitizer reports
    ;;
  *)
    echo "usage: $0 [--asan]" >&2
    exit 2
    ;;
esac

python="$(command -v python3 || command -v python)"
if [[ ! -f "$build/build.ninja" ]]; then
  cmake -S "$repo/tests/cuda_emu" -B "$build" -G Ninja \
    -DCMAKE_BUILD_TYPE="$build_type" -DRELPOS_EMU_ASAN="$asan" \
    -DPython3_EXECUTABLE="$python" >&2
fi
cmake --build "$build" >&2
echo "$build/librelpos_cuda_emu.so"
