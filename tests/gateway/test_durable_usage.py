"""Usage survives a PostgreSQL outage: every request a client saw succeed has exactly one ledger row."""

import contextlib
import time

import httpx
import pytest

from billing.models import UsageRecord
from tests.conftest import start_web_server, wait_until
from tests.gateway.conftest import serve_endpoint
from tests.gateway.load import Load
from tests.outages import database_read_only, database_refusing_connections

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(scope="module")
def module_journal_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("journal")


@pytest.fixture
def journal_env(module_journal_dir):
    """A journal folder, empty, and the gateways' settings naming it.

    NOTE: one folder for the module, so that the gateways of the tests that add nothing to these settings are forked
    from one sibling of the web zygote (`WebZygote.for_env`: settings are read at import): a folder per test was an
    environment per test, and each gateway was started the ordinary way (~3 s of imports each)."""
    for path in module_journal_dir.iterdir():
        path.unlink()
    return module_journal_dir, {"INFERPLANE_USAGE_JOURNAL_DIR": str(module_journal_dir),
                                "INFERPLANE_API_KEY_CACHE_S": "60"}


def usage_backlog(base_url: str) -> int:
    return httpx.get(f"{base_url}/readyz", timeout=10).json()["usage_backlog"]


def assert_one_row_per_success(answers):
    succeeded = {a.request_id: a for a in answers if a.outcome == "ok"}

    def missing():
        rows = set(UsageRecord.objects.filter(request_id__in=list(succeeded)).values_list("request_id", flat=True))
        return [request_id for request_id in succeeded if request_id not in rows]

    # NOTE: a row is written just after its answer is sent: the last answers' rows may trail by moments.
    with contextlib.suppress(AssertionError):
        wait_until(lambda: not missing(), 15, message="a row for every answered request")
    assert not missing(), f"{len(missing())} of {len(succeeded)} answered requests have no ledger row"
    rows = {row.request_id: row for row in UsageRecord.objects.all()}
    for request_id, answer in succeeded.items():
        row = rows[request_id]
        assert (row.prompt_tokens, row.completion_tokens) == (answer.prompt_tokens, answer.completion_tokens)
    # Unique request ids make a second row impossible; rows without an answered request are only
    # those whose client saw an error mid-stream.
    assert len(rows) == len(set(rows))


# A database refusing connections (down, restarting), and a failover's demoted primary that takes connections
# and refuses writes (ReadOnlySqlTransaction, not an OperationalError: before, those rows were neither written
# nor journaled, and a journal replayed then was set aside as if its rows were bad).
@pytest.mark.parametrize("outage", [database_refusing_connections, database_read_only], ids=["down", "read-only"])
def test_usage_written_while_postgresql_is_down_reaches_the_ledger_once_it_is_back(tenant, start_mock_upstream, tmp_path,
                                                                                   web_zygote, journal_env, outage):
    endpoint = serve_endpoint(tenant.org, start_mock_upstream(token_delay_ms=5))
    journal_dir, env = journal_env
    child, gateway = start_web_server(tmp_path, name="gateway", extra_env=env, zygote=web_zygote)
    try:
        with Load(gateway, tenant.key, endpoint.name) as load:
            wait_until(lambda: load.outcomes()["ok"] >= 8, 30, message="traffic before the outage")
            with outage():
                # Lookups are cached, so the gateway keeps answering; its usage can only go to the journal.
                wait_until(lambda: usage_backlog(gateway) >= 5, 30, message="usage journaled during the outage")
                time.sleep(1.5)  # replays tried against the database meanwhile
            wait_until(lambda: usage_backlog(gateway) == 0, 30, message="the journal replayed")
            back = load.snapshot()[-1].at
            wait_until(lambda: load.num_ok_since(back) >= 4, 30, message="traffic after the outage")
        outcomes = load.outcomes()
        assert outcomes["hung"] == 0 and outcomes["broken"] == 0, outcomes
        assert_one_row_per_success(load.snapshot())
        assert not list(journal_dir.glob("*.jsonl"))  # nothing set aside in rejected.jsonl either
    finally:
        child.stop()


