"""The layers, the agent's independence and the absence of import cycles hold (import-linter's
contracts in pyproject.toml), and the contracts are checked against the code, not vacuously."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([LINT_IMPORTS, "--no-cache", *args], capture_output=True, text=True, cwd=cwd, timeout=300)


def test_import_contracts_are_kept():
    result = lint()
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def test_a_cycle_or_an_agent_import_of_django_breaks_the_contracts(tmp_path):
    """The same contracts on a copy of the code with two violations planted: both are reported."""
    copy = tmp_path / "repo"
    copy.mkdir()
    for name in ("controlplane", "endpoints", "billing", "gpu_agent"):
        subprocess.run(["cp", "-r", ROOT / name, copy / name], check=True)
    (copy / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    runtime = copy / "gpu_agent" / "runtime" / "hardware.py"
    runtime.write_text("import django.conf\n" + runtime.read_text())
    accounts = copy / "controlplane" / "accounts" / "tokens_probe.py"
    accounts.write_text("import endpoints.models\n")
    result = subprocess.run(
        [LINT_IMPORTS, "--no-cache"], capture_output=True, text=True, cwd=copy, timeout=300,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(copy)},
    )
    assert result.returncode != 0
    assert "gpu_agent.runtime.hardware -> django (l.1)" in result.stdout
    assert "controlplane.accounts.tokens_probe -> endpoints.models" in result.stdout


# Every call in the web process's code that runs a function off the event loop (`sync_to_async`, `asyncio.to_thread`,
# `run_in_executor`) outside `controlplane.worker_threads`, by module and the function it runs, with why it may: the
# ORM there must go through `in_worker_thread`, which closes the thread's connection after each call. Django's
# connections are per thread: one opened on a long-lived thread (the loop's default executor, asgiref's one
# process-wide thread) and never closed stays checked out of the web process's pool for that thread's life, and a few
# such threads took the whole pool (bogus node secrets on `/agent/v1/watch`: `tests/test_web_database_pool.py`).
REQUEST_THREAD = "Django middleware or view: the request's own thread, its connections closed as it ends"
BATCH_WORKER = "the batch worker's run (`asyncio.run`): that process does not pool"
OFF_LOOP_CALLS_ALLOWED = {
    ("controlplane/asgi.py", "connections.close_all"): REQUEST_THREAD,
    ("controlplane/health.py", "usage_journal.backlog"): "the usage journal's files, no ORM",
    ("controlplane/accounts/middleware.py", "self._gate"): REQUEST_THREAD,
    ("controlplane/accounts/middleware.py", "_subjects"): REQUEST_THREAD,
    ("controlplane/accounts/middleware.py", "self._check"): REQUEST_THREAD,
    ("controlplane/accounts/middleware.py", "attempt.refund"): REQUEST_THREAD,
    ("controlplane/accounts/middleware.py", "self._note"): REQUEST_THREAD,
    ("endpoints/gateway/wake.py", "_send_wake"): "a Celery message over Redis, no ORM",
    ("endpoints/gateway/presence.py", "_release_unserved"): "Redis only",
    ("endpoints/gateway/presence.py", "_release_ended"): "Redis only",
    ("endpoints/batches/storage.py", "next"): "an S3 download's next chunk, no ORM",
    ("endpoints/batches/storage.py", "body.close"): "an S3 download's body, no ORM",
    ("endpoints/batches/runner.py", "answer.spool.check_and_clean"): "a spool file, no ORM",
    ("endpoints/batches/runner.py", "next"): BATCH_WORKER,
    ("endpoints/batches/runner.py", "store"): BATCH_WORKER,
    ("billing/usage_writer.py", "journal().append"): "the usage journal's files, no ORM",
    ("billing/usage_writer.py", "journal().list_segments"): "the usage journal's files, no ORM",
    ("billing/usage_writer.py", "journal_shipping.ship"): "the usage journal's files to S3, no ORM",
    ("billing/usage_writer.py", "thread.join"): "waits for the set-aside's shipping thread (S3, no ORM)",
    ("billing/usage_writer.py", "usage_journal.seal"): "the usage journal's files, no ORM",
    ("billing/usage_writer.py", "usage_journal.list_segments"): "the usage journal's files, no ORM",
    ("billing/usage_writer.py", "usage_journal.done"): "the usage journal's files, no ORM",
    ("billing/usage_writer.py", "read_segment"): "the usage journal's files, no ORM",
}


def off_loop_calls(root: Path) -> set[tuple[str, str]]:
    """(module, the function it runs) for each `sync_to_async(f)`, `asyncio.to_thread(f)` and
    `loop.run_in_executor(executor, f)` in the web process's packages under `root`, tests and
    `controlplane/worker_threads.py` aside."""
    import ast

    found = set()
    for package in ("controlplane", "endpoints", "billing"):
        for path in sorted((root / package).rglob("*.py")):
            module = path.relative_to(root).as_posix()
            if "/tests/" in module or "/migrations/" in module or module == "controlplane/worker_threads.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(), module)):
                if not isinstance(node, ast.Call):
                    continue
                function = node.func
                name = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", "")
                position = {"sync_to_async": 0, "to_thread": 0, "run_in_executor": 1}.get(name)
                if position is not None and len(node.args) > position:
                    found.add((module, ast.unparse(node.args[position])))
    return found


def test_the_web_process_runs_orm_code_off_the_loop_only_in_threads_that_close_their_connections():
    assert off_loop_calls(ROOT) - OFF_LOOP_CALLS_ALLOWED.keys() == set()
    # and an entry nothing uses any more goes
    assert OFF_LOOP_CALLS_ALLOWED.keys() - off_loop_calls(ROOT) == set()


def test_a_new_orm_lookup_on_the_default_executor_is_found(tmp_path):
    """The guard on a copy with the lookup the review found planted back: it is reported."""
    for package in ("controlplane", "endpoints", "billing"):
        subprocess.run(["cp", "-r", ROOT / package, tmp_path / package], check=True)
    services = tmp_path / "endpoints" / "fleet" / "services.py"
    services.write_text(
        services.read_text().replace(
            "await in_worker_thread(authenticate_node)(secret)",
            "await sync_to_async(authenticate_node, thread_sensitive=False)(secret)",
        )
    )
    planted = {("endpoints/fleet/services.py", "authenticate_node")}
    assert off_loop_calls(tmp_path) - OFF_LOOP_CALLS_ALLOWED.keys() == planted
