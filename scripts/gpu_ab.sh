#!/usr/bin/env bash
# Times a CUDA kernel change against the kernels it replaces, in one call on a lent GPU machine:
# the working tree's kernels (new) and those of a base revision (base), new again, each timed by
# benchmarks/bench_cuda.py on the same machine (timings of two machines do not compare), with the
# cuda tests that take the changed kernels run on new first.
#
#   bash scripts/gpu_ab.sh --prebuild BASE   # here: .gpu/objs.tgz (working tree) and
#                                            # .gpu/objs_base.tgz (BASE), both for RELPOS_GPU_ARCH
#   bash scripts/gpu_ab.sh                   # there (the device tool: carry .gpu/objs.tgz and
#                                            # .gpu/objs_base.tgz)
#
# Only the kernels may differ: the objects of csrc/cuda/*.cu are swapped under the same host build
# (scripts/gpu_nvcc_cache.sh copies an object instead of running nvcc), so --prebuild refuses a
# BASE whose csrc/ outside csrc/cuda/*.cu and *.cuh, or whose python/, differs from the working
# tree. There: the build of new (about a minute), RELPOS_AB_TEST_K's cuda tests (default: the
# tensor-core, backward and deterministic ones; RELPOS_AB_TEST_S seconds, 150), then for new, base
# and new again a rebuild (about 15 s: the changed objects and the link) and bench_cuda.py over
# RELPOS_AB_DIMS (64 128) with RELPOS_AB_FORMS (ours_shaw ours_keys ours_c2p_p2c; rel_q's form at
# head dims up to 64 only) and RELPOS_AB_BENCH_ARGS. Prints each row's times and base/new ratios
# last (above 1: new is faster). Writes the JSON of each bench under $OUT (at most 8 files come
# back from the device tool: two head dims x three runs, the tests' log, failures).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

if [ "${1:-}" = --prebuild ]; then
  set -e
  base=${2:?usage: $0 --prebuild BASE}
  if ! git diff --quiet "$base" -- python ':(glob)csrc/**' ':!csrc/cuda/*.cu' ':!csrc/cuda/*.cuh'; then
    echo "gpu_ab: $base differs from the working tree outside the kernels:" >&2
    git diff --stat "$base" -- python ':(glob)csrc/**' ':!csrc/cuda/*.cu' ':!csrc/cuda/*.cuh' >&2
    exit 1
  fi
  bash scripts/gpu_check.sh --prebuild  # the working tree's objects: .gpu/objs, .gpu/objs.tgz
  tree=$(mktemp -d)
  git worktree add -q --detach "$tree" "$base"
  trap 'git worktree remove --force "$tree"' EXIT
  rm -rf .gpu/objs_base && mkdir -p .gpu/objs_base
  bash scripts/gpu_nvcc_objs.sh "$tree" .gpu/objs_base
  for o in .gpu/objs_base/*.o; do  # only the objects that differ need to travel
    cmp -s "$o" ".gpu/objs/$(basename "$o")" && rm "$o"
  done
  ls .gpu/objs_base
  [ -n "$(ls .gpu/objs_base)" ] || { echo "gpu_ab: no kernel object differs from $base" >&2; exit 1; }
  tar czf .gpu/objs_base.tgz -C .gpu objs_base
  du -sh .gpu/objs.tgz .gpu/objs_base.tgz
  exit 0
fi

out=${OUT:-$root/build/gpu-ab}
mkdir -p "$out"
py=python3
tar xzf .gpu/objs.tgz -C .gpu && tar xzf .gpu/objs_base.tgz -C .gpu || exit 1
rm -rf .gpu/ab_new .gpu/ab_base && mkdir -p .gpu/ab_new .gpu/ab_base
cp .gpu/objs/*.o .gpu/ab_new/ && cp .gpu/objs/*.o .gpu/ab_base/ && cp .gpu/objs_base/*.o .gpu/ab_base/
changed=()
for o in .gpu/objs_base/*.o; do changed+=("csrc/cuda/$(basename "$o" .o)"); done
echo "== kernels that differ: ${changed[*]}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader

build() {  # $1: new or base
  local t0=$SECONDS
  touch "${changed[@]}"  # ninja recompiles them: the launcher copies $1's objects
  bash scripts/gpu_build.sh "$root/.gpu/ab_$1" /tmp/relpos-gpu-ab-build "/tmp/gpu_ab_build_$1.log" ||
    exit 1
  grep -c "gpu_nvcc_cache: .* from $root/.gpu/ab_$1/" "/tmp/gpu_ab_build_$1.log" |
    sed "s/^/== build $1: objects copied: /"
  echo "== build $1: $((SECONDS - t0)) s"
}

bench() {  # $1: the run's name
  local d forms
  for d in ${RELPOS_AB_DIMS:-64 128}; do
    forms=${RELPOS_AB_FORMS:-ours_shaw ours_keys ours_c2p_p2c}
    [ "$d" -gt 64 ] && forms=${forms//ours_c2p_p2c/}
    # shellcheck disable=SC2086  # word lists
    timeout 120 $py benchmarks/bench_cuda.py --dim "$d" --forms $forms --min-run-time 0.2 \
      ${RELPOS_AB_BENCH_ARGS:-} --out "$out/bench_${1}_d$d.json" > /dev/null 2>&1 ||
      echo "== bench $1 D=$d: rc $?"
  done
}

build new
rm -f "$out/failures.txt"
RELPOS_FAILURES_FILE="$out/failures.txt" PYTHONPATH="$root/scripts" OMP_NUM_THREADS=1 \
  timeout "${RELPOS_AB_TEST_S:-150}" $py -m pytest tests/test_attention.py -q -p no:cacheprovider \
  -p pytest_failures_now -n "$(nproc)" \
  -k "${RELPOS_AB_TEST_K:-cuda and not emu and (tensor_core or backward or deterministic)}" \
  > "$out/pytest.log" 2>&1
echo "== tests on new: rc $? $(tail -n 1 "$out/pytest.log")"
grep -E "^(FAILED|ERROR)" "$out/pytest.log" | head -20
bench new
build base
bench base
build new
bench new2

$py - "$out" <<'EOF'
import glob, json, os, sys
out = sys.argv[1]
runs = {}
for path in glob.glob(os.path.join(out, "bench_*_d*.json")):
    run, dim = os.path.basename(path)[len("bench_"):-len(".json")].rsplit("_d", 1)
    for r in json.load(open(path))["rows"]:
        runs.setdefault((int(dim), r["form"], r["L"], r["mode"]), {})[run] = r["time_ms"]
print(f"{'D':>4} {'form':14s} {'L':>6} {'mode':8s} {'base':>9} {'new':>9} {'new2':>9}  base/new base/new2")
for key in sorted(runs):
    t = runs[key]
    cells = [t.get(n, float("nan")) for n in ("base", "new", "new2")]
    print(f"{key[0]:4d} {key[1]:14s} {key[2]:6d} {key[3]:8s} " + " ".join(f"{c:9.3f}" for c in cells)
          + f"  {cells[0] / cells[1]:8.3f} {cells[0] / cells[2]:9.3f}")
EOF
