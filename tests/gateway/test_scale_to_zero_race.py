"""A call that meets its endpoint's scale to zero: the gateway's list of READY replicas (served up to
`REPLICA_CACHE_S` + `memo.STALE_FOR_S` old while it reloads) still names the replica the autoscaler has just drained
and its agent stopped. The call, refused before it reached an engine, finds no READY replica left: it is a cold
call, held for the next replica like any other, never a 502 "please retry"."""

import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from django.db import connections
from django.utils import timezone

from billing.models import UsageRecord
from controlplane.accounts.services import Actor
from controlplane.redis_client import get_redis
from controlplane.redis_keys import held_key, inflight_key, reservations_key, waiting_key
from endpoints.models import Endpoint, Replica, ReplicaState
from endpoints.nodes.models import Node
from endpoints.services import delete_endpoint, pause_endpoint
from tests.conftest import wait_until
from tests.fakes.closing_engine import ClosingEngine
from tests.gateway.conftest import held_chat, serve_endpoint

pytestmark = pytest.mark.django_db(transaction=True)

MESSAGES = [{"role": "user", "content": "Hello"}]


def _scale_to_zero(endpoint, start_mock_upstream, address: str) -> Replica:
    """What the autoscaler's scale-down and the agent do: the replica drains, its engine stops, it reports STOPPED."""
    replica = Replica.objects.get(endpoint=endpoint)
    Replica.objects.filter(pk=replica.pk).update(state=ReplicaState.STOPPED)
    start_mock_upstream.stop(address)
    return replica


def _served_then_scaled_to_zero(gateway, tenant, start_mock_upstream) -> tuple[Endpoint, Replica]:
    """An endpoint answers one call on its replica, then is scaled to zero: its endpoint and its STOPPED replica."""
    first = start_mock_upstream()
    endpoint = serve_endpoint(tenant.org, first)
    client = tenant.client(gateway)
    assert client.chat.completions.create(model=endpoint.name, messages=MESSAGES, max_tokens=2).usage.completion_tokens == 2
    return endpoint, _scale_to_zero(endpoint, start_mock_upstream, first)


@contextmanager
def _held_stream(gateway, tenant, endpoint) -> Iterator[Iterator[str]]:
    """A streamed chat call to the endpoint, answered 200: the lines of its stream, open while the context lasts."""
    body = {"model": endpoint.name, "messages": MESSAGES, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{gateway}/v1/chat/completions", headers={"Authorization": f"Bearer {tenant.key}"},
                      json=body, timeout=30) as response:
        assert response.status_code == 200, response.read()
        yield response.iter_lines()


def test_a_call_sent_to_a_replica_scaled_to_zero_a_moment_ago_is_held_for_the_next_replica_and_answered(
        gateway, tenant, start_mock_upstream):
    endpoint, stopped = _served_then_scaled_to_zero(gateway, tenant, start_mock_upstream)

    answer = held_chat(gateway, tenant.key, endpoint)  # held for a cold start, not answered 502
    Replica.objects.create(endpoint=endpoint, node=stopped.node, state=ReplicaState.READY, address=start_mock_upstream(),
                           ready_at=timezone.now())
    response = answer.result(30)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 5
    assert "x-inferplane-cold-start-ms" in response.headers
    rows = wait_until(lambda: list(UsageRecord.objects.order_by("started_at")) if UsageRecord.objects.count() == 2 else None,
                      10, message="two rows")
    assert [row.status for row in rows] == ["ok", "ok"]
    assert rows[1].cold_start_ms is not None


