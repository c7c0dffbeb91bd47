#!/usr/bin/env bash
# tools/demo.sh: the main job. Installs what is missing (Debian 12, as root), builds the demo and runs it:
# kvc-eval on a real model (every policy at four ratios, and SnapKV with AdaKV's head budgets on a ragged store:
# quality against memory, plots, a generation side by side)
# when one is at hand, else every policy on the documented synthetic cache.
#   bash tools/demo.sh                   # kvc-eval on both models of ../shared/models when that folder exists
#                                        # next to the repository, else the synthetic cache
#   bash tools/demo.sh --model DIR       # kvc-eval on your model (Hugging Face Llama directory or llama2.c .bin)
#   bash tools/demo.sh --synthetic       # the synthetic cache, even when a model is at hand
#   bash tools/demo.sh --dump DIR        # real keys/values/queries (.npy), e.g. from `kvc-eval dump`
# Relative DIRs are taken from the directory you run the script in (the script itself works in the repo root).
set -euo pipefail

here=$PWD
absolute() { realpath -m -s -- "$([[ "$1" == /* ]] || printf '%s/' "$here")$1"; }  # need not exist (yet)

# Parse before cd'ing to the repo root, so relative --model/--dump paths still mean what the user typed.
models=()
synthetic=0
args=()
while (($#)); do
  case "$1" in
    --model | --dump)
      if (($# < 2)); then
        echo "demo: $1 needs a directory" >&2
        exit 2
      fi
      if [[ "$1" == --model ]]; then models+=("$(absolute "$2")"); else args+=(--dump "$(absolute "$2")"); fi
      shift 2
      ;;
    --model=* | --dump=*)
      set -- "${1%%=*}" "${1#*=}" "${@:2}"
      ;;
    --synthetic)
      synthetic=1
      shift
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
# No --model, --dump or --synthetic: the shared models next to the repository, when they are there.
if ((${#models[@]} == 0 && ${#args[@]} == 0 && synthetic == 0)) && [[ -d ../shared/models ]]; then
  for m in ../shared/models/tinystories-656k ../shared/models/stories260k; do
    [[ -d "$m" ]] && models+=("$(realpath "$m")")
  done
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
if ((${#models[@]} > 0)); then
  echo "demo: building kvc-eval (first build takes a minute)..."
  run_logged cmake --build build-demo -j "$(nproc)" --target kvc_eval
  for m in "${models[@]}"; do
    out=$PWD/build-demo/eval/$(basename "$m" .bin)
    echo
    # Every policy, plus one with AdaKV's head-adaptive budgets on a ragged per-head store (docs/eval.md).
    echo "demo: build-demo/tools/eval/kvc-eval run --model $m --out-dir $out --policies all,snap_kv+ada_kv"
    build-demo/tools/eval/kvc-eval run --model "$m" --out-dir "$out" --policies all,snap_kv+ada_kv
    echo "demo: plots written to $out/kl.svg and $out/top1.svg (open them in a browser); table in $out/results.csv"
  done
  exit 0
fi
echo "demo: building kvc_demo (first build takes a minute)..."
run_logged cmake --build build-demo -j "$(nproc)" --target kvc_demo
echo "demo: running build-demo/examples/kvc_demo ${args[*]}"
exec build-demo/examples/kvc_demo "${args[@]}"
