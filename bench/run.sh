#!/usr/bin/env bash
# The benchmarks (bench/bench_*.py), every one in turn or only those named:
#   bash bench/run.sh                 # all of them
#   bash bench/run.sh gateway trace   # bench/bench_gateway.py and bench/bench_trace.py
# Extra arguments for the scripts go in BENCH_ARGS (e.g. BENCH_ARGS="--duration-s 5" with one name).
# One that fails does not stop the others, but the script exits non-zero at the end if any failed.
# Results go to bench/results/. What the gateway benchmark needs besides the project's virtualenv
# (wrk, the LiteLLM proxy) is installed here, under the benchmark's data folder where it can be.
set -uo pipefail
cd "$(dirname "$0")/.."
export INFERPLANE_DATA_DIR="${INFERPLANE_DATA_DIR:-$PWD/.data/bench}"
export DJANGO_DEBUG="${DJANGO_DEBUG:-1}"
TOOLS="$INFERPLANE_DATA_DIR/tools"

scripts=()
if [ "$#" -eq 0 ]; then
  scripts=(bench/bench_*.py)
else
  for name in "$@"; do
    script="bench/bench_${name#bench_}"
    script="${script%.py}.py"
    [ -f "$script" ] || { echo "no benchmark $script" >&2; exit 2; }
    scripts+=("$script")
  done
fi

# wrk (Debian's package) drives the gateway benchmark's load. As root it is installed with apt; otherwise
# its package and the LuaJIT library it links are unpacked (dpkg -x) under $TOOLS and put on PATH, with
# package lists of our own when the system's are missing (apt-get update needs root).
install_wrk() {
  command -v wrk >/dev/null 2>&1 && return 0
  if [ -x "$TOOLS/root/usr/bin/wrk" ]; then
    export PATH="$TOOLS/root/usr/bin:$PATH" LD_LIBRARY_PATH="$TOOLS/root/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    return 0
  fi
  if [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && apt-get install -y -qq wrk >/dev/null) || echo "warning: could not install wrk" >&2
    return 0
  fi
  local debs="$TOOLS/debs" apt_dir="$TOOLS/apt"
  mkdir -p "$debs" "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial"
  # The luajit library wrk depends on is one of two alternatives; whichever the lists offer.
  local packages=(wrk libluajit2-5.1-2) private=(-o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir/cache" -o Debug::NoLocking=1)
  if ! (cd "$debs" && apt-get download -qq "${packages[@]}" >/dev/null 2>&1); then
    apt-get "${private[@]}" update -qq >/dev/null 2>&1
    (cd "$debs" && apt-get "${private[@]}" download -qq "${packages[@]}" >/dev/null 2>&1) \
      || { echo "warning: could not download wrk (apt-get download)" >&2; return 0; }
  fi
  for deb in "$debs"/*.deb; do dpkg -x "$deb" "$TOOLS/root"; done
  export PATH="$TOOLS/root/usr/bin:$PATH" LD_LIBRARY_PATH="$TOOLS/root/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  wrk --version 2>&1 | grep -q '^wrk' || echo "warning: wrk unpacked under $TOOLS does not run" >&2
}

# The LiteLLM proxy, measured next to the gateway (bench/bench_gateway.py), in its own virtualenv under
# the benchmark's data folder, never the project's. Pinned exactly: 1.108.7 is the newest release whose
# `proxy` extra resolves from the package index (later ones need a `litellm-proxy` package it lacks);
# 1.107.0 is a known-compromised release and must never be installed.
install_litellm() {
  LITELLM_VENV="$INFERPLANE_DATA_DIR/litellm-venv"
  if [ ! -f "$LITELLM_VENV/.installed" ]; then
    rm -rf "$LITELLM_VENV"
    (python3 -m venv "$LITELLM_VENV" && "$LITELLM_VENV/bin/pip" install --quiet 'litellm[proxy]==1.108.7' \
      && touch "$LITELLM_VENV/.installed") || echo "warning: could not install the LiteLLM proxy" >&2
  fi
  export LITELLM_VENV
}

if printf '%s\n' "${scripts[@]}" | grep -qx 'bench/bench_gateway.py'; then
  install_wrk
  install_litellm
fi

failed=()
for script in "${scripts[@]}"; do
  echo "==> $script"
  # shellcheck disable=SC2086 # BENCH_ARGS is a list of flags
  if ! .venv/bin/python "$script" ${BENCH_ARGS:-}; then
    echo "FAILED: $script" >&2
    failed+=("$script")
  fi
done
if [ "${#failed[@]}" -gt 0 ]; then
  echo "failed benchmarks: ${failed[*]}" >&2
  exit 1
fi
