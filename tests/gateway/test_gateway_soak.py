"""A long, hostile day leaves a gateway process as it found it: after many calls of every ending a client or an
operator makes (answered, streamed, the client gone mid-stream or before the answer, the engine refusing, resetting
or hanging past its timeout, a 429, a 401, a 400, a 402, `n: 16`, a cold start's caller gone, a body cut short), the
process holds no more sockets, Redis keys without an expiry, Redis clients or PostgreSQL backends than after a first
round; and a body that stops coming mid-way is cut with a 408, its connection closed, never held."""

from __future__ import annotations

import json
import os
import socket
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal

import httpx
import pytest
from django.db import connection

from controlplane.accounts.models import ApiKey
from controlplane.redis_client import get_redis
from endpoints.nodes.notify import endpoint_ready_channel
from tests.conftest import free_port, start_web_server, wait_until
from tests.factories import EndpointFactory
from tests.gateway.conftest import new_tenant, serve_endpoint

pytestmark = pytest.mark.django_db(transaction=True)

MESSAGES = [{"role": "user", "content": "Hi"}]
# Calls of each ending, in a first round and again: a resource held per call of any one ending is 20 more of it after
# the second. NOTE: fewer more is not one per call: a pool keeps the connections it opened at the busiest moment so far
# (the gateway's Redis pool grew by 6 to 12 in a second round, however busy the first).
NUM_ROUNDS = 20
# What the soak's gateway waits for: a body's pause, and an engine's answer.
IDLE_S, UPSTREAM_READ_TIMEOUT_S = 1, 0.5


@pytest.fixture
def soak_gateway(transactional_db, tmp_path, web_zygote):
    child, base_url = start_web_server(tmp_path, name="gateway", extra_env={
        "INFERPLANE_FILES_UPLOAD_IDLE_S": str(IDLE_S),
        "INFERPLANE_GATEWAY_UPSTREAM_READ_TIMEOUT_S": str(UPSTREAM_READ_TIMEOUT_S)}, zygote=web_zygote)
    yield child, base_url
    child.stop()


