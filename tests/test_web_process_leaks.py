"""What the web process (`controlplane.asgi` under uvicorn) keeps once a request is answered: nothing that grows with the
number of requests. Django runs each request's synchronous code (middleware, views) in a thread of its own that ends
with the request (asgiref's `ThreadSensitiveContext`), so anything such a thread opens and leaves open outlives it."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from django.db import connection

from controlplane import serve
from tests.conftest import start_web_server, wait_until
from tests.web_callers import registered_agent, signed_in_owner

pytestmark = pytest.mark.django_db(transaction=True)

NUM_REQUESTS = 30
# The sessions a web process keeps whatever its traffic: one per thread of its event loop's default executor (asyncio's
# own number of them) and its usage writer's. Fewer than NUM_REQUESTS, which each left one before.
LONG_LIVED_SESSIONS = min(32, (os.cpu_count() or 1) + 4) + 1

# glibc maps each malloc arena but the main one as a heap of this size, aligned to it (HEAP_MAX_SIZE on 64 bits).
MALLOC_HEAP_BYTES = 64 * 1024 * 1024
NUM_CONCURRENT_REQUESTS = 24


def malloc_arenas(pid: int) -> int:
    """glibc malloc arenas of process `pid`: its main one and each heap it mapped for the others (from its maps:
    anonymous, aligned, a written part and the reserved rest, 64 MiB together)."""
    mappings = []
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split()
            low, high = (int(address, 16) for address in fields[0].split("-"))
            mappings.append((low, high, fields[1], len(fields) > 5))
    num_heaps = 0
    for index, (low, high, permissions, named) in enumerate(mappings):
        if named or low % MALLOC_HEAP_BYTES or not permissions.startswith("rw"):
            continue
        following = mappings[index + 1] if index + 1 < len(mappings) else None
        if following and following[0] == high and following[2].startswith("---") and not following[3]:
            high = following[1]
        num_heaps += high - low == MALLOC_HEAP_BYTES
    return 1 + num_heaps


def others_sessions() -> int:
    """PostgreSQL sessions on the test database other than this test's own: the web process's."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid()"
        )
        return cursor.fetchone()[0]


@pytest.fixture
def web(tmp_path):
    child, base_url = start_web_server(tmp_path)
    yield base_url
    child.stop()


def test_the_web_process_holds_no_postgresql_session_once_its_requests_are_answered(web, client):
    """Before, each request's thread opened a session and `CONN_MAX_AGE` kept it open past the thread's end: it
    closed only when the garbage collector happened on it (a full collection, every few hundred requests), so a
    process held one idle session per request since then (49 after 420 console pages) and a few web processes
    took PostgreSQL's `max_connections`."""
    cookies, endpoint = signed_in_owner(client)
    secret, beat = registered_agent(web, join_token_name="soak")

    for _ in range(NUM_REQUESTS // 3):
        with httpx.Client(base_url=web, cookies=cookies) as browser:
            assert browser.get(f"/console/endpoints/{endpoint.pk}/").status_code == 200
            assert browser.get(f"/console/endpoints/{endpoint.pk}/live/").status_code == 200
        answer = httpx.post(
            f"{web}/agent/v1/heartbeat", json=beat, headers={"authorization": f"Bearer {secret}"}
        )
        assert answer.status_code == 200, answer.text

    # NOTE: a session closes just after its answer is sent: waited for, never counted on before. The gateway's own
    # long-lived threads (the loop's default executor: its beat, look-ups) keep theirs by design (`CONN_MAX_AGE`).
    wait_until(lambda: others_sessions() <= LONG_LIVED_SESSIONS, 10,
               message="the web process to close its requests' PostgreSQL sessions")


def test_the_web_process_serves_its_request_threads_from_a_bounded_number_of_malloc_arenas(tmp_path, monkeypatch):
    """Before, glibc gave each new request thread an arena of its own while fewer than 8 per core existed, each
    keeping the free space of its busiest moment: the process's RSS climbed over its first ~12,000 requests and settled
    higher the more cores it had. The launcher now limits them (`serve.limit_malloc_arenas`)."""
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    child, base_url = start_web_server(tmp_path, launcher=True)
    try:
        with ThreadPoolExecutor(NUM_CONCURRENT_REQUESTS) as clients:
            for _ in range(3):
                answers = list(clients.map(lambda _: httpx.get(f"{base_url}/healthz", timeout=30),
                                           range(NUM_CONCURRENT_REQUESTS)))
                assert {answer.status_code for answer in answers} == {200}
        assert malloc_arenas(child.process.pid) <= serve.MALLOC_ARENA_MAX
    finally:
        child.stop()
