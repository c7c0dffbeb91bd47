#!/usr/bin/env bash
# tools/install_deps.sh: install what kvc's build, tests, benchmarks and demo need, from Debian 12.
# Idempotent: installs only missing packages. Needs root (or sudo) when something is missing.
#   bash tools/install_deps.sh          # build + tests + demo
#   KVC_DEPS_CI=1 bash tools/install_deps.sh   # also the CI extras (clang, clang-format, sanitizer runtimes)
set -euo pipefail

packages=(cmake make g++ libeigen3-dev catch2 libbenchmark-dev python3 python3-numpy)
if [[ "${KVC_DEPS_CI:-0}" == "1" ]]; then
  packages+=(clang clang-format clang-tidy libclang-rt-14-dev git)
fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]} == 0)); then
  echo "install_deps: all ${#packages[@]} packages present"
  exit 0
fi

echo "install_deps: installing ${missing[*]}"
sudo_cmd=()
if [[ $(id -u) -ne 0 ]]; then
  command -v sudo >/dev/null || { echo "install_deps: need root or sudo to install ${missing[*]}" >&2; exit 1; }
  sudo_cmd=(sudo)
fi
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "install_deps: done"
