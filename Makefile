# `make serve` and `make test` each do all set-up on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000
ARGS ?=
DEFAULT_MODEL := models/SmolLM2-135M-Instruct.Q4_1.gguf

.PHONY: install model chromium serve lint test bench peer soak clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# A CPU build of torch first where there is no CUDA, so pip never pulls the multi-GB CUDA build.
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q torch==2.13.0 || $(PY) -m pip install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu; fi
	$(PY) -m pip install -q -e '.[dev]'
	# our grouped int4/int8 kernel, built now into ~/.cache/llmserve/kernels rather than on the first start
	$(PY) -m model.layers.group_kernels
	touch $@

install: $(VENV)/.installed

$(DEFAULT_MODEL): | $(VENV)/.installed
	$(PY) -m config.default_model

model: $(DEFAULT_MODEL)

serve: install model
	$(VENV)/bin/llmserve serve --host $(HOST) --port $(PORT) $(ARGS)

# Debian's Chromium for the browser tests; without it (not root, no apt-get) they skip and say why.
chromium:
	bash scripts/ensure-chromium.sh

# ruff (lint, then format --check) over all Python, mypy over the packages (settings in pyproject.toml), and a
# syntax check of the chat page's JavaScript modules. Any finding fails; `ruff format` and `ruff check --fix` fix most.
LINT_PATHS := server model config tests bench scripts
lint: install
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/mypy server model config
	bash scripts/check-js.sh

test: install lint model chromium
	$(PY) -m pytest -q -x -rs -p no:cacheprovider tests

# llmserve (flags in ARGS; none = the defaults) against llama-server side by side, alternating; `make peer` first
bench: install model
	$(PY) bench/versus.py --long-prompts --llmserve-args "$(ARGS)" --out bench/RESULTS.md

# llama.cpp's llama-server, the peer `make bench` measures against, built into .peers/ (~10 minutes on 2 cores)
PEER_SCRIPT ?= ../shared/peers/build-llama-server.sh
peer:
	@test -f $(PEER_SCRIPT) || { echo "no $(PEER_SCRIPT): set PEER_SCRIPT to the peers' build script"; exit 1; }
	bash $(PEER_SCRIPT) .peers

clean:
	rm -rf $(VENV) models

# 10,000 requests of the operator's mix against a spawned server; the RSS curve as a table and bench/SOAK.png.
soak: install model
	$(PY) bench/soak.py --requests 10000 --server-args "$(ARGS)" --out bench/SOAK.md
