#!/usr/bin/env bash
# The checks that need a GPU, as one call on a lent GPU machine (no CI machine has one; README "How
# CUDA code is verified here"): build relpos_ext against that machine's own torch for one
# architecture, run the test suite's `cuda` backend, time benchmarks/bench_cuda.py (and the eager
# calls' overhead, benchmarks/bench_overhead.py), and time each kernel (benchmarks/profile_cuda.py).
#
#   bash scripts/gpu_check.sh --prebuild     # here, before the call: .gpu/objs, .gpu/whl
#   bash scripts/gpu_check.sh                # there (the device tool: carry .gpu/objs.tgz
#                                            # and .gpu/whl)
#
# --prebuild compiles csrc/cuda/*.cu for RELPOS_GPU_ARCH (default 90) with this machine's nvcc
# (scripts/gpu_nvcc_objs.sh) into .gpu/objs (the .cu files include no torch header, so the
# objects do not depend on the torch they are linked with), and downloads the wheels the GPU
# machine's image may lack (expecttest for torch.library.opcheck; cmake >= 4, which the build
# wants) into .gpu/whl. On the GPU machine
# scripts/gpu_nvcc_cache.sh then copies those objects instead of running nvcc, which saves about
# three minutes of the lent time; without .gpu/objs the .cu files are compiled there.
#
# Writes logs, bench_cuda's JSON and Nsight Compute's report (ncu.txt) under $OUT (default
# build/gpu-out) and prints a summary last. Stage time limits: RELPOS_GPU_TEST_S (default 240),
# RELPOS_GPU_BENCH_S (200), RELPOS_GPU_PROFILE_S (60, benchmarks/profile_cuda.py: per-kernel
# times; RELPOS_GPU_PROFILE_ARGS),
# RELPOS_GPU_NCU_S (120, ncu on scripts/gpu_ncu_cases.py; RELPOS_GPU_NCU_ARGS, _LAUNCHES),
# RELPOS_GPU_SANITIZER_S (60 a tool: compute-sanitizer racecheck and memcheck on the tensor-core
# kernels, scripts/gpu_sanitizer_cases.py), RELPOS_GPU_FUZZ_S (60: scripts/fuzz_attention.py on
# the `cuda` backend, float32/bfloat16/float16, as many seeds as fit);
# RELPOS_GPU_BENCH_ARGS: more arguments for bench_cuda.py (e.g. --forms ...); RELPOS_GPU_TEST_FILES
# and RELPOS_GPU_TEST_K: which test files, and pytest's -k (default: the `cuda` backend's tests);
# RELPOS_GPU_REST_K: a second -k run last, in the time left before RELPOS_GPU_DEADLINE_S (600)
# seconds from the script's start (pytest_more.log). RELPOS_GPU_STAGES: which stages run after the
# build (default "tests fuzz sanitizer bench profile ncu"), so that a lease too short for all of
# them can split them over two calls (the second on the still-warm machine rebuilds in seconds);
# RELPOS_GPU_BENCH_DIMS: head dims for bench_cuda.py, one run each (default 64).
# Each failing test is written to $OUT/failures.txt the moment it fails
# (scripts/pytest_failures_now.py), so a run cut short by its time limit still names them.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

if [ "${1:-}" = --prebuild ]; then
  set -e
  mkdir -p .gpu/objs .gpu/whl
  grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
  bash scripts/gpu_nvcc_objs.sh . .gpu/objs
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .gpu/whl expecttest==0.3.0 cmake==4.1.2
  # The objects travel packed (about a third of their size; the device tool carries 64 MiB):
  # carry .gpu/objs.tgz and .gpu/whl, not .gpu/objs.
  tar czf .gpu/objs.tgz -C .gpu objs
  du -sh .gpu/objs.tgz .gpu/whl
  exit 0
fi

out=${OUT:-$root/build/gpu-out}
mkdir -p "$out"
py=python3
summary=()
stage() { echo; echo "== $* ($(date +%T))"; }
stages=" ${RELPOS_GPU_STAGES:-tests fuzz sanitizer bench profile ncu} "
want() { [[ "$stages" == *" $1 "* ]]; }

stage machine
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
nproc
$py -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"

