#!/usr/bin/env bash
# Developer build without pip: configure + build the extension into build/dev-<name> and stage an
# importable package there. Use it to work on several checkouts at once:
#   bash scripts/dev_build.sh mine [-DRELPOS_WITH_CUDA=OFF ...]
#   PYTHONPATH=build/dev-mine/stage pytest tests
set -euo pipefail
name=${1:-default}; shift || true
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$(command -v python)}
bdir="$root/build/dev-$name"
mkdir -p "$root/build"
cmake -S "$root" -B "$bdir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$py" \
  -DSKBUILD_PROJECT_VERSION=0.0.0+dev "$@" > "$bdir.configure.log" 2>&1 || { cat "$bdir.configure.log"; exit 1; }
grep "relpos_ext:" "$bdir.configure.log" || true
cmake --build "$bdir" -j "$(nproc)"
rm -rf "$bdir/stage" && mkdir -p "$bdir/stage"
cp -r "$root/python/relpos_ext" "$bdir/stage/"
cp "$bdir"/_C*.so "$bdir/stage/relpos_ext/"
echo "staged: PYTHONPATH=$bdir/stage"
