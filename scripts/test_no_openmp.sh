#!/usr/bin/env bash
# The CPU kernels as builds without OpenMP run them (clang without libomp, clang with LLVM's
# libomp, Apple clang): a CPU-only dev build with RELPOS_OPENMP=OFF (build/dev-no-openmp), which
# must find torch's OpenMP runtime at run time (csrc/cpu/parallel.h), then the tests of every CPU
# op and of the thread sources on it.
# Extra arguments go to pytest.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
bash scripts/dev_build.sh no-openmp -DRELPOS_WITH_CUDA=OFF -DRELPOS_OPENMP=OFF
# the source test_threads.py must find there: RELPOS_EXPECT_NO_OPENMP_THREADS (CI: gomp, torch's
# libgomp reached at run time), else no expectation
export RELPOS_EXPECT_CPU_THREADS="${RELPOS_EXPECT_NO_OPENMP_THREADS:-}"
PYTHONPATH="$repo/build/dev-no-openmp/stage" exec python -m pytest -q -p no:cacheprovider \
  tests/test_threads.py tests/test_ops.py tests/test_attention.py -k "cpu or threads" "$@"
