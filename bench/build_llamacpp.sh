#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (the GGUF peer for bench.bench_gguf_peer) from the llama.cpp that the
# llama-cpp-python sdist vendors: the sdist comes from PyPI, the only network this project's machines have.
# Only the server target is built (no tests, examples, other tools, web UI, curl or OpenSSL), for this CPU.
# Usage: bench/build_llamacpp.sh DEST VERSION   -> DEST/bin/llama-server (DEST is an ignored folder).
set -euo pipefail
dest=${1:?destination folder}
version=${2:?llama-cpp-python version}
python=${PYTHON:-python3}
jobs=${LLAMACPP_JOBS:-2}
mkdir -p "$dest/src"
sdist="$dest/src/llama_cpp_python-$version.tar.gz"
if [ ! -f "$sdist" ]; then
    "$python" -m pip download --quiet --no-binary :all: --no-deps "llama-cpp-python==$version" -d "$dest/src"
fi
src="$dest/src/llama_cpp_python-$version"
[ -d "$src" ] || tar xzf "$sdist" -C "$dest/src"
cmake -S "$src/vendor/llama.cpp" -B "$dest/build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
cmake --build "$dest/build" --target llama-server -j "$jobs"
mkdir -p "$dest/bin"
cp "$dest/build/bin/llama-server" "$dest/bin/llama-server"
"$dest/bin/llama-server" --version
