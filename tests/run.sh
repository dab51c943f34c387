#!/usr/bin/env bash
# The whole suite, on real embedded PostgreSQL and Redis under .data/test (stopped afterwards), on two
# pytest-xdist workers.
set -uo pipefail
cd "$(dirname "$0")/.."
export INFERPLANE_DATA_DIR="${INFERPLANE_DATA_DIR:-$PWD/.data/test}"
export DJANGO_DEBUG=1
# NOTE: the suite's processes write their bytecode (`__pycache__`, ignored by git) even where the environment says not
# to (PYTHONDONTWRITEBYTECODE, set in many container images): without it each pytest worker compiled and
# assertion-rewrote every test module again at each run (a collection of ~25 s of CPU instead of ~8), and every child
# process (web servers not forked from a zygote, Celery workers, agents, `manage.py`) compiled the project's modules again.
unset PYTHONDONTWRITEBYTECODE
# Browser tests drive Debian's chromium (never a downloaded browser); the agent host's unit files are
# checked with systemd-analyze; tests/test_pgbouncer.py puts Debian's pgbouncer in front of PostgreSQL.
# Install what is missing.
missing=()
[ -x /usr/bin/chromium ] || missing+=(chromium)
[ -x /usr/sbin/pgbouncer ] || missing+=(pgbouncer)
command -v systemd-analyze >/dev/null 2>&1 || missing+=(systemd)
if [ "${#missing[@]}" -gt 0 ] && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && apt-get install -y -qq "${missing[@]}" >/dev/null) || echo "warning: could not install ${missing[*]}" >&2
fi
# Under CI a missing browser fails the run (tests/ci_skips.py also fails any skipped test there).
case "${CI:-}" in
  1|true|TRUE|True|yes|on)
    if [ ! -x /usr/bin/chromium ]; then echo "CI: chromium is missing; the browser tests cannot run" >&2; exit 1; fi ;;
esac
# The slowest tests are listed at the end: the suite must stay under 30 minutes on 2 cores.
# Two pytest-xdist workers, one per core: most tests wait on child processes (servers, workers, engines)
# and leave a core idle. Each worker has its own embedded PostgreSQL and Redis under
# $INFERPLANE_DATA_DIR/gw0 and gw1 (tests/settings.py). The CPU-heavy tests (real vLLM engines, marker
# `vllm`; worker-kill chaos, marker `heavy`) run a module at a time on one worker while the other runs
# every other test module, a module at a time; then it takes engine modules from the tail of their queue
# (tests/split.py). The summary's "worker timeline" says when each worker's last test ended.
# A later argument wins: `bash tests/run.sh -n 0` runs in this one process.
.venv/bin/python -m pytest -n 2 --dist loadgroup --create-db -p no:cacheprovider --durations=40 "$@"
status=$?
for folder in "$INFERPLANE_DATA_DIR"/gw* "$INFERPLANE_DATA_DIR"; do
  [ -d "$folder" ] && INFERPLANE_DATA_DIR="$folder" .venv/bin/python -m controlplane.embedded down >/dev/null 2>&1
done
# pytest exits 5 when it collected no tests: that is a failure here, never a pass.
if [ "$status" -eq 5 ]; then echo "no tests were collected" >&2; exit 1; fi
exit "$status"
