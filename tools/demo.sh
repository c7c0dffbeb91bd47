#!/usr/bin/env bash
# tools/demo.sh: the main job. Installs what is missing (Debian 12, as root), builds the demo and runs it:
# every policy at several ratios on the documented synthetic cache, or on a dump directory.
#   bash tools/demo.sh                   # synthetic cache
#   bash tools/demo.sh --dump DIR        # real keys/values/queries (.npy), e.g. from tools/reference/model.py
#   bash tools/demo.sh --model ../shared/models/tinystories-656k   # dumps that model's cache first (needs numpy)
# Relative DIRs are taken from the directory you run the script in (the script itself works in the repo root).
set -euo pipefail

here=$PWD
absolute() { realpath -m -s -- "$([[ "$1" == /* ]] || printf '%s/' "$here")$1"; }  # need not exist (yet)

# Parse before cd'ing to the repo root, so relative --model/--dump paths still mean what the user typed.
model=""
args=()
while (($#)); do
  case "$1" in
    --model | --dump)
      if (($# < 2)); then
        echo "demo: $1 needs a directory" >&2
        exit 2
      fi
      if [[ "$1" == --model ]]; then model=$(absolute "$2"); else args+=(--dump "$(absolute "$2")"); fi
      shift 2
      ;;
    --model=* | --dump=*)
      set -- "${1%%=*}" "${1#*=}" "${@:2}"
      ;;
    *)
      args+=("$1")
      shift
      ;;
  esac
done

cd "$(dirname "$0")/.."
bash tools/install_deps.sh
mkdir -p build-demo
if [[ -n "$model" ]]; then
  dump=$PWD/build-demo/tinystories_dump
  echo "demo: generating a story with $model and dumping its KV cache to $dump"
  /usr/bin/python3 tools/reference/model.py --model "$model" --out "$dump" --tokens 256
  args+=(--dump "$dump")
fi

# Quiet build, but never silent: say what is happening, and on failure show the end of the log.
log=$PWD/build-demo/demo-build.log
run_logged() {
  if ! "$@" >"$log" 2>&1; then
    echo "demo: '$*' failed; the last 40 lines of $log:" >&2
    tail -n 40 "$log" >&2
    exit 1
  fi
}
echo "demo: configuring (build-demo/)..."
run_logged cmake -S . -B build-demo -DCMAKE_BUILD_TYPE=Release -DKVC_BUILD_TESTS=OFF -DKVC_BUILD_BENCHMARKS=OFF
echo "demo: building kvc_demo (first build takes a minute)..."
run_logged cmake --build build-demo -j "$(nproc)" --target kvc_demo
echo "demo: running build-demo/examples/kvc_demo ${args[*]}"
exec build-demo/examples/kvc_demo "${args[@]}"