def _raw_post(base_url: str, key: str, body: bytes, *, num_bytes_sent: int | None = None,
              path: str = "/v1/chat/completions") -> socket.socket:
    """A call (a chat call, unless `path`) on a socket of its own, of which only `num_bytes_sent` bytes of the body are
    sent."""
    host, port = base_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=15)
    head = (f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nauthorization: Bearer {key}\r\n\r\n")
    sock.sendall(head.encode() + body[:num_bytes_sent])
    return sock


def _read_to_the_end(sock: socket.socket) -> bytes:
    answer = b""
    with sock:
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def _held_by(pid: int) -> dict[str, int]:
    """What a gateway process holds that a leak grows: its sockets, Redis's keys without an expiry and clients, and
    the PostgreSQL backends of the test database."""
    sockets = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            sockets += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except OSError:  # closed meanwhile
            pass
    redis = get_redis()
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()")
        (num_backends,) = cursor.fetchone()
    return {"sockets": sockets, "redis keys without an expiry": sum(redis.ttl(key) == -1 for key in redis.scan_iter(count=1000)),
            "redis clients": len(redis.client_list()), "postgresql backends": num_backends - 1}  # less this test's


def test_a_body_that_stops_coming_mid_way_is_cut_with_a_408_and_its_connection_closed(soak_gateway, tenant,
                                                                                      start_mock_upstream):
    child, base_url = soak_gateway
    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    body = json.dumps({"model": endpoint.name, "messages": MESSAGES, "max_tokens": 5}).encode()

    stalled = [_raw_post(base_url, tenant.key, body, num_bytes_sent=10) for _ in range(20)]
    answers = [_read_to_the_end(sock) for sock in stalled]  # before: no answer, each connection held for ever

    assert all(answer.startswith(b"HTTP/1.1 408 ") for answer in answers), answers[0][:200]
    assert all(b'"code": "upload_too_slow"' in answer for answer in answers), answers[0][-300:]


def _num_logged_as_errors_once_seen(child, num_gone: int) -> int:
    """How many of `num_gone` clients that left mid-body the gateway logged as an error (with a traceback), once it has
    logged each, as gone (499) or as an error."""

    def num_logged(text: str) -> int:
        return child.log_text().count(text)

    wait_until(lambda: num_logged('" 499 ') + num_logged("Exception in ASGI application") == num_gone, 15,
               message=f"the gateway to see the {num_gone} clients go")
    return num_logged("Exception in ASGI application")


def test_clients_that_leave_mid_body_are_logged_as_gone_not_as_errors(soak_gateway, tenant):
    child, base_url = soak_gateway
    for key in (tenant.key, "ip_000000000000_wrong"):  # a body kept, and a refused caller's body read to be dropped
        for _ in range(10):
            _raw_post(base_url, key, b'{"model": "m", "messages": []}', num_bytes_sent=5).close()

    # before: each was a CancelledError, logged by uvicorn as an error with its traceback
    assert _num_logged_as_errors_once_seen(child, 20) == 0


def test_clients_that_leave_mid_body_on_the_files_and_batch_apis_are_logged_as_gone_not_as_errors(soak_gateway):
    # Before, a refused caller's body (read to be dropped) raised `ClientGone` past the one path that caught it: anyone,
    # without a key, wrote ~20 lines of ERROR a connection (6 of 6 here).
    child, base_url = soak_gateway
    for path in ("/v1/files", "/v1/batches", "/v1/files", "/v1/batches"):
        _raw_post(base_url, "ip_000000000000_wrong", b'{"purpose": "batch"}' * 50, num_bytes_sent=5, path=path).close()

    assert _num_logged_as_errors_once_seen(child, 4) == 0


def test_a_refused_caller_that_drips_its_body_is_answered_and_cut_off(soak_gateway):
    # Before, a refused caller's body was read to its end with only a pause limit: a byte every half second (within
    # the 1 s pause) held the connection and its task for as long as the caller liked (no answer after 8 s).
    # And before the connection's close, the answer went but the connection stayed for as long as the caller dripped
    # (uvicorn read on, and each byte put off its keep-alive timeout): 8 s here, when the test stopped dripping.
    child, base_url = soak_gateway
    sock = _raw_post(base_url, "ip_000000000000_wrong", b"x" * 1000, num_bytes_sent=1)
    answer, closed = b"", False
    with sock:
        sock.settimeout(0.5)
        for _ in range(16):
            try:
                if not (chunk := sock.recv(65536)):
                    closed = True
                    break
                answer += chunk
            except TimeoutError:
                try:
                    sock.sendall(b"x")
                except OSError:  # cut off
                    closed = True
                    break
            except OSError:  # reset
                closed = True
                break
    assert answer.startswith(b"HTTP/1.1 401 "), answer[:200]
    assert b"\r\nconnection: close\r\n" in answer.lower()
    assert closed, "the connection stayed open while its caller dripped"


@pytest.mark.parametrize("method, path", [("PUT", "/v1/chat/completions"), ("POST", "/v1/models"),
                                          ("POST", "/v1/nowhere"), ("POST", "/v1/responses/resp_x")])
def test_a_caller_refused_by_its_path_or_method_that_drips_its_body_is_answered_and_cut_off(soak_gateway, method, path):
    # Before, a 405 (a method the path does not serve), a 404 (an unknown path) or a stored response's 400 was sent
    # without the body read: uvicorn read on while the caller dripped, each byte putting off its keep-alive timeout,
    # and the connection stayed for as long as the caller liked (8 s here, when the test stopped), with no key needed.
    child, base_url = soak_gateway
    host, port = base_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=15)
    sock.sendall(f"{method} {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
                 f"content-length: 1000\r\n\r\nx".encode())
    answer, closed = b"", False
    with sock:
        sock.settimeout(0.5)
        for _ in range(16):
            try:
                if not (chunk := sock.recv(65536)):
                    closed = True
                    break
                answer += chunk
            except TimeoutError:
                try:
                    sock.sendall(b"x")
                except OSError:  # cut off
                    closed = True
                    break
            except OSError:  # reset
                closed = True
                break
    assert closed, "the connection stayed open while its caller dripped"
    assert answer.split(b" ", 2)[1] in (b"400", b"404", b"405"), answer[:200]
    assert b"\r\nconnection: close\r\n" in answer.lower()


def _num_subscribes(redis) -> int:
    return redis.info("commandstats").get("cmdstat_subscribe", {}).get("calls", 0)


def test_a_call_held_for_a_cold_start_subscribes_to_its_endpoints_ready_channel_and_to_no_task_result(gateway, tenant):
    redis = get_redis()
    at_zero = [EndpointFactory(organization=tenant.org, max_model_len=2048) for _ in range(10)]
    num_subscribes, num_queued = _num_subscribes(redis), redis.llen("celery")  # no worker here takes the tasks

    for endpoint in at_zero:  # each call wakes its endpoint (`wake.wake_endpoint`), is held, then its caller leaves
        body = json.dumps({"model": endpoint.name, "messages": MESSAGES, "max_tokens": 5, "stream": True}).encode()
        with _raw_post(gateway, tenant.key, body):
            channel = endpoint_ready_channel(endpoint.pk)
            wait_until(lambda: redis.pubsub_numsub(channel)[0][1] == 1, 15, message="the call to be held")  # noqa: B023
    # a wake is queued once its sender has subscribed to its result, if it does
    wait_until(lambda: redis.llen("celery") >= num_queued + len(at_zero), 15, message="the wakes to be queued")

    # before: one more each, to the wake's result (`celery-task-meta-...`), on a pub/sub connection per worker thread
    # that nothing read
    assert _num_subscribes(redis) - num_subscribes == len(at_zero)


