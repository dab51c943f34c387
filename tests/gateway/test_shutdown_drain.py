"""A web process told to stop (SIGTERM: a rolling deploy) finishes the calls in flight before its server stops.

uvicorn alone closed its socket and, at its `--timeout-graceful-shutdown`, cancelled what still ran: a non-streamed
call still waiting for its answer (up to hours, `GATEWAY_MAX_ANSWER_WAIT_S`) got a plain-text 500 and nothing was
recorded for what its engine had computed. Now the gateway drains first (`endpoints.gateway.drain`), for up to
`INFERPLANE_GATEWAY_DRAIN_S`, answering new calls 503 and `/readyz` not ready meanwhile.
"""

import signal
import threading
from concurrent.futures import Future

import httpx
import pytest

from billing.models import UsageRecord
from controlplane.redis_client import get_redis
from controlplane.redis_keys import reservations_key
from tests.conftest import start_web_server, wait_until
from tests.gateway.conftest import serve_endpoint

pytestmark = pytest.mark.django_db(transaction=True)

MESSAGES = [{"role": "user", "content": "Hello"}]
# uvicorn's own bound, far below the calls' length: what cut them before the drain.
SERVER_ARGS = ("--timeout-graceful-shutdown", "1")


def _call_in_a_thread(gateway: str, key: str, model: str, max_tokens: int) -> Future:
    answer: Future = Future()

    def call():
        try:
            answer.set_result(
                httpx.post(
                    f"{gateway}/v1/chat/completions",
                    headers={"Authorization": f"Bearer {key}"},
                    json={"model": model, "messages": MESSAGES, "max_tokens": max_tokens},
                    timeout=60,
                )
            )
        except Exception as error:  # noqa: BLE001 - handed to the test through the future
            answer.set_exception(error)

    threading.Thread(target=call, daemon=True).start()
    return answer


def _not_ready(gateway: str) -> bool:
    try:
        return httpx.get(f"{gateway}/readyz", headers={"Host": "localhost"}, timeout=2).status_code == 503
    except httpx.HTTPError:
        return False


def _post_once_more_if_dropped(url: str, **kwargs) -> httpx.Response:
    """A POST to a pod that is draining. Its other gateway process, with nothing in flight, stops at once, and a
    connection it accepted just before closing is closed unanswered. In production the preStop pause keeps new
    connections away until then; here the test's client sends again, as HTTP clients do when a request was never
    read (failed once under load in a fresh clone's run)."""
    try:
        return httpx.post(url, **kwargs)
    except httpx.RemoteProtocolError:
        return httpx.post(url, **kwargs)


def test_a_non_streamed_call_in_flight_at_sigterm_completes_and_is_recorded_once(
    tenant, start_mock_upstream, tmp_path
):
    upstream = start_mock_upstream(token_delay_ms=20)
    endpoint = serve_endpoint(tenant.org, upstream)
    # The production launcher (controlplane.serve), two gateway processes: SIGTERM reaches its supervisor.
    child, gateway = start_web_server(
        tmp_path,
        name="gateway",
        workers=2,
        server_args=SERVER_ARGS,
        extra_env={"INFERPLANE_GATEWAY_DRAIN_S": "60"},
    )
    try:
        answer = _call_in_a_thread(gateway, tenant.key, endpoint.name, max_tokens=150)  # ~3 s of engine work
        wait_until(
            lambda: httpx.get(f"{upstream}/_stats").json()["num_requests"] == 1,
            10,
            message="the call in flight",
        )
        child.process.send_signal(signal.SIGTERM)  # to the supervisor alone, as the kubelet sends it

        wait_until(lambda: _not_ready(gateway), 10, message="/readyz to say not ready while the call drains")
        refused = _post_once_more_if_dropped(
            f"{gateway}/v1/chat/completions",
            headers={"Authorization": f"Bearer {tenant.key}"},
            json={"model": endpoint.name, "messages": MESSAGES, "max_tokens": 2},
            timeout=10,
        )
        response = answer.result(timeout=30)
        child.process.wait(30)
    finally:
        child.stop()

    assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_stopping"
    assert refused.headers["retry-after"] and refused.headers["connection"] == "close"
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 150
    row = UsageRecord.objects.get()  # the call, once; the refused one left none
    assert (row.status, row.prompt_tokens, row.completion_tokens) == ("ok", 7, 150) and row.cost > 0
    assert httpx.get(f"{upstream}/_stats").json()["num_requests"] == 1
    assert not get_redis().hlen(reservations_key(tenant.org.pk))  # settled, not left to the sweeper


def test_a_non_streamed_call_still_running_at_the_drains_bound_gets_a_503_and_its_reservation_back(
    tenant, start_mock_upstream, tmp_path
):
    upstream = start_mock_upstream(token_delay_ms=40)
    endpoint = serve_endpoint(tenant.org, upstream)
    child, gateway = start_web_server(
        tmp_path, name="gateway", server_args=SERVER_ARGS, extra_env={"INFERPLANE_GATEWAY_DRAIN_S": "1"}
    )
    try:
        answer = _call_in_a_thread(gateway, tenant.key, endpoint.name, max_tokens=250)  # ~10 s of engine work
        wait_until(
            lambda: httpx.get(f"{upstream}/_stats").json()["num_requests"] == 1,
            10,
            message="the call in flight",
        )
        child.kill(signal.SIGTERM)
        response = answer.result(timeout=30)
        child.process.wait(30)
    finally:
        child.stop()

    # Before: uvicorn's plain-text 500. The client has no answer, so nothing is billed.
    assert response.status_code == 503 and response.json()["error"]["code"] == "server_stopping"
    assert not UsageRecord.objects.exists()
    assert not get_redis().hlen(reservations_key(tenant.org.pk))


@pytest.mark.parametrize(("method", "path", "handler"), [
    ("POST", "/v1/files", "_upload"),
    ("GET", "/v1/files/file-abc/content", "_files_and_batches"),
    ("GET", "/v1/batches", "_files_and_batches"),
    ("POST", "/console/batches/new/", "_console_upload"),
])
def test_a_stopping_process_waits_for_uploads_and_downloads_too(monkeypatch, method, path, handler):
    # Only inference calls were counted: a 200 MB upload or a batch's output being read at SIGTERM had uvicorn's
    # graceful wait after the drain, 10 s, and was cut with a 500 (the review of the drain).
    import asyncio

    from endpoints.gateway import app as gateway_app
    from endpoints.gateway import drain

    seen = []

    async def handled(self, scope, receive, send):
        seen.append(drain._num_handling)

    monkeypatch.setattr(gateway_app.Gateway, handler, handled)
    gateway = gateway_app.Gateway(fallback=None, console_uploads={"/console/batches/new/": 15 * 2**20})
    asyncio.run(gateway({"type": "http", "method": method, "path": path, "headers": []}, None, None))
    assert seen == [1] and drain._num_handling == 0
