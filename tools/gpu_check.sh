#!/usr/bin/env bash
# tools/gpu_check.sh: the first thing to run on a machine with an NVIDIA GPU (one command, about 10 minutes on one
# H100). It finds the GPU and its compute capability, builds kvc's CUDA targets for it, runs the CUDA parity suite,
# compute-sanitizer (memcheck on the whole suite; racecheck, synccheck and initcheck on a fast subset), then the CUDA
# benchmarks of the streaming scorers, top-k, compaction, decode attention and packed attention next to the
# device's own measured read bandwidth, and writes one markdown report that it prints at the end.
#
#   bash tools/gpu_check.sh [REPORT.md]      # default: build-gpu/gpu_check.md
#
# Exits non-zero if any step fails. Without a GPU it builds the CUDA targets, says that no GPU was found, and
# exits 0. Environment: KVC_GPU_BUILD (build folder, default build-gpu), KVC_GPU_JOBS (parallel jobs, default nproc),
# CUDACXX / nvcc on PATH or in /usr/local/cuda/bin.
set -uo pipefail
cd "$(dirname "$0")/.."
build=${KVC_GPU_BUILD:-build-gpu}
jobs=${KVC_GPU_JOBS:-$(nproc)}
report=${1:-$build/gpu_check.md}
mkdir -p "$build" "$(dirname "$report")"
log=$build/gpu_check.log
: >"$log"
failures=0
started=$SECONDS

say() { echo "gpu_check: $*"; }
section() { printf '\n## %s\n\n' "$1" >>"$report"; }
# step NAME SECONDS COMMAND...: runs the command under a time limit, logs it, records pass/fail in the report.
step() {
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS rc=0
  say "$name"
  timeout "$limit" "$@" >"$build/step.out" 2>&1 || rc=$?
  cat "$build/step.out" >>"$log"
  local verdict="passed"
  if ((rc == 124)); then
    verdict="FAILED (timed out after ${limit} s)"
  elif ((rc != 0)); then
    verdict="FAILED (exit $rc)"
  fi
  [[ $verdict == passed ]] || failures=$((failures + 1))
  printf -- '- **%s**: %s in %d s\n' "$name" "$verdict" $((SECONDS - t0)) >>"$report"
  if [[ $verdict != passed ]]; then
    printf '\n  ```\n' >>"$report"
    tail -n 25 "$build/step.out" | sed 's/^/  /' >>"$report"
    printf '  ```\n' >>"$report"
  fi
  return "$rc"
}

nvcc=${CUDACXX:-$(command -v nvcc || true)}
[[ -z "$nvcc" && -x /usr/local/cuda/bin/nvcc ]] && nvcc=/usr/local/cuda/bin/nvcc
sanitizer=$(command -v compute-sanitizer || true)
[[ -z "$sanitizer" && -x /usr/local/cuda/bin/compute-sanitizer ]] && sanitizer=/usr/local/cuda/bin/compute-sanitizer
[[ -z "$sanitizer" && -x /usr/local/cuda/compute-sanitizer/compute-sanitizer ]] &&
  sanitizer=/usr/local/cuda/compute-sanitizer/compute-sanitizer

gpu="" cc=""
if command -v nvidia-smi >/dev/null 2>&1; then
  line=$(nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv,noheader 2>/dev/null |
    head -n 1)
  if [[ -n "$line" ]]; then
    gpu=$line
    cc=$(echo "$line" | awk -F', ' '{print $2}' | tr -d '.')
  fi
fi

{
  echo "# kvc GPU check"
  echo
  echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with local changes)')"
  echo "- GPU: ${gpu:-none found}"
  echo "- nvcc: $([[ -n "$nvcc" ]] && "$nvcc" --version | tail -n 1 || echo 'not found')"
  echo "- compute-sanitizer: ${sanitizer:-not found}"
} >"$report"

if [[ -z "$nvcc" ]]; then
  say "nvcc not found: cannot build the CUDA targets"
  echo "- **build**: FAILED (nvcc not found)" >>"$report"
  cat "$report"
  exit 1
fi

arch=${cc:-90}
section "Build (sm_$arch, Release)"
step "configure" 300 cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DKVC_ENABLE_CUDA=ON \
  -DCMAKE_CUDA_COMPILER="$nvcc" -DCMAKE_CUDA_ARCHITECTURES="$arch" -DKVC_BUILD_EXAMPLES=ON -DKVC_BUILD_TOOLS=OFF ||
  { cat "$report"; exit 1; }
step "build kvc.backend.cuda.parity, kvc.bench.cuda and the CUDA engine example" 1500 \
  cmake --build "$build" -j "$jobs" --target kvc.backend.cuda.parity kvc.bench.cuda kvc_example_cuda ||
  { cat "$report"; exit 1; }

if [[ -z "$gpu" ]]; then
  say "no GPU found (nvidia-smi lists none): built the CUDA targets, ran nothing"
  printf '\nNo GPU found: the CUDA targets were built; nothing ran.\n' >>"$report"
  cat "$report"
  exit 0
fi

parity=$build/tests/kvc.backend.cuda.parity
bench=$build/benchmarks/kvc.bench.cuda
# A fast subset for the slow sanitizer tools: one case per kernel family that uses shared memory and barriers.
subset='cuda: attention matches the CPU*,cuda: top-k keeps exactly*,cuda: compaction*,cuda: packed attention matches*'

section "Parity suite (CPU ≡ CUDA)"
step "kvc.backend.cuda.parity" 600 "$parity" --reporter compact
grep -E '^(All tests passed|test cases:)' "$build/step.out" | sed 's/^/  /' >>"$report"
step "examples/03_cuda_engine (the engine loop of docs/integration.md)" 120 "$build/examples/kvc_example_cuda"
grep -E '^ok:' "$build/step.out" | sed 's/^/  /' >>"$report"

section "compute-sanitizer"
if [[ -z "$sanitizer" ]]; then
  echo "- SKIPPED: compute-sanitizer not found" >>"$report"
else
  step "memcheck (whole suite)" 900 "$sanitizer" --tool memcheck --error-exitcode 3 --leak-check full "$parity"
  for tool in racecheck synccheck initcheck; do
    step "$tool ($subset)" 600 "$sanitizer" --tool "$tool" --error-exitcode 3 "$parity" "$subset"
  done
fi

section "Benchmarks (bytes/s against the device's own read bandwidth, BM_Cuda_MemoryRead)"
filter='MemoryRead|KeyDiff|Knorm|SnapKV|TopK|Compact|RaggedAttend|PackedAttend'
if step "kvc.bench.cuda" 900 "$bench" "--benchmark_filter=($filter).*tokens:(4096|32768)(/dim:128)?/" \
  --benchmark_min_time=0.05 --benchmark_format=console --benchmark_counters_tabular=true; then
  read_bw=$(grep -E '^BM_Cuda_MemoryRead/tokens:32768/dim:128' "$build/step.out" | grep -oE '[0-9.]+[GT]i?B/s' | head -n 1)
  printf '\nDevice read bandwidth (BM_Cuda_MemoryRead, 32K x 128): %s\n\n```\n' "${read_bw:-?}" >>"$report"
  grep -E '^(BM_|Benchmark|-)' "$build/step.out" >>"$report"
  printf '```\n' >>"$report"
fi

printf '\n%d failed step(s); %d s in all.\n' "$failures" $((SECONDS - started)) >>"$report"
cat "$report"
((failures == 0))
