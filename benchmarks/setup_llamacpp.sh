#!/usr/bin/env bash
# Optional benchmark setup (never part of the README's commands or CI): build llama.cpp's own C++
# programs (llama-bench, llama-server, llama-quantize) from the llama.cpp source vendored in the
# llama-cpp-python 0.3.36 sdist on PyPI, for this CPU. About 5 minutes on 2 cores.
#
#   benchmarks/setup_llamacpp.sh [DIR]        # default DIR: $SPECSOT_HOME/llamacpp (~/.cache/specsot/llamacpp)
#   LLAMACPP_CMAKE_ARGS="-DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF ..." benchmarks/setup_llamacpp.sh DIR   # AVX2 only
#
# Prints the folder holding bin/llama-bench, bin/llama-server, bin/llama-quantize and
# src/convert_hf_to_gguf.py; benchmarks take it as --llamacpp DIR (or find it at the default place).
set -euo pipefail
DIR="${1:-${SPECSOT_HOME:-$HOME/.cache/specsot}/llamacpp}"
VERSION=0.3.36
mkdir -p "$DIR"
cd "$DIR"
if [ ! -d src ]; then
    pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d sdist >/dev/null
    tar -xzf sdist/llama_cpp_python-$VERSION.tar.gz
    mv llama_cpp_python-$VERSION/vendor/llama.cpp src
    rm -rf llama_cpp_python-$VERSION sdist
fi
# For this CPU, as -DGGML_NATIVE=ON would build it, but without AMX: some virtual machines list
# amx_* in /proc/cpuinfo and then fault on its tile loads (seen on an Intel Xeon VM, 2026-11-26).
has() { grep -qw "$1" /proc/cpuinfo && echo ON || echo OFF; }
ISA="-DGGML_NATIVE=OFF -DGGML_AVX=$(has avx) -DGGML_AVX2=$(has avx2) -DGGML_FMA=$(has fma) -DGGML_F16C=$(has f16c)
  -DGGML_BMI2=$(has bmi2) -DGGML_AVX_VNNI=$(has avx_vnni) -DGGML_AVX512=$(has avx512f) -DGGML_AVX512_VBMI=$(has avx512vbmi)
  -DGGML_AVX512_VNNI=$(has avx512_vnni) -DGGML_AVX512_BF16=$(has avx512_bf16) -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF
  -DGGML_AMX_BF16=OFF"
cmake -S src -B build -DCMAKE_BUILD_TYPE=Release $ISA -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON ${LLAMACPP_CMAKE_ARGS:-} >/dev/null
cmake --build build -j "$(nproc)" --target llama-bench llama-server llama-quantize >/dev/null
mkdir -p bin
for t in llama-bench llama-server llama-quantize; do ln -sf "$(find "$DIR/build" -name $t -type f -perm -u+x | head -1)" bin/$t; done
# what its convert_hf_to_gguf.py imports beyond this project's own dependencies
pip install -q sentencepiece
echo "$DIR"
