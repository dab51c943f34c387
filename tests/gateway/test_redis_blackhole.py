"""A Redis that accepts connections and never answers (a partition, a dead load balancer that sends no RST): the
gateway fails its calls fast, as OpenAI-shaped 503s with `Retry-After`, one circuit for the whole process, never admits
a call without its limits, keeps answering what needs no Redis, and serves again within a second once Redis answers."""

import threading
import time

import httpx
import pytest
from django.conf import settings

from tests.conftest import start_web_server, wait_until
from tests.gateway.conftest import new_tenant, serve_endpoint
from tests.outages import BlackholingRedisProxy

pytestmark = pytest.mark.django_db(transaction=True)

REDIS_TIMEOUT_S = 2.0  # the default: a blackholed call must not cost every caller this


@pytest.fixture
def behind_a_blackhole(tenant, start_mock_upstream, tmp_path):
    """A live gateway whose Redis is reached through a proxy that can blackhole it, and an endpoint it serves."""
    proxy = BlackholingRedisProxy()
    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    env = {"REDIS_URL": proxy.url, "CELERY_BROKER_URL": settings.REDIS_URL,
           "INFERPLANE_REDIS_TIMEOUT_S": str(REDIS_TIMEOUT_S), "INFERPLANE_DEFAULT_KEY_RPM": "1000000",
           "INFERPLANE_USAGE_JOURNAL_DIR": str(tmp_path / "journal")}
    child, gateway = start_web_server(tmp_path, name="gateway", extra_env=env)
    yield proxy, gateway, endpoint
    child.stop()
    proxy.close()


def _call(client: httpx.Client, gateway: str, key: str, model: str) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    response = client.post(f"{gateway}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                           json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    return response, time.monotonic() - started


def test_a_blackholed_redis_fails_calls_fast_with_a_503_and_serves_again_within_a_second(behind_a_blackhole, tenant,
                                                                                         start_mock_upstream):
    proxy, gateway, endpoint = behind_a_blackhole
    newcomer = new_tenant()  # an organisation whose first call comes during the blackhole
    newcomers_endpoint = serve_endpoint(newcomer.org, start_mock_upstream())
    with httpx.Client(timeout=30) as client:
        wait_until(lambda: _call(client, gateway, tenant.key, endpoint.name)[0].status_code == 200, 30,
                   message="an answer before the blackhole")
        proxy.blackhole()
        # The first call may wait out one Redis timeout: it is what tells the gateway that Redis went silent.
        first, _ = _call(client, gateway, tenant.key, endpoint.name)
        assert first.status_code == 503, first.text
        answers = [_call(client, gateway, tenant.key, endpoint.name) for _ in range(5)]
        answers.append(_call(client, gateway, newcomer.key, newcomers_endpoint.name))
        for response, took_s in answers:
            assert response.status_code == 503, response.text  # never admitted without its limits
            assert response.json()["error"]["code"] == "service_unavailable"
            assert response.headers["retry-after"] == "1"
            assert took_s < 0.5, [round(took, 2) for _, took in answers]

        # A call waiting on Redis holds nobody else up: the process's loop answers what needs no Redis meanwhile.
        waiting = threading.Thread(target=_call, args=(client, gateway, tenant.key, endpoint.name))
        waiting.start()
        started = time.monotonic()
        assert client.get(f"{gateway}/healthz").status_code == 200
        assert time.monotonic() - started < 0.5
        waiting.join()

        proxy.heal()
        healed = time.monotonic()
        wait_until(lambda: _call(client, gateway, tenant.key, endpoint.name)[0].status_code == 200, 10,
                   interval_s=0.05, message="an answer once Redis answers again")
        assert time.monotonic() - healed < 1.5


def test_calls_refused_while_redis_is_silent_write_no_log_line_each(behind_a_blackhole, tenant, tmp_path):
    """Refused at once, a gateway's calls come as fast as its clients send them: a warning each (before) was a
    thousand lines a second at a busy gateway's rate, through the whole outage, beside each call's request line. The circuit says when it opened and,
    as it closes, how long and how many calls it refused."""
    proxy, gateway, endpoint = behind_a_blackhole
    log = tmp_path / "gateway.log"
    num_refused = 50
    with httpx.Client(timeout=30) as client:
        wait_until(lambda: _call(client, gateway, tenant.key, endpoint.name)[0].status_code == 200, 30,
                   message="an answer before the blackhole")
        proxy.blackhole()
        assert _call(client, gateway, tenant.key, endpoint.name)[0].status_code == 503  # opens the circuit
        num_lines_before = len(log.read_text().splitlines())
        for _ in range(num_refused):
            assert _call(client, gateway, tenant.key, endpoint.name)[0].status_code == 503
        proxy.heal()
        wait_until(lambda: _call(client, gateway, tenant.key, endpoint.name)[0].status_code == 200, 10,
                   interval_s=0.05, message="an answer once Redis answers again")
    logged = log.read_text().splitlines()[num_lines_before:]
    warned = [line for line in logged if " WARNING " in line]  # each call's own request line aside (its access log)
    assert len(warned) < 10, "\n".join(warned)
    assert any("calls refused" in line for line in logged), "\n".join(logged)
