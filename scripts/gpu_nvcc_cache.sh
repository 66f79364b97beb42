#!/usr/bin/env bash
# CMAKE_CUDA_COMPILER_LAUNCHER for scripts/gpu_check.sh: when RELPOS_GPU_OBJS holds <source>.o for
# the .cu file being compiled (made beforehand by scripts/gpu_check.sh --prebuild with the same
# nvcc), copy it instead of running nvcc, and write the depfile ninja expects. Otherwise run the
# compiler command unchanged. Saves the minutes nvcc takes on the lent machine's clock.
set -euo pipefail
src="" out="" dep=""
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case "${args[i]}" in
    -c) src=${args[i + 1]} ;;
    -o) out=${args[i + 1]} ;;
    -MF) dep=${args[i + 1]} ;;
  esac
done
obj="${RELPOS_GPU_OBJS:-}/$(basename "$src").o"
if [ -n "${RELPOS_GPU_OBJS:-}" ] && [ -n "$src" ] && [ -n "$out" ] && [ -f "$obj" ]; then
  cp "$obj" "$out"
  [ -n "$dep" ] && printf '%s: %s\n' "$out" "$src" > "$dep"
  echo "gpu_nvcc_cache: $(basename "$src") from $obj" >&2
  exit 0
fi
exec "$@"
