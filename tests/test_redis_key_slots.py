"""Every Lua script call passes keys of one Redis Cluster slot, so the scripts run on Redis Cluster.

The real code paths run here (on the test run's plain Redis) with every script call recorded: the
gateway's admission and finish (with and without an API key, in flight and waiting), the balancer's
pick and release, an unknown model's count, cold-start places, the heartbeat's restore (requests and reservations) and release,
the dead-gateway sweep, the reservation sweep, the journal replay's registration and count, counter rebuilds (one cancelled at its window) and refreshes, the counters' drop once Redis is another server, the autoscaler's
load read, and a form throttle's count, for two organisations at once. Each call's keys must hash to one slot, and every script the
project defines must have been called.
"""

from __future__ import annotations

import asyncio
import sys
import time
import types
import uuid
from decimal import Decimal

import pytest
from django.db import connection

from billing.ledger import record_usage, supersede_lost_rows
from billing.models import BillingAccount, UsageRecord
from billing.periods import period_containing
from billing.quota import counters, rebuild, replayed, server_change, sweeper
from controlplane import redis_keys
from controlplane.accounts import throttle
from controlplane.redis_client import get_async_redis, get_redis
from controlplane.redis_scripts import Script
from controlplane.script_parts import ComposedScript
from endpoints import autoscaler, scheduler
from endpoints.gateway import admission, cold_start, errors, presence, traffic
from endpoints.gateway.auth import Caller
from endpoints.gateway.ratelimit_headers import RateLimitReport
from tests.billing.conftest import usage_report
from tests.factories import EndpointFactory, OrganizationFactory

# NOTE: admission rebuilds counters in a worker thread, which sees only committed rows.
pytestmark = pytest.mark.django_db(transaction=True)

PROJECT_PACKAGES = ("controlplane", "endpoints", "billing")


def _project_scripts() -> dict[str, str]:
    """sha -> where it is defined, for every Script (or ComposedScript) a project module holds."""
    found = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith(PROJECT_PACKAGES) or not isinstance(module, types.ModuleType):
            continue
        for attribute, value in vars(module).items():
            if isinstance(value, ComposedScript):
                value = value._script
            if isinstance(value, Script):
                found[value.sha] = f"{name}.{attribute}"
    return found


@pytest.fixture
def script_calls(monkeypatch) -> list[tuple[str, list[str]]]:
    """(script sha, keys) of every script call made while the test runs."""
    calls: list[tuple[str, list[str]]] = []
    run_async, run_sync = Script.__call__, Script.run_sync

    async def recording_call(self, *, keys, args):
        calls.append((self.sha, list(keys)))
        return await run_async(self, keys=keys, args=args)

    def recording_run_sync(self, *, keys, args):
        calls.append((self.sha, list(keys)))
        return run_sync(self, keys=keys, args=args)

    monkeypatch.setattr(Script, "__call__", recording_call)
    monkeypatch.setattr(Script, "run_sync", recording_run_sync)
    return calls


def _caller(organization_id: int, api_key_id: int | None) -> Caller:
    return Caller(organization_id=organization_id, api_key_id=api_key_id, user_id=3, can_infer=True,
                  requests_per_minute=100, tokens_per_minute=100_000)


async def _one_organisations_traffic(organization_id: int, endpoint_id: str, api_key_id: int | None,
                                     progress=None) -> admission.Admission:
    caller = _caller(organization_id, api_key_id)
    replicas = [str(uuid.uuid4()), str(uuid.uuid4())]
    info = types.SimpleNamespace(id=endpoint_id, name="m", organization_id=organization_id, cold_start_timeout_s=60,
                                 max_held_requests=10)
    # in flight on a replica, then retried on the other one, then finished
    admitted = await admission.admit(caller=caller, endpoint_id=endpoint_id, request_id=f"in-flight-{organization_id}",
                                     amount=Decimal("0.01"), num_tokens=10, candidates=replicas)
    await traffic.release_replica(organization_id, replicas[admitted.picked], request_id=f"in-flight-{organization_id}",
                                  endpoint_id=endpoint_id, call_token=admitted.call_token)
    picked = await traffic.pick_replica(organization_id, replicas, request_id=f"in-flight-{organization_id}",
                                        endpoint_id=endpoint_id, call_token=admitted.call_token)
    await admission.finish(caller=caller, endpoint_id=endpoint_id, admission=admitted, release=replicas[picked],
                           num_tokens=5, cost=Decimal("0.001"))
    # waiting for a cold start, with a place in line
    place = await cold_start.take_place(info, organization_id, f"waiting-{organization_id}", call_token="c1")
    waiting = await admission.admit(caller=caller, endpoint_id=endpoint_id, request_id=f"waiting-{organization_id}",
                                    amount=Decimal("0.01"), num_tokens=10, candidates=[])
    place.kept_at -= cold_start.KEEP_PLACE_EVERY_S  # due to be put back, should Redis have lost it
    await cold_start.keep_place(place)
    await cold_start.give_up(place)
    await traffic.promote_request(organization_id, endpoint_id, f"waiting-{organization_id}")  # a replica came up
    await admission.finish(caller=caller, endpoint_id=endpoint_id, admission=waiting, release=None, num_tokens=0,
                           cost=Decimal("0"))
    # one the heartbeat restores after Redis forgot it (and records its progress), then ends later
    held = await admission.admit(caller=caller, endpoint_id=endpoint_id, request_id=f"held-{organization_id}",
                                 amount=Decimal("0.01"), num_tokens=10, candidates=replicas)
    presence.track(f"held-{organization_id}", organization_id, endpoint_id, replicas[0], held.reservation,
                   progress=progress, call_token=held.call_token)
    # one whose gateway dies: its reservation is swept after its deadline
    await admission.admit(caller=caller, endpoint_id=endpoint_id, request_id=f"orphan-{organization_id}",
                          amount=Decimal("0.01"), num_tokens=10, candidates=[])
    return held


