#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (CPU, this machine's instruction set) for
# bench/vs_llamacpp.py, and `llama-quantize` beside it (bench/gguf_types.py makes the other
# GGUF types of a file with it), and print the server binary's path on the last line.
#
#   bash bench/build_llama_server.sh [DIR]
#
# DIR: $1, else $LLAMA_SERVER_DIR, else ~/.cache/freetoken/llama.cpp. It holds src/ (the
# llama.cpp sources) and build/ (the binary is build/bin/llama-server). The sources come from
# the llama-cpp-python sdist on PyPI (its vendor/llama.cpp; version $LLAMA_CPP_PYTHON_VERSION,
# default below) unless $LLAMA_CPP_SRC names a llama.cpp checkout to build instead.
# Idempotent: a second run reuses the sources and the build directory, and `cmake --build`
# recompiles only what changed (nothing, usually). $JOBS (default 2) parallel compile jobs.
# The build is native (-march=native), less AMX where the CPU lists it but the kernel traps
# its instructions (some VMs): ggml would crash there, and a small probe program decides.
# $LLAMA_CMAKE_ARGS: more CMake options, split on spaces, e.g. "-DGGML_CUDA=ON" for a CUDA
# build (then give llama-server its layers with: vs_llamacpp.py --llama-args "-ngl 999").
# The interpreter that runs pip: $PYTHON, else .venv/bin/python, else python3.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dir=${1:-${LLAMA_SERVER_DIR:-$HOME/.cache/freetoken/llama.cpp}}
version=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
jobs=${JOBS:-2}
if [[ -n ${PYTHON:-} ]]; then
    py=$PYTHON
elif [[ -x $root/.venv/bin/python ]]; then
    py=$root/.venv/bin/python
else
    py=python3
fi
command -v cmake >/dev/null || {
    echo "cmake not found: install it (apt-get install cmake, or pip install cmake)" >&2
    exit 1
}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)

label=()
if [[ -n ${LLAMA_CPP_SRC:-} ]]; then
    src=$LLAMA_CPP_SRC
else
    src=$dir/src
    label=(-DLLAMA_BUILD_COMMIT="llama-cpp-python-$version")
    if [[ ! -f $src/CMakeLists.txt ]]; then
        echo "fetching llama.cpp's sources: llama-cpp-python==$version sdist from PyPI"
        rm -rf "$dir/sdist" "$src"
        "$py" -m pip download --quiet --no-binary :all: --no-deps \
            "llama-cpp-python==$version" -d "$dir/sdist"
        tar -xzf "$dir"/sdist/llama_cpp_python-*.tar.gz -C "$dir/sdist"
        mv "$dir"/sdist/llama_cpp_python-*/vendor/llama.cpp "$src"
        rm -f "$src/.git"  # a submodule's pointer into a repository that is not there
        rm -rf "$dir/sdist"
    fi
fi

flags=
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
    cat >"$dir/amx-probe.c" <<'PROBE'
#include <immintrin.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {  /* ask for the tile state as ggml does, then use one tile */
    unsigned char cfg[64];
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */)) return 1;
    memset(cfg, 0, sizeof cfg);
    cfg[0] = 1;    /* palette 1 */
    cfg[16] = 64;  /* tile 0: 64 bytes a row */
    cfg[48] = 16;  /* tile 0: 16 rows */
    _tile_loadconfig(cfg);
    _tile_zero(0);
    _tile_release();
    return 0;
}
PROBE
    if "${CC:-cc}" -O1 -mamx-tile "$dir/amx-probe.c" -o "$dir/amx-probe" 2>/dev/null &&
        { "$dir/amx-probe"; } 2>/dev/null; then  # the braces keep bash's crash notice quiet
        echo "AMX: the CPU has it and it runs here; ggml may use it"
    else
        echo "AMX: the CPU lists it but it does not run here; building without it"
        flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    fi
fi

build=$dir/build
# No web UI (its assets would come from the network), no HTTPS, one static binary.
# Configuring again with the same options changes nothing, so nothing is rebuilt.
cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags" "${label[@]}" \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
    ${LLAMA_CMAKE_ARGS:-} >/dev/null
cmake --build "$build" --target llama-server llama-quantize -j "$jobs"
binary=$build/bin/llama-server
"$binary" --version 2>&1 | head -n 2 >&2 || true
echo "$binary"
