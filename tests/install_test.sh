#!/usr/bin/env bash
# Installs kiln from BUILD_DIR into a scratch prefix, then proves that another
# project finds it: CMake's find_package(kiln), pkg-config, and that neither
# the library nor the CLI links libcuda.
# Usage: install_test.sh SOURCE_DIR BUILD_DIR SCRATCH_DIR "EXTRA_C_FLAGS"
set -euo pipefail
src=$1 build=$2 scratch=$3 flags=${4:-}
rm -rf "$scratch" && mkdir -p "$scratch"
prefix=$scratch/prefix
cmake --install "$build" --prefix "$prefix" >/dev/null
lib=$(ls "$prefix"/lib*/libkiln.so* | head -n 1)
for f in "$lib" "$prefix/bin/kiln"; do
  if ldd "$f" | grep -q 'libcuda\.so'; then echo "FAIL: $f links libcuda"; exit 1; fi
done
test -f "$prefix/include/kiln/kiln.h" || { echo "FAIL: headers not installed"; exit 1; }
cmake -S "$src/examples/consumer" -B "$scratch/consumer" -DCMAKE_PREFIX_PATH="$prefix" \
  -DCMAKE_C_FLAGS="$flags" -DCMAKE_EXE_LINKER_FLAGS="$flags" >/dev/null
cmake --build "$scratch/consumer" >/dev/null
out=$("$scratch/consumer/consumer" "$scratch/kernels.db")
echo "$out"
case "$out" in *"compiled"*) ;; *) echo "FAIL: consumer did not compile"; exit 1;; esac
out=$("$scratch/consumer/consumer" "$scratch/kernels.db")
case "$out" in *"cached"*) ;; *) echo "FAIL: consumer did not find its kernel cached"; exit 1;; esac
pcdir=$(dirname "$(ls "$prefix"/lib*/pkgconfig/kiln.pc)")
PKG_CONFIG_PATH=$pcdir pkg-config --exists kiln || { echo "FAIL: pkg-config finds no kiln"; exit 1; }
cc $flags $(PKG_CONFIG_PATH=$pcdir pkg-config --cflags kiln) "$src/examples/consumer/main.c" \
  $(PKG_CONFIG_PATH=$pcdir pkg-config --libs kiln) -Wl,-rpath,"$(dirname "$lib")" -o "$scratch/consumer-pc"
"$scratch/consumer-pc" "$scratch/kernels.db" | grep -q cached || { echo "FAIL: pkg-config build"; exit 1; }
"$prefix/bin/kiln" --version
echo "install test: ok"
