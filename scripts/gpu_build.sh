#!/usr/bin/env bash
# Builds and installs relpos_ext on a lent GPU machine for RELPOS_GPU_ARCH (default 90), CUDA
# required, into python3's environment, with the build directory BUILD_DIR (reused: a rebuild
# compiles only what changed) and its output in LOG (its tail printed on failure). With OBJS (a
# folder of prebuilt <name>.cu.o, scripts/gpu_nvcc_objs.sh) scripts/gpu_nvcc_cache.sh copies them
# instead of running nvcc; with OBJS empty nvcc compiles. For gpu_check.sh and gpu_ab.sh.
#   bash scripts/gpu_build.sh OBJS BUILD_DIR LOG
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
objs=$1 build_dir=${2:?usage: $0 OBJS BUILD_DIR LOG} log=${3:?usage: $0 OBJS BUILD_DIR LOG}
launcher=()
if [ -n "$objs" ]; then
  export RELPOS_GPU_OBJS=$objs
  launcher=("-Ccmake.define.CMAKE_CUDA_COMPILER_LAUNCHER=$root/scripts/gpu_nvcc_cache.sh")
fi
cd "$root"
if ! CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} python3 -m pip install --no-build-isolation --no-deps \
    -v . -Cbuild-dir="$build_dir" -Ccmake.define.RELPOS_CUDA_ARCHS="${RELPOS_GPU_ARCH:-90}" \
    -Ccmake.define.RELPOS_REQUIRE_CUDA=ON "${launcher[@]}" > "$log" 2>&1; then
  tail -n 60 "$log"
  echo "== build FAILED"
  exit 1
fi