def test_a_stream_that_meets_the_scale_to_zero_is_held_with_progress_and_then_streamed(
        gateway, tenant, start_mock_upstream):
    endpoint, stopped = _served_then_scaled_to_zero(gateway, tenant, start_mock_upstream)

    with _held_stream(gateway, tenant, endpoint) as lines:
        first_line = next(lines)
        assert first_line.startswith(": "), first_line  # a progress comment: held, not an error event
        Replica.objects.create(endpoint=endpoint, node=stopped.node, state=ReplicaState.READY,
                               address=start_mock_upstream(), ready_at=timezone.now())
        rest = list(lines)
    events = [line[6:] for line in rest if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert not any('"error"' in event for event in events), events


def test_a_client_that_leaves_while_held_after_the_scale_to_zero_is_billed_nothing_and_leaves_no_place_or_wait_behind(
        gateway, tenant, start_mock_upstream):
    endpoint, _ = _served_then_scaled_to_zero(gateway, tenant, start_mock_upstream)

    with _held_stream(gateway, tenant, endpoint) as lines:  # NOTE: kept: an iterator collected closes the stream
        assert next(lines).startswith(": ")  # held
        redis = get_redis()
        assert redis.zcard(waiting_key(tenant.org.pk, str(endpoint.pk))) == 1  # counted waiting: the wake sees it
        assert redis.zcard(held_key(tenant.org.pk)) == 1
    redis = get_redis()
    # NOTE: the held place (`cold_start`) and the waiting count (the call's finish, `traffic`) are given up by two
    # scripts, in either order: the test waits for both, as it asserted neither left behind
    wait_until(lambda: not redis.zcard(held_key(tenant.org.pk)), 10, message="the held place given up")
    wait_until(lambda: not redis.zcard(waiting_key(tenant.org.pk, str(endpoint.pk))), 10, message="the wait given up")
    assert not redis.zcard(inflight_key(tenant.org.pk, str(endpoint.pk)))
    assert not redis.hlen(reservations_key(tenant.org.pk))
    assert list(UsageRecord.objects.values_list("status", flat=True)) == ["ok"]  # the held call left unbilled


def test_a_call_held_while_redis_loses_its_memory_is_still_answered_once_a_replica_is_ready(
        gateway, tenant, start_mock_upstream):
    endpoint = serve_endpoint(tenant.org)  # scaled to zero: no replica
    answer = held_chat(gateway, tenant.key, endpoint)
    get_redis().flushall()  # a restart without persistence
    Replica.objects.create(endpoint=endpoint, node=Node.objects.get(), state=ReplicaState.READY,
                           address=start_mock_upstream(), ready_at=timezone.now())
    response = answer.result(30)
    assert response.status_code == 200, response.text
    row = wait_until(lambda: UsageRecord.objects.first(), 10, message="its usage row")
    assert row.status == "ok" and row.completion_tokens == 5


def test_a_held_call_whose_engine_dies_on_it_is_answered_at_once_never_held_again_past_its_cold_start_timeout(
        gateway, tenant, start_mock_upstream):
    # NOTE: the bound a held call is answered by is the endpoint's `cold_start_timeout_s` of holding in all: held again
    # (its replica died before its first byte and none is READY), it waited a whole new timeout, twice the documented one.
    # Since an engine that read a call is never sent it again (tests/gateway/test_engine_retries.py: it may have
    # computed most of it), such a call is not held again either: it is answered at once, within the bound.
    endpoint = serve_endpoint(tenant.org, cold_start_timeout_s=4)  # scaled to zero: no replica
    held_from = time.monotonic()
    answer = held_chat(gateway, tenant.key, endpoint)
    time.sleep(max(0.0, held_from + 3 - time.monotonic()))  # most of the hold's bound spent
    dying = start_mock_upstream(prefill_ms=30_000)  # takes the call, and dies before its first byte
    replica = Replica.objects.create(endpoint=endpoint, node=Node.objects.get(), state=ReplicaState.READY, address=dying,
                                     ready_at=timezone.now())
    time.sleep(0.5)  # the call released to it and sent
    assert not answer.done()
    Replica.objects.filter(pk=replica.pk).update(state=ReplicaState.FAILED)
    start_mock_upstream.stop(dying)  # its engine dies: the call it holds is cut before a byte of its answer
    response = answer.result(30)
    answered_after_s = time.monotonic() - held_from
    assert response.status_code == 502 and response.json()["error"]["code"] == "upstream_error", response.text
    # held 3 s, then in the engine 1.5 s: answered at once, not 4 s later
    assert answered_after_s < 6.5, answered_after_s
    assert not UsageRecord.objects.exclude(status="ok").filter(completion_tokens__gt=0).exists()  # billed nothing


@pytest.mark.parametrize("stop", ["pause", "delete"])
def test_a_call_held_for_an_endpoint_its_organisation_pauses_or_deletes_meanwhile_is_answered_so_not_held_to_the_timeout(
        rewaking_gateway, tenant, stop):
    gateway = rewaking_gateway
    # NOTE: a pause (or a delete) drains the endpoint's replicas and starts none: a call held for it (a cold call, or one
    # held again because the pause drained the replica it was sent to) waited its whole cold-start timeout for a replica
    # that never came, holding its reservation and place, and was then told 503 "no replica became ready".
    endpoint = serve_endpoint(tenant.org, cold_start_timeout_s=40)  # scaled to zero: no replica
    held_from = time.monotonic()
    answer = held_chat(gateway, tenant.key, endpoint)
    (pause_endpoint if stop == "pause" else delete_endpoint)(Actor(user=tenant.owner), endpoint)
    response = answer.result(60)
    assert time.monotonic() - held_from < 20
    if stop == "pause":
        assert response.status_code == 503, response.text
        assert "is paused" in response.json()["error"]["message"]
    else:
        assert response.status_code == 404, response.text
    redis = get_redis()
    wait_until(lambda: not redis.zcard(held_key(tenant.org.pk)), 10, message="the held place given up")
    assert not redis.hlen(reservations_key(tenant.org.pk))


def test_a_call_whose_new_connection_its_stopping_engine_closed_unread_is_held_for_the_next_replica(
        gateway, tenant, start_mock_upstream):
    # The engine's server, stopping as its replica is scaled to zero, closes the call's brand-new connection with the
    # call unread (its kernel resets it). Before: a 502, though no engine had read the call.
    stopping = ClosingEngine(lambda number, body: True, unread=True)

    def scaled_to_zero():
        Replica.objects.filter(address=stopping.address).update(state=ReplicaState.STOPPED)
        connections.close_all()

    stopping.before_closing = scaled_to_zero
    endpoint = serve_endpoint(tenant.org, stopping.address)

    answer = held_chat(gateway, tenant.key, endpoint)  # held for a cold start, not answered 502
    assert stopping.num_closed == 1
    Replica.objects.create(endpoint=endpoint, node=Node.objects.get(), state=ReplicaState.READY,
                           address=start_mock_upstream(), ready_at=timezone.now())
    response = answer.result(30)
    assert response.status_code == 200, response.text
    assert "x-inferplane-cold-start-ms" in response.headers
