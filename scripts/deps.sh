#!/usr/bin/env bash
# Installs the Debian packages kiln builds and tests with. The CUDA toolkit
# (NVRTC, cuda.h) is expected in /usr/local/cuda, as on every kiln machine.
set -euo pipefail
pkgs=(cmake make gcc pkg-config python3 libsqlite3-dev libzstd-dev libssl-dev libcjson-dev libcmocka-dev)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if ((${#missing[@]})); then
  sudo=""; [[ $(id -u) == 0 ]] || sudo=sudo
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
[[ -e /usr/local/cuda/include/nvrtc.h ]] || { echo "deps: the CUDA toolkit is not in /usr/local/cuda" >&2; exit 1; }