def test_a_gateway_killed_with_a_journal_backlog_leaves_it_to_the_next_gateway(tenant, start_mock_upstream, tmp_path,
                                                                               web_zygote, journal_env):
    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    journal_dir, env = journal_env
    first, gateway = start_web_server(tmp_path, name="gateway", extra_env=env, zygote=web_zygote)
    try:
        with Load(gateway, tenant.key, endpoint.name, num_clients=2) as load:
            wait_until(lambda: load.outcomes()["ok"] >= 2, 30, message="traffic before the outage")
            with database_refusing_connections():
                wait_until(lambda: usage_backlog(gateway) >= 3, 30, message="usage journaled during the outage")
                load.stop()
                # Every answered request is in the ledger (from before) or in the journal, then the gateway dies.
                wait_until(lambda: usage_backlog(gateway) + UsageRecord.objects.count() >= load.outcomes()["ok"], 30,
                           message="answered requests journaled")
                first.kill()
        assert list(journal_dir.glob("*.jsonl"))
        second, second_url = start_web_server(tmp_path, name="gateway-2", extra_env=env, zygote=web_zygote)
        try:
            wait_until(lambda: usage_backlog(second_url) == 0, 30, message="the next gateway to replay the journal")
        finally:
            second.stop()
        assert_one_row_per_success(load.snapshot())
        assert load.outcomes()["hung"] == 0
    finally:
        first.stop()


def journal_bytes(journal_dir) -> int:
    return sum(path.stat().st_size for path in journal_dir.glob("*.jsonl") if path.name != "rejected.jsonl")


ROW_MAX_BYTES = 1024  # a usage row in the journal: some 700 bytes


def test_a_gateway_whose_usage_journal_is_full_refuses_new_calls_and_is_not_ready_until_postgresql_takes_writes(
        tenant, start_mock_upstream, tmp_path):
    """A demoted primary serves reads and refuses writes: the gateway answers from its caches and every usage row goes
    to the journal. Before, the journal grew without a bound (some 42 MB a minute at 1,000 calls a second) until the
    pod's volume was full: the pod was evicted, its journal deleted, and every call answered in the outage unbilled.
    Now, past INFERPLANE_USAGE_JOURNAL_MAX_BYTES, new calls get a 503 before they are proxied and /readyz is not ready
    (the load balancer drains the pod); calls already admitted still journal, and the gateway admits calls again by
    itself once the journal is replayed."""
    endpoint = serve_endpoint(tenant.org, start_mock_upstream(token_delay_ms=5))
    journal_dir, max_bytes = tmp_path / "journal", 32 * 1024
    env = {"INFERPLANE_USAGE_JOURNAL_DIR": str(journal_dir), "INFERPLANE_API_KEY_CACHE_S": "60",
           "INFERPLANE_USAGE_JOURNAL_MAX_BYTES": str(max_bytes)}
    child, gateway = start_web_server(tmp_path, name="gateway", extra_env=env)
    num_clients = 4
    try:
        with Load(gateway, tenant.key, endpoint.name, num_clients=num_clients) as load:
            wait_until(lambda: load.outcomes()["ok"] >= 8, 30, message="traffic before the outage")
            with database_read_only():
                outage_at = time.monotonic()
                wait_until(lambda: load.num_since(outage_at, "clean", "service_unavailable"), 60,
                           message="new calls refused once the journal is full")
                ready = httpx.get(f"{gateway}/readyz", timeout=10)
                assert ready.status_code == 503, ready.text
                assert ready.json()["checks"] == {"database": "ok", "redis": "ok", "usage_journal": "full",
                                                  "process": "ok"}, ready.text
                refused = httpx.post(f"{gateway}/v1/chat/completions", timeout=10,
                                     headers={"Authorization": f"Bearer {tenant.key}"},
                                     json={"model": endpoint.name, "messages": [{"role": "user", "content": "Hi"}]})
                assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
                error = refused.json()["error"]
                assert error["code"] == "service_unavailable" and "Usage cannot be recorded" in error["message"]

                time.sleep(2)  # the calls admitted before it was full end, and journal their rows
                settled, settled_at = journal_bytes(journal_dir), time.monotonic()
                # A client's next call may be admitted while its last call's row is still on its way to the disk.
                assert max_bytes <= settled <= max_bytes + 4 * num_clients * ROW_MAX_BYTES
                time.sleep(2)
                assert journal_bytes(journal_dir) == settled  # it grows no more
                assert load.num_since(settled_at, "ok") == 0
                assert load.num_since(settled_at, "clean", "service_unavailable") >= num_clients
            # NOTE: polled slowly: each /readyz leaves a PostgreSQL session open behind it (found here, not changed).
            wait_until(lambda: httpx.get(f"{gateway}/readyz", timeout=10).status_code == 200, 30, interval_s=0.5,
                       message="/readyz ready again once the journal is replayed")
            assert usage_backlog(gateway) == 0
            back = time.monotonic()
            wait_until(lambda: load.num_ok_since(back) >= 4, 30, message="calls admitted again after the outage")
        outcomes = load.outcomes()
        assert outcomes["hung"] == 0 and outcomes["broken"] == 0, outcomes
        assert_one_row_per_success(load.snapshot())
        assert not list(journal_dir.glob("*.jsonl"))
    finally:
        child.stop()
