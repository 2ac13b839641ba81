#!/usr/bin/env bash
# The CUDA checks on a bare GPU machine without network, from the repository's root:
#
#   tests/gpu/run_on_gpu_machine.sh setup            install carried wheels, make the random checkpoint
#   tests/gpu/run_on_gpu_machine.sh tests [ARGS]     the CUDA suite (tests/gpu; or the tests/gpu/... files ARGS name)
#   tests/gpu/run_on_gpu_machine.sh tp2 [ARGS]       TP=2 over gloo on the machine's CPU cores
#   tests/gpu/run_on_gpu_machine.sh bench [ARGS]     bench_worker on the GPU beside transformers
#   tests/gpu/run_on_gpu_machine.sh stack [ARGS]     bench.stack_bench (e.g. --real-worker cuda --steps-ms 0)
#
# What must travel with the repository (it is ignored by git): `.whl/` (wheels for the machine's
# Python, named in docs/gpu.md, "The CUDA suite", and a grpcurl binary), `.gpu_model/` (the
# default model's config and tokenizer files, without its weights) and `radixserve/v1/` (the
# generated protos). Each step appends its output to $OUT (default /tmp/gpu-out).
set -uo pipefail

OUT=${OUT:-/tmp/gpu-out}
SITE=/tmp/site
MODEL=models/smollm2-135m-instruct
mkdir -p "$OUT"
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1

setup() {
    if [ -d .whl ] && [ ! -f $SITE/.carried ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE .whl/*.whl || exit 1
        # the tests look for grpcurl beside the interpreter
        [ -f .whl/grpcurl ] && cp .whl/grpcurl "$(dirname "$(python3 -c 'import sys; print(sys.executable)')")/grpcurl"
        touch $SITE/.carried
    fi
    if [ ! -f $MODEL/model.safetensors ]; then
        mkdir -p $MODEL && cp .gpu_model/* $MODEL/ && python3 tests/gpu/random_checkpoint.py $MODEL || exit 1
    fi
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
}

tests() {
    local where=tests/gpu
    for arg in "$@"; do case "$arg" in tests/gpu/*) where= ;; esac; done
    python3 -m pytest $where -v -rs -p no:cacheprovider --timeout 400 "$@" 2>&1 | tee -a "$OUT/gpu_tests.log"
}

tp2() {
    # TP=2 cannot be NCCL on one GPU: the same code over gloo on this machine's CPU cores.
    python3 -m pytest tests/worker/test_tensor_parallel.py "tests/e2e/test_stack_tp2.py::test_greedy_chat_matches_transformers" \
        -q -rs -p no:cacheprovider "$@" 2>&1 | tee -a "$OUT/tp2_tests.log"
}

bench() {
    python3 -m bench.bench_worker --device cuda --dtypes bfloat16 --batch 32,128 --prefill-len 2048 \
        --transformers "$@" 2>&1 | tee -a "$OUT/bench_worker.log"
}

stack() {
    python3 -m bench.stack_bench "$@" 2>&1 | tee -a "$OUT/stack_bench.log"
}

step=${1:-}
shift || true
case "$step" in
    setup) setup ;;
    tests) setup && tests "$@" ;;
    tp2) setup && tp2 "$@" ;;
    bench) setup && bench "$@" ;;
    stack) setup && stack "$@" ;;
    *) echo "usage: $0 setup|tests|tp2|bench|stack [ARGS]" >&2; exit 2 ;;
esac
