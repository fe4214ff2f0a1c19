#!/usr/bin/env bash
# Installs the Debian packages kiln builds and tests with. The CUDA toolkit
# (NVRTC, cuda.h) is expected in /usr/local/cuda, as on every kiln machine.
# clang is for the libFuzzer run of scripts/test.sh; redis-server for the
# remote layer's test (tests/test_cache_remote.c starts its own).
set -euo pipefail
pkgs=(cmake make gcc pkg-config python3 libsqlite3-dev libzstd-dev libssl-dev libcjson-dev libcmocka-dev libhiredis-dev redis-server clang)
sudo=""; [[ $(id -u) == 0 ]] || sudo=sudo
updated=0
install() {
  local missing=()
  for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  ((${#missing[@]})) || return 0
  if ((!updated)); then $sudo apt-get update -qq; updated=1; fi
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}
install "${pkgs[@]}"
# libFuzzer's runtime is only recommended by clang (libclang-rt-14-dev on Debian 12).
rt=libclang-rt-$(clang -dumpversion | cut -d. -f1)-dev
if ! dpkg -s "$rt" >/dev/null 2>&1; then
  if ((!updated)); then $sudo apt-get update -qq; updated=1; fi
  if apt-cache show "$rt" >/dev/null 2>&1; then install "$rt"; fi
fi
[[ -e /usr/local/cuda/include/nvrtc.h ]] || { echo "deps: the CUDA toolkit is not in /usr/local/cuda" >&2; exit 1; }
