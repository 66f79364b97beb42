#!/usr/bin/env bash
# The whole test suite from a clean clone: set up (scripts/setup.sh), build the CUDA emulator
# library, run pytest on every backend, rerun the CPU tests on a build without OpenMP
# (scripts/test_no_openmp.sh) and against a CPU-only torch (scripts/test_cpu_torch.sh), then
# rerun the emulator tests under AddressSanitizer.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/setup.sh
# shellcheck disable=SC1091
. "${RELPOS_VENV:-$root/.venv}/bin/activate"

echo "== installing transformers (tests/test_hf_compat.py checks relpos_ext.hf against it)"
pip install -q "transformers==5.23.0"

echo "== building the CUDA emulator (tests/cuda_emu)"
bash scripts/build_cuda_emu.sh

echo "== pytest (cpu-scalar, cpu-avx2, cuda-emu; cuda where a GPU exists)"
export RELPOS_REQUIRE_CUDA_EMU=1
export RELPOS_REQUIRE_TRANSFORMERS=1  # installed above: its tests must not skip
python -m pytest tests -q -p no:cacheprovider -ra

echo "== CPU tests on a build without OpenMP (scripts/test_no_openmp.sh)"
bash scripts/test_no_openmp.sh

echo "== the tests against a CPU-only torch, in a venv of their own (scripts/test_cpu_torch.sh)"
bash scripts/test_cpu_torch.sh

echo "== emulator tests under AddressSanitizer"
bash scripts/test_asan.sh
