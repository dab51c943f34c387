"""While PostgreSQL cannot serve (stopped, or refusing connections) the management API, the console and the agent API
answer 503 with `Retry-After`, each in its own error shape, with the web process's pool on or off; an error that is not
a failure of the connection itself (a bug, a statement cancelled) stays a 500 (`controlplane.database_unavailable`)."""

from __future__ import annotations

import django.db
import httpx
import psycopg
import psycopg.errors
import pytest
from django.test import RequestFactory
from psycopg_pool import PoolTimeout

from controlplane.database_unavailable import server_error
from tests.conftest import PRODUCTION_WEB_ENV, start_web_server
from tests.outages import database_refusing_connections, postgresql_stopped
from tests.web_callers import heartbeat_with_a_bogus_secret, signed_in_owner

UNAVAILABLE = "The database is unavailable: try again shortly."
BUSY = "The database is busy or unavailable: try again shortly."
POOLS = {
    "no-pool": ({"DATABASE_POOL_MAX_SIZE": "0"}, UNAVAILABLE),
    # NOTE: with the pool a request waits for a connection that is never connected, then the pool's timeout
    "pool": (
        {"DATABASE_POOL_MIN_SIZE": "1", "DATABASE_POOL_MAX_SIZE": "2", "DATABASE_POOL_TIMEOUT_S": "1"},
        BUSY,
    ),
}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "outage", [postgresql_stopped, database_refusing_connections], ids=["stopped", "refusing"]
)
@pytest.mark.parametrize("pool", list(POOLS))
def test_while_postgresql_is_down_the_api_console_and_agent_api_answer_503_with_retry_after(
    tmp_path, client, owner_client, pool, outage
):
    """Before, each answered a 500 (the project's error page, and `/api/` callers' clients saw no API error)."""
    pool_env, message = POOLS[pool]
    child, web = start_web_server(tmp_path, extra_env=PRODUCTION_WEB_ENV | pool_env)
    headers = {"authorization": f"Bearer {owner_client.plain_key}"}
    cookies, endpoint = signed_in_owner(client)
    try:
        assert httpx.get(f"{web}/api/v1/endpoints/", headers=headers).status_code == 200
        with outage():
            listed = httpx.get(f"{web}/api/v1/endpoints/", headers=headers, timeout=30)
            with httpx.Client(base_url=web, cookies=cookies, timeout=30) as browser:
                page = browser.get(f"/console/endpoints/{endpoint.pk}/")
            beaten = heartbeat_with_a_bogus_secret(web, timeout=30)
        listed_after = httpx.get(f"{web}/api/v1/endpoints/", headers=headers, timeout=30)
    finally:
        child.stop()

    assert (listed.status_code, listed.headers.get("retry-after")) == (503, "1"), listed.text
    assert listed.json() == {"detail": message}
    assert (page.status_code, page.headers.get("retry-after")) == (503, "1"), page.text
    assert page.headers["content-type"].startswith("text/plain") and page.text == message
    assert (beaten.status_code, beaten.headers.get("retry-after")) == (503, "1"), beaten.text
    assert beaten.json() == {"error": {"message": message}}
    assert listed_after.status_code == 200  # and the first request after is answered


def _handled(exc: BaseException, path: str = "/api/v1/endpoints/"):
    """What the project's `handler500` answers for a request to `path` that raised `exc` (Django calls it inside the
    `except` that caught it)."""
    request = RequestFactory().get(path)
    try:
        raise exc
    except BaseException:  # noqa: BLE001 - as Django's own handler catches
        return server_error(request)


def _from_django(cause: BaseException) -> django.db.OperationalError:
    """As Django raises a psycopg error: its own class, the driver's error as the cause."""
    wrapped = django.db.OperationalError(*cause.args)
    wrapped.__cause__ = cause
    return wrapped


@pytest.mark.parametrize(
    "cause",
    [
        psycopg.OperationalError(
            'connection failed: connection to server on socket "/x" failed: Connection refused'
        ),
        psycopg.OperationalError("the connection is closed"),
        psycopg.errors.AdminShutdown("terminating connection due to administrator command"),
        psycopg.errors.CannotConnectNow("the database system is starting up"),
        psycopg.errors.IdleInTransactionSessionTimeout(
            "terminating connection due to idle-in-transaction timeout"
        ),
    ],
    ids=["refused", "closed", "terminated", "starting", "idle-in-transaction"],
)
def test_a_failure_of_the_connection_itself_is_a_503(cause):
    """Before, a session PostgreSQL ended for idling in a transaction was a 500."""
    answer = _handled(_from_django(cause))
    assert (answer.status_code, answer["Retry-After"]) == (503, "1")


@pytest.mark.django_db(transaction=True)
def test_a_server_that_takes_no_write_a_demoted_primary_is_a_503_and_logged_with_its_class(caplog):
    """After a failover a gateway may still reach the old primary, now a standby (stale DNS): every write fails with
    SQLSTATE 25006. Before, each was a 500, as if the platform had a bug; and no 503 was logged at all."""
    from django.db import connection, transaction

    from endpoints.models import Endpoint

    try:
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("SET LOCAL transaction_read_only = on")
            Endpoint.objects.update(name="refused")
    except django.db.Error as exc:
        refused = exc
    assert isinstance(refused.__cause__, psycopg.errors.ReadOnlySqlTransaction)

    with caplog.at_level("WARNING", logger="controlplane.database_unavailable"):
        answer = _handled(refused, "/agent/v1/heartbeat")

    assert (answer.status_code, answer["Retry-After"]) == (503, "1")
    assert [record.getMessage() for record in caplog.records] == [
        "GET /agent/v1/heartbeat answered 503: ReadOnlySqlTransaction: "
        "cannot execute UPDATE in a read-only transaction"
    ]


def test_a_pool_that_hands_out_no_connection_in_time_is_a_503():
    answer = _handled(_from_django(PoolTimeout("couldn't get a connection after 5.00 sec")))
    assert (answer.status_code, answer["Retry-After"]) == (503, "1")


@pytest.mark.parametrize(
    "exc",
    [
        _from_django(psycopg.errors.QueryCanceled("canceling statement due to statement timeout")),
        _from_django(psycopg.errors.LockNotAvailable("could not obtain lock on row")),
        django.db.OperationalError("raised by our own code"),
        RuntimeError("a bug"),
    ],
    ids=["statement-cancelled", "lock-not-available", "our-own", "not-a-database-error"],
)
def test_any_other_error_stays_a_500_so_that_a_bug_is_not_hidden(exc):
    assert _handled(exc).status_code == 500
