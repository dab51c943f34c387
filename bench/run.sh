#!/usr/bin/env bash
# Every benchmark in turn (bench/bench_*.py); one that fails does not stop the others,
# but the script exits non-zero at the end if any failed. Results go to bench/results/.
set -uo pipefail
cd "$(dirname "$0")/.."
export INFERPLANE_DATA_DIR="${INFERPLANE_DATA_DIR:-$PWD/.data/bench}"
export DJANGO_DEBUG="${DJANGO_DEBUG:-1}"
# The gateway benchmark drives load with wrk (Debian's package): install it when missing.
if ! command -v wrk >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && apt-get install -y -qq wrk >/dev/null) || echo "warning: could not install wrk" >&2
fi
# The LiteLLM proxy, measured next to the gateway (bench/bench_gateway.py), in its own virtualenv under
# the benchmark's data folder, never the project's. Pinned exactly: 1.108.7 is the newest release whose
# `proxy` extra resolves from the package index (later ones need a `litellm-proxy` package it lacks);
# 1.107.0 is a known-compromised release and must never be installed.
LITELLM_VENV="$INFERPLANE_DATA_DIR/litellm-venv"
if [ ! -f "$LITELLM_VENV/.installed" ]; then
  (python3 -m venv "$LITELLM_VENV" && "$LITELLM_VENV/bin/pip" install --quiet 'litellm[proxy]==1.108.7' \
    && touch "$LITELLM_VENV/.installed") || echo "warning: could not install the LiteLLM proxy" >&2
fi
export LITELLM_VENV
failed=()
for script in bench/bench_*.py; do
  echo "==> $script"
  if ! .venv/bin/python "$script"; then
    echo "FAILED: $script" >&2
    failed+=("$script")
  fi
done
if [ "${#failed[@]}" -gt 0 ]; then
  echo "failed benchmarks: ${failed[*]}" >&2
  exit 1
fi
