#!/usr/bin/env bash
# tools/install_deps.sh: install what kvc's build, tests, benchmarks and demo need, from Debian 12.
# Idempotent: installs only missing packages. Needs root (or sudo) when something is missing.
#   bash tools/install_deps.sh          # build + tests + demo
#   KVC_DEPS_CI=1 bash tools/install_deps.sh   # also the CI extras (clang, clang-format, sanitizer runtimes, ninja)
# When another apt/dpkg is running (unattended-upgrades, a second install_deps), it waits for the locks
# (KVC_APT_LOCK_TIMEOUT seconds, default 600) and says so, instead of failing at once.
set -euo pipefail

packages=(cmake make g++ libeigen3-dev catch2 libbenchmark-dev libcli11-dev nlohmann-json3-dev python3 python3-numpy)
if [[ "${KVC_DEPS_CI:-0}" == "1" ]]; then
  packages+=(clang clang-format clang-tidy libclang-rt-14-dev git ninja-build)
fi
lock_timeout=${KVC_APT_LOCK_TIMEOUT:-600}
# apt-get install waits on the dpkg locks itself (-o DPkg::Lock::Timeout), but apt-get update (apt 2.6) ignores that
# option for the lists lock and fails at once, so the script also waits on these itself.
apt_locks=(/var/lib/dpkg/lock-frontend /var/lib/dpkg/lock /var/lib/apt/lists/lock /var/cache/apt/archives/lock)

# Prints "PID (COMMAND) holds FILE" for the first of the given lock files that a process holds (apt and dpkg take
# POSIX fcntl locks, which /proc/locks lists as MAJOR:MINOR:INODE in hex:hex:decimal); prints nothing if all are free.
lock_holder() {
  local f dev ino id pid
  for f in "$@"; do
    [[ -e "$f" ]] || continue
    read -r dev ino < <(stat -L -c '%d %i' "$f") || continue
    printf -v id '%02x:%02x:%s' $(((dev >> 8) & 0xfff)) $(((dev & 0xff) | ((dev >> 12) & 0xfff00))) "$ino"
    pid=$(awk -v id="$id" '$0 ~ /POSIX/ { for (i = 1; i < NF; ++i) if ($i == id) { print $(i - 1); exit } }' \
          /proc/locks 2>/dev/null || true)
    if [[ -n "$pid" ]]; then
      echo "$pid ($(cat "/proc/$pid/comm" 2>/dev/null || echo '?')) holds $f"
      return 0
    fi
  done
}

# Waits until none of the given lock files is held, at most until $deadline (epoch seconds); reports the wait.
wait_for_locks() {
  local holder last=""
  while holder=$(lock_holder "$@") && [[ -n "$holder" ]]; do
    if ((SECONDS >= deadline)); then
      echo "install_deps: gave up after ${lock_timeout} s: $holder (another apt/dpkg is still running)" >&2
      return 1
    fi
    if [[ "$holder" != "$last" ]]; then
      echo "install_deps: waiting for another apt/dpkg to finish: $holder (up to $((deadline - SECONDS)) s more)"
      last=$holder
    fi
    sleep 2
  done
}

main() {
  local missing=() p
  for p in "${packages[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
      missing+=("$p")
    fi
  done

  if ((${#missing[@]} == 0)); then
    echo "install_deps: all ${#packages[@]} packages present"
    return 0
  fi

  echo "install_deps: installing ${missing[*]}"
  local sudo_cmd=()
  if [[ $(id -u) -ne 0 ]]; then
    command -v sudo >/dev/null || { echo "install_deps: need root or sudo to install ${missing[*]}" >&2; return 1; }
    sudo_cmd=(sudo)
  fi
  export DEBIAN_FRONTEND=noninteractive
  deadline=$((SECONDS + lock_timeout))
  # update: wait for the locks ourselves; if another apt grabbed the lists lock between our check and apt-get's own
  # attempt, apt-get fails at once, so wait again and retry (until the deadline) when the lock is held again.
  while true; do
    wait_for_locks "${apt_locks[@]}"
    "${sudo_cmd[@]}" apt-get -o DPkg::Lock::Timeout=$((deadline > SECONDS ? deadline - SECONDS : 1)) update -qq \
      && break
    [[ -n "$(lock_holder "${apt_locks[@]}")" ]] && ((SECONDS < deadline)) || return 1
  done
  wait_for_locks "${apt_locks[@]}"
  # install: apt-get waits on the dpkg frontend lock itself for the rest of the allowance.
  "${sudo_cmd[@]}" apt-get -o DPkg::Lock::Timeout=$((deadline > SECONDS ? deadline - SECONDS : 1)) \
    install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  echo "install_deps: done"
}

# Run when executed (bash tools/install_deps.sh); sourcing only defines the functions (for testing them).
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  main "$@"
fi