def test_many_calls_of_every_ending_leave_the_gateway_holding_what_it_held_after_the_first(
        soak_gateway, tenant, start_mock_upstream):
    child, base_url = soak_gateway
    fast_engine = start_mock_upstream()
    fast = serve_endpoint(tenant.org, fast_engine)
    slow_tokens = serve_endpoint(tenant.org, start_mock_upstream(token_delay_ms=20))
    slow_first_token = serve_endpoint(tenant.org, start_mock_upstream(prefill_ms=1500))  # past the read timeout
    resetting = serve_endpoint(tenant.org, start_mock_upstream(fail_after_chunks=2))
    refusing = serve_endpoint(tenant.org, f"http://127.0.0.1:{free_port()}")  # nothing listens there
    at_zero = EndpointFactory(organization=tenant.org, max_model_len=2048)  # a cold start's caller leaves
    # NOTE: the platform's default limits (600 requests a minute) would turn most of this key's calls into 429s.
    ApiKey.objects.filter(pk=tenant.api_key.pk).update(requests_per_minute=100_000, tokens_per_minute=100_000_000)
    limited = new_tenant()
    ApiKey.objects.filter(pk=limited.api_key.pk).update(requests_per_minute=1)
    limited_endpoint = serve_endpoint(limited.org, fast_engine)
    capped, price = new_tenant(), Decimal(100_000)
    capped_endpoint = serve_endpoint(capped.org, fast_engine, price_input_per_million=price,
                                     price_cached_input_per_million=price, price_output_per_million=price)
    assert httpx.patch(f"{base_url}/api/v1/billing/", json={"spend_cap": "0.01"},
                       headers={"authorization": f"Bearer {capped.key}"}).status_code == 200
    client = httpx.Client(base_url=base_url, timeout=30, limits=httpx.Limits(max_keepalive_connections=0))

    def chat(model: str, key: str = tenant.key, **fields) -> int:
        body = {"model": model, "messages": MESSAGES, "max_tokens": 5} | fields
        with client.stream("POST", "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}) as answer:
            answer.read()
            return answer.status_code

    def gone(model: str, *, after: bytes | None = None, **fields) -> str:
        """The caller leaves: once `after` has come, or at once."""
        body = json.dumps({"model": model, "messages": MESSAGES, "max_tokens": 50} | fields).encode()
        with _raw_post(base_url, tenant.key, body) as sock:
            received = b""
            while after is not None and after not in received and (chunk := sock.recv(65536)):
                received += chunk
        return "gone"

    endings = {
        "answered": (lambda: chat(fast.name), {200}),
        "streamed": (lambda: chat(fast.name, stream=True), {200}),
        "n: 16": (lambda: chat(fast.name, n=16, stream=True), {200}),
        "gone mid-stream": (lambda: gone(slow_tokens.name, after=b"data:", stream=True), {"gone"}),
        "gone before the answer": (lambda: gone(slow_first_token.name), {"gone"}),
        "engine refuses": (lambda: chat(refusing.name), {502}),
        "engine resets": (lambda: chat(resetting.name, max_tokens=10, stream=True), {200}),
        "engine hangs": (lambda: chat(slow_first_token.name), {504}),
        "rate limited": (lambda: chat(limited_endpoint.name, key=limited.key), {200, 429}),
        "bad key": (lambda: chat(fast.name, key="ip_000000000000_wrong"), {401}),
        "bad json": (lambda: client.post("/v1/chat/completions", content=b"{nope",
                                         headers={"authorization": f"Bearer {tenant.key}"}).status_code, {400}),
        "spend cap": (lambda: chat(capped_endpoint.name, key=capped.key), {402}),
        "cold start left": (lambda: gone(at_zero.name), {"gone"}),
        "body cut short": (lambda: _raw_post(base_url, tenant.key, b'{"model": "x"}', num_bytes_sent=4).close(), {None}),
    }

    def one_round_of_each(num_calls: int, *, num_at_once: int):
        with ThreadPoolExecutor(num_at_once) as pool:
            for name, (call, expected) in endings.items():
                outcomes = set(pool.map(lambda _, call=call: call(), range(num_calls)))
                assert outcomes <= expected, (name, outcomes)

    # NOTE: twice as many at once as after: the connection pools (Redis, the engines), which keep what they opened,
    # grow to what the second round needs
    one_round_of_each(NUM_ROUNDS, num_at_once=16)
    after_the_first = _held_by(child.pid)
    one_round_of_each(NUM_ROUNDS, num_at_once=8)
    client.close()

    held = [after_the_first]  # the last count, for the message: calls whose client left end as the gateway sees it

    def let_go():
        held[0] = _held_by(child.pid)
        return all(held[0][what] < after_the_first[what] + NUM_ROUNDS for what in held[0])

    try:
        wait_until(let_go, 15, interval_s=0.5)
    except AssertionError:
        pytest.fail(f"after {NUM_ROUNDS} more calls of each ending the gateway holds {held[0]}, "
                    f"after the first round {after_the_first}")
