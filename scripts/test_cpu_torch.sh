#!/usr/bin/env bash
# relpos_ext against a CPU-only build of torch, the wheel many CPU users install (torch.version.cuda
# is None, no CUDA libraries), and an older torch than the main suite's 2.14.1: a venv of its own
# (build/venv-cpu-torch; RELPOS_CPU_TORCH_VENV overrides), torch $RELPOS_CPU_TORCH (default
# 2.13.0, the CPU build on these machines' disk) with transformers for the compatibility tests,
# then the README's `pip install --no-build-isolation .` into it (build directory
# build/cpu-torch-<wheel tag>, so the main build's stays as it is), then every test but the
# emulator's (its library is built against the main venv's torch).
# Extra arguments go to pytest.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
torch_version=${RELPOS_CPU_TORCH:-2.13.0}
venv=${RELPOS_CPU_TORCH_VENV:-$root/build/venv-cpu-torch}
python_bin=${PYTHON:-$(command -v python3.11 || command -v python3)}

if [ ! -x "$venv/bin/python" ]; then
  echo "== creating venv $venv with $python_bin"
  "$python_bin" -m venv "$venv"
fi
py="$venv/bin/python"
echo "== installing torch==$torch_version, the build tools and the test tools into $venv"
"$py" -m pip install -q --upgrade pip
"$py" -m pip install -q "torch==$torch_version"
"$py" -m pip install -q "scikit-build-core>=0.10" "pybind11>=2.12" "ninja>=1.10" "cmake>=4.0" \
  "pytest>=8" numpy expecttest hypothesis "transformers==5.23.0"
if ! "$py" -c "import sys, torch; sys.exit(torch.version.cuda is not None)"; then
  echo "== torch==$torch_version in $venv is a CUDA build, not the CPU-only one this step tests" >&2
  exit 1
fi

echo "== building relpos_ext against torch $torch_version (pip install --no-build-isolation .)"
log="$root/build/pip-install-cpu-torch.log"
mkdir -p build
# The venv's bin first: the build runs its cmake and ninja, as setup.sh's build runs the main
# venv's.
if ! PATH="$venv/bin:$PATH" "$py" -m pip install --no-build-isolation -v . \
    "-Cbuild-dir=build/cpu-torch-{wheel_tag}" > "$log" 2>&1; then
  tail -n 80 "$log"
  echo "== build failed; full log: $log" >&2
  exit 1
fi
grep -E "relpos_ext:" "$log" | sed 's/^ *//'
# A CPU-only torch gets no CUDA kernels (the log lines above say why), whatever nvcc is here.
"$py" - <<'EOF'
import relpos_ext
import torch
info = relpos_ext.build_info()
print("== installed relpos_ext", info)
assert info["torch_version"] == torch.__version__, info
assert info["cuda_archs"] is None, f"CUDA kernels built against a CPU-only torch: {info}"
EOF

echo "== pytest on torch $torch_version (CPU build), without the emulator tests"
# No emulator library (a path that does not exist): tests/test_cuda_emu.py loads it while
# collecting, and the one in build/cuda_emu is linked against the main venv's torch.
RELPOS_CUDA_EMU_LIB="$venv/no-emulator.so" RELPOS_REQUIRE_CUDA_EMU=0 RELPOS_REQUIRE_TRANSFORMERS=1 \
  exec "$py" -m pytest tests -q -p no:cacheprovider -ra -m "not emu" "$@"
