"""The gateway heals by itself after PostgreSQL cuts its sessions or Redis restarts or freezes:
clean OpenAI-shaped 503s meanwhile, never a hang, and answers again within seconds."""

import time

import pytest

from endpoints.gateway.memo import STALE_FOR_S
from tests.conftest import start_web_server, wait_until
from tests.gateway.conftest import serve_endpoint
from tests.gateway.load import Load
from tests.outages import redis_frozen, restart_redis, terminate_backends

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def serving(tenant, start_mock_upstream, tmp_path):
    """A live gateway (short key cache, 1 s Redis timeout) and an endpoint it serves."""
    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    # The load runs well past the default 600 requests a minute: these tests are about faults, not limits.
    env = {"INFERPLANE_API_KEY_CACHE_S": "0.2", "INFERPLANE_REDIS_TIMEOUT_S": "1", "INFERPLANE_DEFAULT_KEY_RPM": "1000000",
           "INFERPLANE_USAGE_JOURNAL_DIR": str(tmp_path / "journal")}
    child, gateway = start_web_server(tmp_path, name="gateway", extra_env=env)
    yield gateway, endpoint
    child.stop()


def assert_nothing_hung_or_broken(load: Load) -> None:
    outcomes = load.outcomes()
    broken = [a for a in load.snapshot() if a.outcome in ("hung", "broken")]
    assert outcomes["hung"] == 0 and outcomes["broken"] == 0, (outcomes, broken[:3])


def test_lookups_reconnect_by_themselves_after_postgresql_cuts_every_session(serving, tenant):
    gateway, endpoint = serving
    with Load(gateway, tenant.key, endpoint.name) as load:
        wait_until(lambda: load.outcomes()["ok"] >= 8, 30, message="traffic before the cut")
        assert terminate_backends() > 0
        # Past the window in which cached lookups may still be served stale, every lookup is fresh.
        after_stale = time.monotonic() + STALE_FOR_S + 1
        wait_until(lambda: load.num_ok_since(after_stale) >= 8, 30, message="answers from fresh lookups after the cut")
    assert_nothing_hung_or_broken(load)


def test_a_redis_restart_under_load_gives_clean_503s_then_answers_again(serving, tenant):
    gateway, endpoint = serving
    with Load(gateway, tenant.key, endpoint.name) as load:
        wait_until(lambda: load.outcomes()["ok"] >= 8, 30, message="traffic before the restart")
        restart_redis()
        restarted = time.monotonic()
        wait_until(lambda: load.num_ok_since(restarted) >= 8, 30, message="answers after the restart")
    assert_nothing_hung_or_broken(load)
    assert {a.status for a in load.snapshot() if a.outcome == "clean"} <= {503}


def test_a_frozen_redis_fails_requests_fast_with_a_clean_503(serving, tenant):
    gateway, endpoint = serving
    with Load(gateway, tenant.key, endpoint.name, timeout_s=10) as load:
        wait_until(lambda: load.outcomes()["ok"] >= 8, 30, message="traffic before the freeze")
        with redis_frozen():
            frozen = time.monotonic()
            wait_until(lambda: load.num_since(frozen, "clean", "service_unavailable") >= 4, 20,
                       message="clean 503s while Redis is frozen")
        thawed = time.monotonic()
        wait_until(lambda: load.num_ok_since(thawed) >= 8, 30, message="answers after Redis thawed")
    assert_nothing_hung_or_broken(load)
