#!/usr/bin/env bash
# relpos_ext against a CPU-only build of torch, the wheel many CPU users install (torch.version.cuda
# is None, no CUDA libraries), and an older torch than the main suite's 2.14.1: scripts/setup.sh
# into a venv of its own (build/venv-cpu-torch; RELPOS_CPU_TORCH_VENV overrides) with torch
# $RELPOS_CPU_TORCH (default 2.13.0, the CPU build on these machines' disk) and its own build
# directory (build/cpu-torch-<wheel tag>, so the main build's stays as it is), transformers for
# the compatibility tests, then every test but the emulator's (its library is built against the
# main venv's torch).
# Extra arguments go to pytest.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
torch_version=${RELPOS_CPU_TORCH:-2.13.0}
venv=${RELPOS_CPU_TORCH_VENV:-$root/build/venv-cpu-torch}

# No CUDA kernels to require: a CPU-only torch builds none, whatever nvcc is here.
RELPOS_VENV="$venv" RELPOS_TORCH="$torch_version" RELPOS_BUILD_NAME=cpu-torch RELPOS_REQUIRE_CUDA=0 \
  bash scripts/setup.sh
# shellcheck disable=SC1091
. "$venv/bin/activate"
pip install -q "transformers==5.23.0"
python - <<'PY'
import relpos_ext
import torch
info = relpos_ext.build_info()
assert torch.version.cuda is None, f"torch {torch.__version__} is a CUDA build, not the CPU-only one this step tests"
assert info["torch_version"] == torch.__version__, info
assert info["cuda_archs"] is None, f"CUDA kernels built against a CPU-only torch: {info}"
PY

echo "== pytest on torch $torch_version (CPU build), without the emulator tests"
# No emulator library (a path that does not exist): tests/test_cuda_emu.py loads it while
# collecting, and the one in build/cuda_emu is linked against the main venv's torch.
RELPOS_CUDA_EMU_LIB="$venv/no-emulator.so" RELPOS_REQUIRE_CUDA_EMU=0 RELPOS_REQUIRE_TRANSFORMERS=1 \
  OMP_NUM_THREADS=1 exec python -m pytest tests -q -p no:cacheprovider -ra -m "not emu" \
  -n "${RELPOS_TEST_WORKERS:-auto}" "$@"  # as scripts/test.sh's pytest: a worker per core
