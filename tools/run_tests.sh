#!/usr/bin/env bash
# tools/run_tests.sh: installs what is missing (Debian 12, as root), builds everything and runs the whole suite.
# Adds the CUDA targets when nvcc is available (CUDA tests report "skipped" without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install_deps.sh
cuda=()
nvcc=$(command -v nvcc || true)
[[ -z "$nvcc" && -x /usr/local/cuda/bin/nvcc ]] && nvcc=/usr/local/cuda/bin/nvcc
[[ -n "$nvcc" ]] && cuda=(-DKVC_ENABLE_CUDA=ON "-DCMAKE_CUDA_COMPILER=$nvcc")
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release "${cuda[@]}"
cmake --build build -j "$(nproc)"
ctest --test-dir build -j "$(nproc)" --output-on-failure
