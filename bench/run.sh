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