stage wheels
if compgen -G ".gpu/whl/*.whl" > /dev/null; then
  need=()
  $py -c "import expecttest" 2>/dev/null || need+=(.gpu/whl/expecttest-*.whl)
  cmake_major=$(cmake --version 2>/dev/null | head -1 | sed -E 's/[^0-9]*([0-9]+).*/\1/')
  [ "${cmake_major:-0}" -ge 4 ] || need+=(.gpu/whl/cmake-*.whl)
  if [ ${#need[@]} -gt 0 ]; then
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "${need[@]}"
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
  fi
fi
cmake --version | head -1

stage build
if [ -f .gpu/objs.tgz ] && ! compgen -G ".gpu/objs/*.o" > /dev/null; then
  tar xzf .gpu/objs.tgz -C .gpu
fi
objs=""
compgen -G ".gpu/objs/*.o" > /dev/null && objs=$root/.gpu/objs
t0=$SECONDS
bash scripts/gpu_build.sh "$objs" /tmp/relpos-gpu-build /tmp/relpos-gpu-build.log || exit 1
grep -E "gpu_nvcc_cache|relpos_ext:" /tmp/relpos-gpu-build.log | sed 's/^ *//'
summary+=("build: $((SECONDS - t0)) s")
(cd /tmp && $py -c "import relpos_ext; print(relpos_ext.build_info())")

# One pytest run over the test files with -k "$1", logged to $out/$2, at most $3 seconds; each
# failure appended to $out/failures.txt the moment it happens. One torch thread a worker: the
# float64 references run on the CPU, and 16 workers with 16 threads each oversubscribe the cores.
run_tests() {
  local t0=$SECONDS rc workers xdist=()
  workers=$(( $(nproc) > 16 ? 16 : $(nproc) ))
  $py -c "import xdist" 2>/dev/null && xdist=(-n "$workers")
  # shellcheck disable=SC2086  # RELPOS_GPU_TEST_FILES: a space-separated list
  OMP_NUM_THREADS=1 RELPOS_FAILURES_FILE="$out/failures.txt" \
    PYTHONPATH="$root/scripts${PYTHONPATH:+:$PYTHONPATH}" \
    timeout "$3" $py -m pytest ${RELPOS_GPU_TEST_FILES:-tests/test_attention.py \
    tests/test_ops.py tests/test_positions.py tests/test_autograd_compile.py tests/test_errors.py \
    tests/test_nn_compat.py tests/test_func.py tests/test_rope.py} -q -p no:cacheprovider \
    -p pytest_failures_now \
    -rfE -k "$1" "${xdist[@]}" > "$out/$2" 2>&1
  rc=$?
  grep -E "^(FAILED|ERROR)" "$out/$2" | head -40
  tail -n 3 "$out/$2"
  summary+=("tests ($2): rc $rc, $((SECONDS - t0)) s: $(tail -n 1 "$out/$2")")
}

rm -f "$out/failures.txt"
if want tests; then
  stage tests
  run_tests "${RELPOS_GPU_TEST_K:-cuda and not emu}" pytest.log "${RELPOS_GPU_TEST_S:-240}"
  [ -s "$out/failures.txt" ] && grep '^==== ' "$out/failures.txt" | head -40
fi

if want fuzz; then
  stage fuzz
  t0=$SECONDS
  # Random mixes of every option against the reference (scripts/fuzz_attention.py), as many seeds
  # as fit; its lines go to stdout only (the device tool brings back 8 files at most).
  fuzz_s=${RELPOS_GPU_FUZZ_S:-60}
  timeout "$fuzz_s" $py scripts/fuzz_attention.py --seeds 0:100000 --backends cuda \
    --dtypes float32 bfloat16 float16 --time-limit $((fuzz_s * 3 / 4)) 2>&1 | tail -n 30
  summary+=("fuzz: rc ${PIPESTATUS[0]}, $((SECONDS - t0)) s")
fi

if want sanitizer; then
  stage sanitizer
  t0=$SECONDS
  # Shared-memory races and out-of-bounds accesses of the tensor-core kernels (small cases), both
  # tools' reports in one file (the device tool brings back 8 files at most).
  : > "$out/sanitizer.log"
  for tool in racecheck memcheck; do
    echo "== compute-sanitizer --tool $tool" >> "$out/sanitizer.log"
    timeout "${RELPOS_GPU_SANITIZER_S:-60}" compute-sanitizer --tool "$tool" \
      --kernel-name kns=rel_attention_tc --print-limit 20 $py scripts/gpu_sanitizer_cases.py \
      >> "$out/sanitizer.log" 2>&1
    summary+=("sanitizer $tool: rc $?, $(grep -E 'SUMMARY' "$out/sanitizer.log" | tail -n 1)")
  done
  tail -n 12 "$out/sanitizer.log"
  summary+=("sanitizer: $((SECONDS - t0)) s")
fi

if want bench; then
  stage bench
  t0=$SECONDS
  : > "$out/bench.log"
  for dim in ${RELPOS_GPU_BENCH_DIMS:-64}; do
    json=$out/bench_cuda.json
    [ "$dim" = 64 ] || json=$out/bench_cuda_d$dim.json
    # shellcheck disable=SC2086  # RELPOS_GPU_BENCH_ARGS: extra arguments, split on spaces
    timeout "${RELPOS_GPU_BENCH_S:-200}" $py benchmarks/bench_cuda.py --min-run-time 0.2 \
      --dim "$dim" --out "$json" ${RELPOS_GPU_BENCH_ARGS:-} 2>&1 | tee -a "$out/bench.log"
    summary+=("bench D=$dim: rc ${PIPESTATUS[0]}, $((SECONDS - t0)) s")
  done
  # the per-call overhead of eager calls (small shapes, each call waiting for the GPU)
  t1=$SECONDS
  timeout 60 $py benchmarks/bench_overhead.py --device cuda --rounds 300 \
    --out "$out/bench_overhead_cuda.json" 2>&1 | tee -a "$out/bench.log"
  summary+=("bench_overhead: rc ${PIPESTATUS[0]}, $((SECONDS - t1)) s")
fi

if want profile; then
  stage profile
  t0=$SECONDS
  # shellcheck disable=SC2086  # RELPOS_GPU_PROFILE_ARGS: extra arguments, split on spaces
  timeout "${RELPOS_GPU_PROFILE_S:-60}" $py benchmarks/profile_cuda.py \
    --out "$out/profile_cuda.json" ${RELPOS_GPU_PROFILE_ARGS:-} 2>&1
  summary+=("profile: rc $?, $((SECONDS - t0)) s")
fi

if want ncu; then
  stage ncu
  t0=$SECONDS
  # Nsight Compute on one launch of each tensor-core kernel at a training size
  # (scripts/gpu_ncu_cases.py; RELPOS_GPU_NCU_ARGS, e.g. --dims 64 128, and RELPOS_GPU_NCU_LAUNCHES
  # to match): stall reasons, occupancy and its limits, pipe and memory use, all in ncu.txt.
  ncu_bin=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu \
    2>/dev/null | head -n 1)
  # shellcheck disable=SC2086  # RELPOS_GPU_NCU_ARGS: extra arguments, split on spaces
  timeout "${RELPOS_GPU_NCU_S:-120}" "${ncu_bin:-ncu}" --kernel-name regex:rel_attention_tc \
    --launch-count "${RELPOS_GPU_NCU_LAUNCHES:-3}" --clock-control none --set full \
    --print-details all $py scripts/gpu_ncu_cases.py ${RELPOS_GPU_NCU_ARGS:-} > "$out/ncu.txt" 2>&1
  summary+=("ncu: rc $?, $((SECONDS - t0)) s")
  grep -E "rel_attention_tc|Duration|Achieved Occupancy|Block Limit|Warp Cycles Per Issued" \
    "$out/ncu.txt" | head -n 60
  grep -iE "stall" "$out/ncu.txt" | grep -v "^ *-" | head -n 30
fi

if [ -n "${RELPOS_GPU_REST_K:-}" ]; then
  # More tests (RELPOS_GPU_REST_K, e.g. the cuda tests the first -k left out) in the time left
  # before RELPOS_GPU_DEADLINE_S seconds from the start of this script.
  left=$(( ${RELPOS_GPU_DEADLINE_S:-600} - SECONDS - 15 ))
  if [ "$left" -gt 30 ]; then
    stage "more tests ($left s)"
    run_tests "$RELPOS_GPU_REST_K" pytest_more.log "$left"
    [ -s "$out/failures.txt" ] && grep '^==== ' "$out/failures.txt" | head -40
  fi
fi

stage summary
printf '%s\n' "${summary[@]}"