def _read_past_the_window(*args, **kwargs):
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_sleep(10)")


def test_every_script_call_touches_keys_of_one_cluster_slot_and_every_script_is_called(script_calls):
    with_key, without_key = OrganizationFactory(), OrganizationFactory()
    endpoints = [EndpointFactory(organization=with_key), EndpointFactory(organization=without_key)]
    redis = get_redis()
    presence.serving.clear()
    presence.unfinished.clear()

    async def scenario():
        held = {}
        for organization, endpoint, api_key_id in ((with_key, endpoints[0], 4242), (without_key, endpoints[1], None)):
            report = usage_report(endpoint, request_id=f"held-{organization.pk}", status="gateway_lost")
            held[organization.pk] = await _one_organisations_traffic(organization.pk, str(endpoint.pk),
                                                                     api_key_id=api_key_id,
                                                                     progress=lambda recorded, report=report: report)
        redis.delete(redis_keys.gateway_alive_key(traffic.gateway_id()))
        for organization_id in (with_key.pk, without_key.pk):
            redis.delete(traffic.gateway_requests_key(organization_id))  # Redis forgot them
            redis.hdel(redis_keys.reservations_key(organization_id), f"held-{organization_id}")
        await presence.beat()  # puts them back, and records their progress
        assert redis.hlen(redis_keys.progress_key(with_key.pk)) == redis.hlen(redis_keys.progress_key(without_key.pk)) == 1
        for organization_id in (with_key.pk, without_key.pk):  # Redis lost their progress alone
            redis.hdel(redis_keys.progress_key(organization_id), f"held-{organization_id}")
        presence._repair.num_beats = presence.RECONCILE_EVERY_BEATS
        await presence.beat()  # a reconcile finds it lost, and the beat records it again
        assert redis.hlen(redis_keys.progress_key(with_key.pk)) == redis.hlen(redis_keys.progress_key(without_key.pk)) == 1
        for organization_id in (with_key.pk, without_key.pk):
            presence.end_later(organization_id, f"held-{organization_id}", call_token=held[organization_id].call_token,
                               give_back=held[organization_id].window.give_back_keys_and_args(
                                   5, held[organization_id].call_token))
        await presence.beat()  # ends them, and gives back their unused tokens
        # a call naming no model of its organisation: its key's limits read before the lookup, then counted
        with pytest.raises(errors.OpenAIError):
            await admission.resolve_model(caller=_caller(with_key.pk, 4242), model=f"no-such-model-{uuid.uuid4()}",
                                          report=RateLimitReport())
        # a counter whose limits were worked out under other rules: written again, its spend kept
        period_key = period_containing().key
        redis.hset(redis_keys.org_period_key(with_key.pk, period_key), "lv", "older rules")
        await rebuild.rebuild_missing("limits", counters.Reservation("r-lv", with_key.pk, None, Decimal(0), period_key))
        # a credit figure rebuilt (prepaid accounts: after a grant or mode change), calls still reserved given back
        redis.delete(redis_keys.credit_key(with_key.pk))
        await rebuild.rebuild_missing("credit", counters.Reservation("r-credit", with_key.pk, None, Decimal(0), period_key))
        # one whose read PostgreSQL cancels at its window: kept as too slow (a 503), then rebuilt given longer
        redis.delete(redis_keys.credit_key(with_key.pk))
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(rebuild, "REBUILD_MAX_S", 1)
            patch.setattr(rebuild, "undrawn_prepaid_spend_and_pending", _read_past_the_window)
            with pytest.raises(rebuild.RebuildTooSlow):
                await rebuild.rebuild_missing("credit", counters.Reservation("r-slow", with_key.pk, None, Decimal(0),
                                                                             period_key))
        await rebuild.rebuild_missing("credit", counters.Reservation("r-credit", with_key.pk, None, Decimal(0), period_key))
        # Redis is another server than the counters were counted on (a promoted replica, a restart): dropped (the
        # drop's lease renewed at each batch), trusted
        redis.set(redis_keys.TRUSTED_SERVER_KEY, "another/server")
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(server_change, "DROP_BATCH", 1)
            assert await server_change.check_server(get_async_redis()) >= 1

    try:
        asyncio.run(scenario())
        # a gateway that died holding requests of both organisations
        for organization in (with_key, without_key):
            dead = traffic.gateway_requests_key(organization.pk, "dead-gateway")
            redis.hset(dead, "r-dead", f"{endpoints[0].pk}|")
            redis.sadd(redis_keys.GATEWAYS_KEY, dead)
        assert presence.sweep_dead_gateways() == 2
        # the orphans' reservations and those of the requests ended later (never settled); one orphan was
        # served (its usage row written), so it is settled with its cost, as are those ended later, billed from
        # their progress
        # a row the journal's replay registers, writes, and counts in the counters that lack it
        replayed.register_replaying_sync([usage_report(endpoints[0], request_id=f"orphan-{with_key.pk}")])
        record_usage(usage_report(endpoints[0], request_id=f"orphan-{with_key.pk}"))
        assert replayed.count_replayed([f"orphan-{with_key.pk}"]) == 1
        assert sweeper.sweep_expired_reservations(now=time.time() + 10**6) == 4
        assert UsageRecord.objects.filter(status="gateway_lost").count() == 2
        # a lost call's journaled row, replayed after the sweeper wrote its row from the progress: the difference
        whole = usage_report(endpoints[0], request_id=f"held-{with_key.pk}", completion_tokens=60)
        assert replayed.count_superseded(supersede_lost_rows([whole])) == 1
        counters.refresh_limits(BillingAccount.objects.for_organization(with_key.pk))
        counters.refresh_key_limit(with_key.pk, 4242, Decimal("5"))
        autoscaler.read_load([str(e.pk) for e in endpoints])
        scheduler.forget_past_recent_endpoints(time.time() + traffic.RECENT_WINDOW_S + 10)  # a tick a day later
        # a form's attempt, counted against its address and the account it names together
        assert throttle.take(throttle.PASSWORD_RESET, {"ip": "203.0.113.8",
                                                       "email": f"{uuid.uuid4()}@example.test"}).retry_after_s is None
        # a right password: taken out of the failure counters again
        right = throttle.take(throttle.LOGIN, {"ip": "203.0.113.8", "username": f"{uuid.uuid4()}@example.test"})
        assert right.retry_after_s is None and right.provisional
        right.refund()
    finally:
        presence.serving.clear()
        presence.unfinished.clear()

    crossing = [(sha, {key: redis_keys.key_slot(key) for key in keys}) for sha, keys in script_calls
                if len({redis_keys.key_slot(key) for key in keys}) > 1]
    scripts = _project_scripts()
    assert not crossing, "script calls across slots:\n" + "\n".join(
        f"{scripts.get(sha, sha)}: {slots}" for sha, slots in crossing)
    never_called = sorted(set(scripts) - {sha for sha, _ in script_calls})
    assert not never_called, f"scripts this test never ran: {[scripts[sha] for sha in never_called]}"


def test_keys_of_different_organisations_carry_different_tags():
    assert redis_keys.org_tag(1) != redis_keys.org_tag(2)
    assert redis_keys.key_slot(redis_keys.inflight_key(7, "e")) == redis_keys.key_slot(redis_keys.credit_key(7))
    assert redis_keys.organization_of_key(traffic.gateway_requests_key(31, "gw-1")) == 31
    assert redis_keys.gateway_of_requests_key(traffic.gateway_requests_key(31, "host-1-ab:cd")) == "host-1-ab:cd"


def test_a_once_scripts_token_is_in_the_slot_of_its_first_key():
    # `Script(once=True)` adds the call's token as its last key (`controlplane.redis_scripts`).
    for key in (redis_keys.credit_key(7), redis_keys.replaying_key(7), redis_keys.settled_key(7, "r{1}"),
                redis_keys.throttle_key("login-account", "d" * 32, 1), "plain"):
        assert redis_keys.key_slot(redis_keys.once_key(key, "token")) == redis_keys.key_slot(key)
