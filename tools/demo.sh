#!/usr/bin/env bash
# tools/demo.sh: the main job. Installs what is missing (Debian 12, as root), builds the demo and runs it:
# every policy at several ratios on the documented synthetic cache, or on a dump directory.
#   bash tools/demo.sh                   # synthetic cache
#   bash tools/demo.sh --dump DIR        # real keys/values/queries (.npy), e.g. from tools/reference/model.py
#   bash tools/demo.sh --model ../shared/models/tinystories-656k   # dumps that model's cache first (needs numpy)
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install_deps.sh
args=()
while (($#)); do
  if [[ "$1" == "--model" && $# -ge 2 ]]; then
    dump=build-demo/tinystories_dump
    echo "demo: generating a story with $2 and dumping its KV cache to $dump"
    /usr/bin/python3 tools/reference/model.py --model "$2" --out "$dump" --tokens 256
    args+=(--dump "$dump")
    shift 2
  else
    args+=("$1")
    shift
  fi
done
cmake -S . -B build-demo -DCMAKE_BUILD_TYPE=Release -DKVC_BUILD_TESTS=OFF -DKVC_BUILD_BENCHMARKS=OFF >/dev/null
cmake --build build-demo -j "$(nproc)" --target kvc_demo >/dev/null
exec build-demo/examples/kvc_demo "${args[@]}"
