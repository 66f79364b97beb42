#!/usr/bin/env bash
# Set up everything from a clean clone: a venv in .venv (override with RELPOS_VENV), torch 2.14.1
# (the CUDA 13.0 build, so the CUDA sources compile with a local nvcc 13), the build tools, and
# relpos_ext itself built by `pip install .`.
#
# Why --no-build-isolation: the extension must be compiled against the very torch it will run
# with (C++ ABI and version); an isolated build environment would fetch its own torch (GBs, and
# possibly another version). So torch and the build tools are installed first, then the build
# uses them.
#
# RELPOS_REQUIRE_CUDA=1 makes the build fail unless the CUDA kernels compile (CI sets it when
# nvcc is present); RELPOS_REQUIRE_CUDA=0 never requires them. Default: required iff nvcc exists.
# RELPOS_TORCH installs another torch version, and RELPOS_BUILD_NAME=NAME builds in
# build/NAME-<wheel tag> with the log in build/pip-install-NAME.log, so that a second venv
# (scripts/test_cpu_torch.sh) leaves the main build as it is.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
venv=${RELPOS_VENV:-$root/.venv}
python_bin=${PYTHON:-$(command -v python3.11 || command -v python3)}

if [ ! -x "$venv/bin/python" ]; then
  echo "== creating venv $venv with $python_bin"
  "$python_bin" -m venv "$venv"
fi
# shellcheck disable=SC1091
. "$venv/bin/activate"

echo "== installing torch and build/test tools"
pip install -q --upgrade pip
pip install -q "torch==${RELPOS_TORCH:-2.14.1}"
pip install -q "scikit-build-core>=0.10" "pybind11>=2.12" "ninja>=1.10" "cmake>=4.0" \
  "pytest>=8" pytest-xdist numpy expecttest hypothesis matplotlib "mypy>=1.10"

require=${RELPOS_REQUIRE_CUDA:-auto}
if [ "$require" = auto ]; then
  if command -v nvcc >/dev/null 2>&1 || [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ]; then
    require=1
  else
    require=0
  fi
fi
cuda_flag=OFF
[ "$require" = 1 ] && cuda_flag=ON

name=${RELPOS_BUILD_NAME:-}
log=build/pip-install${name:+-$name}.log
build_dir=()
[ -n "$name" ] && build_dir=("-Cbuild-dir=build/$name-{wheel_tag}")
echo "== building relpos_ext (pip install --no-build-isolation .; RELPOS_REQUIRE_CUDA=$cuda_flag)"
mkdir -p build
if ! pip install --no-build-isolation -v . -Ccmake.define.RELPOS_REQUIRE_CUDA=$cuda_flag \
    "${build_dir[@]}" > "$log" 2>&1; then
  tail -n 80 "$log"
  echo "== build failed; full log: $log" >&2
  exit 1
fi
grep -E "relpos_ext:" "$log" | sed 's/^ *//'
python -c "import relpos_ext; print('== installed relpos_ext', relpos_ext.build_info())"
