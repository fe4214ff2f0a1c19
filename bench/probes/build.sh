#!/bin/sh
# Builds the probes (CUDA C++, nvcc from the toolkit; not part of the CMake
# build or of CI) into $1 (default: build/probes). Run them on the GPU machine.
set -e
out=${1:-build/probes}
mkdir -p "$out"
here=$(dirname "$0")
NVCC=${NVCC:-/usr/local/cuda/bin/nvcc}
"$NVCC" -O2 -arch=sm_90 -std=c++17 -o "$out/probe_pdl_cublaslt" "$here/probe_pdl_cublaslt.cu" -lcublasLt -L/usr/local/cuda/lib64/stubs -lcuda
"$NVCC" -O2 -arch=sm_90 -std=c++17 -o "$out/probe_l2_prefetch" "$here/probe_l2_prefetch.cu" -lcublasLt
"$NVCC" -O2 -arch=sm_90 -std=c++17 -o "$out/probe_read_bw" "$here/probe_read_bw.cu"
"$NVCC" -O2 -arch=sm_90 -std=c++17 -o "$out/probe_rowsplit" "$here/probe_rowsplit.cu" -lcublasLt
"$NVCC" -O2 -arch=sm_90 -std=c++17 -o "$out/probe_parts" "$here/probe_parts.cu" -lcublasLt
"$NVCC" -O2 -arch=sm_90 -std=c++17 -o "$out/probe_kv_stream" "$here/probe_kv_stream.cu"
"$NVCC" -O2 -arch=sm_90a -std=c++17 -o "$out/probe_tma_gemm" "$here/probe_tma_gemm.cu" -lcublasLt -L/usr/local/cuda/lib64/stubs -lcuda
cc -shared -fPIC -O2 -o "$out/libktrace.so" "$here/ktrace.c" -I/usr/local/cuda/include -L/usr/local/cuda/lib64 -lcupti
echo "probes in $out"
