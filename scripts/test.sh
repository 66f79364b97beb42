#!/usr/bin/env bash
# The whole test suite from a clean clone: set up (scripts/setup.sh), build the CUDA emulator
# library, run pytest on every backend, rerun the CPU tests on a build without OpenMP
# (scripts/test_no_openmp.sh) and against a CPU-only torch (scripts/test_cpu_torch.sh), then
# rerun the emulator tests under AddressSanitizer.
set -euo pipefail
# Each step's wall time, for CI's log (CI must finish within 90 minutes on two cores).
stage_done() { echo "== $1 done after $((SECONDS / 60)) min $((SECONDS % 60)) s in all"; }
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/setup.sh
stage_done "setup"
# shellcheck disable=SC1091
. "${RELPOS_VENV:-$root/.venv}/bin/activate"

echo "== installing transformers (tests/test_hf_compat.py checks relpos_ext.hf against it)"
pip install -q "transformers==5.23.0"

echo "== building the CUDA emulator (tests/cuda_emu)"
bash scripts/build_cuda_emu.sh
stage_done "emulator build"

echo "== pytest (cpu-scalar, cpu-avx2, cuda-emu; cuda where a GPU exists)"
export RELPOS_REQUIRE_CUDA_EMU=1
export RELPOS_REQUIRE_TRANSFORMERS=1  # installed above: its tests must not skip
# A pytest-xdist worker per core (RELPOS_TEST_WORKERS overrides), each on one torch thread: on
# two cores 1.8x faster than one process on two threads. The kernels' threaded paths are tested
# by tests/test_threads.py and again by the no-OpenMP step, which runs on every core.
OMP_NUM_THREADS=1 python -m pytest tests -q -p no:cacheprovider -ra -n "${RELPOS_TEST_WORKERS:-auto}"
stage_done "pytest"

echo "== CPU tests on a build without OpenMP (scripts/test_no_openmp.sh)"
bash scripts/test_no_openmp.sh
stage_done "no-OpenMP tests"

echo "== the tests against a CPU-only torch, in a venv of their own (scripts/test_cpu_torch.sh)"
bash scripts/test_cpu_torch.sh
stage_done "CPU-only torch tests"

echo "== emulator tests under AddressSanitizer"
bash scripts/test_asan.sh
stage_done "AddressSanitizer tests"
