"""A PostgreSQL outage a run rides through (shorter than `BATCH_OUTAGE_RETRY_S`) does not make it give up its slice for
want of a slot (`runner.NO_SLOT_GIVE_UP_S`) or of answer bytes (`BATCH_NO_ROOM_GIVE_UP_S`): a slot or room freed
meanwhile is used once PostgreSQL is back, however long the run had waited before and through the outage.

NOTE: a review suspected both timers ran on through an outage (no line may start then) and so ended a run early. They
do run on, but each give-up is decided only after the slots (or the room) are read again, and a free one starts a line
instead: the slot's test is a pin. The room's found another fault: the room back while PostgreSQL had gone away since
the run's last check, its first read of the endpoint's slots (never read before, for want of room) raised the outage's
error, and the run ended with it (its lines in flight cut, run again by the next)."""

from __future__ import annotations

import time

import httpx
import pytest

from billing.models import UsageRecord
from controlplane.redis_client import get_redis
from controlplane.redis_keys import outstanding_key
from endpoints.batches import answer_bytes, runner
from endpoints.batches.models import Batch, BatchStatus
from endpoints.models import Replica
from tests.batches.conftest import logprob_lines, new_batch, one_chat_line, run_in_a_thread
from tests.gateway.conftest import serve_endpoint
from tests.outages import database_refusing_connections
from tests.processes import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

GIVE_UP_S = 3.0
OUTAGE_S = 3.0  # with the wait before it, past `GIVE_UP_S`; within `BATCH_OUTAGE_RETRY_S` (8 s): ridden through


def test_a_slot_freed_during_an_outage_is_used_once_it_ends_though_the_run_waited_past_its_give_up(
    files_bucket, tenant, start_mock_upstream, monkeypatch
):
    monkeypatch.setattr(runner, "NO_SLOT_GIVE_UP_S", GIVE_UP_S)
    upstream = start_mock_upstream(token_delay_ms=100)
    endpoint = serve_endpoint(tenant.org, upstream, target_concurrency=1)
    [replica] = Replica.objects.filter(endpoint=endpoint)
    slot = outstanding_key(endpoint.organization_id, str(replica.pk))
    batch = new_batch(endpoint, b"".join(
        one_chat_line(endpoint, 4).replace(b'"only"', f'"c{index}"'.encode()) for index in range(2)))

    def num_engine_requests() -> int:
        return httpx.get(f"{upstream}/_stats").json()["num_requests"]

    worker, runs = run_in_a_thread(batch.pk)
    wait_until(lambda: num_engine_requests() == 1, 60, message="the first line's start")
    get_redis().incr(slot)  # an interactive call takes the slot as the first line ends
    wait_until(lambda: UsageRecord.objects.filter(batch_id=batch.pk).exists(), 60, message="the first line's end")
    time.sleep(1)  # no slot: the run waits
    with database_refusing_connections():
        get_redis().set(slot, 0)  # the interactive call ends
        time.sleep(OUTAGE_S)
    worker.join(timeout=60)

    assert runs == ["ran"], "the slot freed during the outage was used once it ended"
    batch = Batch.objects.get(pk=batch.pk)
    assert (batch.status, batch.num_completed) == (BatchStatus.COMPLETED, 2)
    assert num_engine_requests() == 2


def test_room_given_back_during_an_outage_is_used_once_it_ends_though_the_run_waited_past_its_give_up(
    files_bucket, tenant, start_mock_upstream, settings
):
    settings.BATCH_ANSWER_BYTES = 2**20
    settings.BATCH_NO_ROOM_GIVE_UP_S = GIVE_UP_S
    upstream = start_mock_upstream()
    endpoint = serve_endpoint(tenant.org, upstream)
    batch = new_batch(endpoint, logprob_lines(endpoint.name, 2))
    answer_bytes.run_started("batch_other")  # another run of the process (in a thread), holding a line's bytes
    try:
        held = answer_bytes.LineAnswer()
        assert not answer_bytes.room()
        worker, runs = run_in_a_thread(batch.pk)
        # the run's loop has begun (an outage before it fails the task)
        wait_until(lambda: answer_bytes._num_runs == 2, 60, message="the run's loop")
        time.sleep(1)  # no room: the run waits
        with database_refusing_connections():
            held.release()  # the other run's line is stored
            time.sleep(OUTAGE_S)
        worker.join(timeout=60)
    finally:
        answer_bytes.run_ended()
    assert runs == ["ran"], "the room given back during the outage was used once it ended"
    batch = Batch.objects.get(pk=batch.pk)
    assert (batch.status, batch.num_completed) == (BatchStatus.COMPLETED, 2)
    assert httpx.get(f"{upstream}/_stats").json()["num_requests"] == 2
