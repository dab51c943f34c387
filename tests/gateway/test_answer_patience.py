"""How long the gateway waits for a non-streamed answer past the read timeout (`InferenceCall._patience`):
while its replica's engine generates, by the database's account of it; and how a live gateway's beat keeps a
long call's reservation held meanwhile (`presence`)."""

import asyncio
import time
from datetime import timedelta
from types import SimpleNamespace

import django.db
import pytest
from django.utils import timezone

from controlplane.redis_keys import deadlines_key
from endpoints.gateway import call as call_module
from endpoints.gateway import directory, presence
from endpoints.gateway.call import PATIENCE_RECHECK_S, InferenceCall
from endpoints.models import Replica
from endpoints.nodes.models import Node
from gpu_agent.protocol import NodeState, ReplicaState
from tests.conftest import free_port
from tests.gateway.conftest import serve_endpoint

ADDRESS = "http://127.0.0.1:9"


def _replica(tenant, **fields) -> Replica:
    endpoint = serve_endpoint(tenant.org, ADDRESS)
    Replica.objects.filter(endpoint=endpoint).update(tokens_per_s=12.5)
    replica = Replica.objects.get(endpoint=endpoint)
    Replica.objects.filter(pk=replica.pk).update(**fields)
    return replica


def _generating(replica: Replica, address: str = ADDRESS) -> bool:
    return directory._engine_generating(str(replica.endpoint_id), str(replica.pk), address)


@pytest.mark.django_db
def test_an_engine_counts_as_generating_only_while_its_replica_serves_there_on_a_live_node(tenant):
    assert _generating(_replica(tenant))
    assert _generating(_replica(tenant, state=ReplicaState.DRAINING))  # finishes what it has
    assert not _generating(_replica(tenant, tokens_per_s=0.0))  # wedged, or the request is not in it
    assert not _generating(_replica(tenant, state=ReplicaState.FAILED))
    assert not _generating(_replica(tenant), address=f"http://127.0.0.1:{free_port()}")  # restarted elsewhere
    stale = _replica(tenant)
    Node.objects.filter(pk=stale.node_id).update(last_heartbeat_at=timezone.now() - timedelta(minutes=5))
    assert not _generating(stale)
    for state, generating in ((NodeState.CORDONED, True), (NodeState.DRAINING, True), (NodeState.OFFLINE, False)):
        replica = _replica(tenant)
        Node.objects.filter(pk=replica.node_id).update(state=state)
        assert _generating(replica) == generating, state


def _call(**fields) -> InferenceCall:
    call = object.__new__(InferenceCall)
    call.request_id, call.answer_deadline, call._started_monotonic = "req", None, time.monotonic()
    call._engine_check = call._waited_out_s = None
    call.endpoint = SimpleNamespace(id="e")
    for name, value in fields.items():
        setattr(call, name, value)
    return call


REPLICA = SimpleNamespace(id="r", address=ADDRESS)


def test_patience_grants_a_recheck_while_generating_and_never_past_the_deadline(monkeypatch):
    async def generating(*_):
        return True
    monkeypatch.setattr(directory, "engine_generating", generating)
    assert asyncio.run(_call()._patience(REPLICA)) == PATIENCE_RECHECK_S
    left = asyncio.run(_call(answer_deadline=time.monotonic() + 2)._patience(REPLICA))
    assert 1 < left <= 2  # never past the deadline
    assert asyncio.run(_call(answer_deadline=time.monotonic() - 1)._patience(REPLICA)) is None


@pytest.mark.parametrize("failure", ["database down", "database silent"])
def test_a_database_that_cannot_say_is_not_a_no(monkeypatch, failure):
    # A failover or a PgBouncer restart during the question gave up on every long call that asked: the
    # engine's work aborted, billed nothing.
    async def cannot_say(*_):
        if failure == "database down":
            raise django.db.OperationalError("server closed the connection unexpectedly")
        await asyncio.sleep(60)
    monkeypatch.setattr(directory, "engine_generating", cannot_say)
    monkeypatch.setattr(call_module, "PATIENCE_QUERY_TIMEOUT_S", 0.2)
    assert asyncio.run(_call()._patience(REPLICA)) == PATIENCE_RECHECK_S


def test_a_question_the_database_has_not_answered_is_waited_on_not_asked_again(monkeypatch):
    # Each question runs in a worker thread: asked again every 30 s while a stuck database held the last, the
    # threads piled up, and with them every other look-up of the gateway that needs one.
    asked = []

    async def stuck(*_):
        asked.append(1)
        await asyncio.sleep(60)
    monkeypatch.setattr(directory, "engine_generating", stuck)
    monkeypatch.setattr(call_module, "PATIENCE_QUERY_TIMEOUT_S", 0.1)

    async def main():
        call = _call()
        assert await call._patience(REPLICA) == PATIENCE_RECHECK_S
        assert await call._patience(REPLICA) == PATIENCE_RECHECK_S
        call._engine_check[0].cancel()
    asyncio.run(main())
    assert len(asked) == 1


class _Pipeline:
    def __init__(self, pushed: list):
        self.pushed = pushed
        self.answers: list = []

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False

    def zadd(self, key, mapping, xx=False, gt=False):
        self.pushed.append((key, dict(mapping), xx, gt))
        self.answers.append(0)

    def zmscore(self, key, members):
        self.answers.append([self.pushed[-1][1][member] for member in members])  # each still held, as pushed

    async def execute(self):
        return self.answers


class _Redis:
    def __init__(self):
        self.pushed: list = []

    def pipeline(self, transaction=True):
        return _Pipeline(self.pushed)

    async def time(self):
        return (1_000_000, 0)


def test_a_beat_every_second_pushes_a_long_calls_reservation_deadline_on_once_a_minute(monkeypatch, settings):
    # A first version moved its "last pushed" time on at every beat, due or not: with beats a second apart and
    # pushes a minute apart, none was ever due again, and a call past 15 min lost its hold.
    settings.BILLING_RESERVATION_TTL_S = 900.0
    monkeypatch.setattr(presence, "_extended", presence._Extended())
    monkeypatch.setattr(presence, "serving", {"long": presence.Held(7, "e", None, since=0.0),
                                              "new": presence.Held(7, "e", None, since=1e9)})
    redis = _Redis()

    async def beats():
        for second in range(100, 281):  # three minutes of beats, one a second
            await presence._push_deadlines_on(redis, now=float(second))
    asyncio.run(beats())

    assert len(redis.pushed) == 4  # at 100, 160, 220 and 280 s
    assert all(set(deadlines) == {"long"} and xx and gt for _, deadlines, xx, gt in redis.pushed)
    assert {key for key, *_ in redis.pushed} == {deadlines_key(7)}
