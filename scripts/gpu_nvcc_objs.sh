#!/usr/bin/env bash
# Compiles TREE/csrc/cuda/*.cu for RELPOS_GPU_ARCH (default 90) into OUT/<name>.cu.o with this
# machine's nvcc and the CUDA flags of CMakeLists.txt's relpos_cuda_kernels target (keep them in
# step): the objects scripts/gpu_nvcc_cache.sh hands to the build on a lent GPU machine, made
# beforehand by gpu_check.sh --prebuild (TREE = the working tree) and gpu_ab.sh --prebuild (TREE =
# a checkout of the base revision).
#   bash scripts/gpu_nvcc_objs.sh TREE OUT
set -euo pipefail
tree=${1:?usage: $0 TREE OUT}
out=${2:?usage: $0 TREE OUT}
arch=${RELPOS_GPU_ARCH:-90}
nvcc=${CUDA_HOME:-/usr/local/cuda}/bin/nvcc
mkdir -p "$out"
pids=()
for f in "$tree"/csrc/cuda/*.cu; do
  echo "== nvcc ${f#"$tree"/} (sm_$arch)"
  "$nvcc" -I"$tree/csrc" --expt-relaxed-constexpr --expt-extended-lambda -O3 -DNDEBUG -std=c++20 \
    "--generate-code=arch=compute_$arch,code=[sm_$arch]" -Xcompiler=-fPIC \
    -c "$f" -o "$out/$(basename "$f").o" &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done  # set -e: a failed compile fails the script
