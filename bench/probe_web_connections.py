"""PostgreSQL sessions a web process opens for sequential console pages, with and without its connection pool.

    INFERPLANE_DATA_DIR=/tmp/probe-web .venv/bin/python bench/probe_web_connections.py [--requests 300]

On the embedded local stack under INFERPLANE_DATA_DIR (migrated here): a signed-in owner's endpoint page, requested
`--requests` times one after another from one uvicorn process of `controlplane.asgi`, first with
`DATABASE_POOL_MAX_SIZE=0` (no pool: each request's thread connects, and closes as the request ends), then with the
pool's defaults. Prints the wall time and the sessions PostgreSQL started meanwhile (`pg_stat_database.sessions`, read
once the server has stopped, so that every session's count has reached the statistics).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
os.environ.setdefault("DJANGO_DEBUG", "1")

import django  # noqa: E402

django.setup()

from django.conf import settings  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.db import connection  # noqa: E402
from django.test import Client  # noqa: E402

from controlplane.accounts.models import Role  # noqa: E402
from tests.factories import EndpointFactory, MembershipFactory, OrganizationFactory, UserFactory  # noqa: E402


def sessions_started() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute("SELECT sessions FROM pg_stat_database WHERE datname = current_database()")
        return cursor.fetchone()[0]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run(pool_max_size: str | None, *, path: str, cookies: dict, num_requests: int) -> tuple[float, int]:
    port = free_port()
    env = os.environ | {"DATABASE_URL": settings.DATABASE_URL, "REDIS_URL": settings.REDIS_URL}
    if pool_max_size is not None:
        env["DATABASE_POOL_MAX_SIZE"] = pool_max_size
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "controlplane.asgi:application",
            "--port",
            str(port),
            "--no-access-log",
            "--log-level",
            "warning",
        ],
        cwd=REPO_ROOT,
        env=env,
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{base_url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        with httpx.Client(base_url=base_url, cookies=cookies) as browser:
            assert browser.get(path).status_code == 200  # warm: imports, the first connections
            connection.close()
            before = sessions_started()
            started = time.perf_counter()
            for _ in range(num_requests):
                assert browser.get(path).status_code == 200
            elapsed_s = time.perf_counter() - started
    finally:
        server.terminate()
        server.wait(30)
    time.sleep(1)  # a backend's count reaches the statistics as it exits
    connection.close()
    return elapsed_s, sessions_started() - before


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=300)
    args = parser.parse_args()
    call_command("migrate", verbosity=0)
    organization = OrganizationFactory()
    user = UserFactory()
    MembershipFactory(organization=organization, user=user, role=Role.OWNER)
    endpoint = EndpointFactory(organization=organization)
    client = Client()
    client.force_login(user)
    cookies = {name: morsel.value for name, morsel in client.cookies.items()}
    path = f"/console/endpoints/{endpoint.pk}/"
    for label, pool_max_size in (("no pool (DATABASE_POOL_MAX_SIZE=0)", "0"), ("pool (defaults)", None)):
        elapsed_s, num_sessions = run(pool_max_size, path=path, cookies=cookies, num_requests=args.requests)
        print(
            f"{label}: {args.requests} console pages in {elapsed_s:.2f} s "
            f"({1000 * elapsed_s / args.requests:.1f} ms each), {num_sessions} PostgreSQL sessions started"
        )


if __name__ == "__main__":
    main()
