#!/usr/bin/env bash
# tools/run_tests.sh: installs what is missing (Debian 12, as root), builds everything and runs the whole suite.
# Adds the CUDA targets when nvcc is available (CUDA tests report "skipped" without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
echo "run_tests: checking dependencies..."
bash tools/install_deps.sh
cuda=()
nvcc=$(command -v nvcc || true)
[[ -z "$nvcc" && -x /usr/local/cuda/bin/nvcc ]] && nvcc=/usr/local/cuda/bin/nvcc
cuda_note="off, no nvcc found"
if [[ -n "$nvcc" ]]; then
  cuda=(-DKVC_ENABLE_CUDA=ON "-DCMAKE_CUDA_COMPILER=$nvcc")
  cuda_note="on, $nvcc"
fi
echo "run_tests: configuring build/ (CUDA: $cuda_note)..."
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release "${cuda[@]}"
echo "run_tests: building everything with $(nproc) jobs..."
cmake --build build -j "$(nproc)"
echo "run_tests: running the tests (ctest)..."
ctest --test-dir build -j "$(nproc)" --output-on-failure
