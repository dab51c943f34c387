"""A quota lowered below what an organisation holds (its plan changed, or it moved to a smaller plan) drains it down
to the new limit through the endpoints' own reconciles: one replica at a time, newest first, each drain audited and
the endpoints showing why. Never all at once: a mistyped plan must not take every tenant on it cold in one tick."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.urls import reverse
from django.utils import timezone

from controlplane.accounts.models import AuditEvent, Plan
from controlplane.accounts.services import SYSTEM, save_plan, set_organization_plan
from endpoints import replicas, scheduler
from endpoints.autoscaler import Load
from endpoints.models import Replica
from gpu_agent.protocol import ReplicaState
from tests.factories import EndpointFactory
from tests.test_admin_stale_edits import _as_shown, _shown_again
from tests.test_placement import make_node

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _no_grace(settings):
    """The drains themselves, with no grace before them (`test_quota_drain_grace.py` has the grace)."""
    settings.QUOTA_DRAIN_GRACE_S = 0


def _busy() -> Load:
    return Load(num_inflight=10, num_waiting=0, last_request_at=time.time(), peak_concurrency=10)


@pytest.fixture
def reconciles_asked(monkeypatch) -> list[str]:
    """The endpoints whose reconcile a change asked for (`replicas.request_reconcile`, after its commit)."""
    asked = []
    monkeypatch.setattr(replicas, "send_task", lambda name, args, **kwargs: asked.append(args[0]))
    return asked


def _serving_four(org):
    """Two endpoints of `org` with two READY replicas each, made oldest to newest: first's, then second's."""
    save_plan(SYSTEM, plan := Plan(name=f"team-{org.pk}", max_replicas=4, max_gpus_by_type={"l4": 4}))
    set_organization_plan(SYSTEM, org, plan)
    endpoints = [EndpointFactory(organization=org, gpu_type="l4", max_replicas=2, target_concurrency=1)
                 for _ in range(2)]
    for _ in range(4):
        make_node(memory_mb=80_000)
    for endpoint in endpoints:
        scheduler.reconcile_endpoint(str(endpoint.pk), _busy())
    made = list(Replica.objects.filter(endpoint__organization=org).order_by("endpoint__created_at", "endpoint_id", "pk"))
    assert len(made) == 4
    start = timezone.now() - timedelta(minutes=10)
    for age, replica in enumerate(made):
        Replica.objects.filter(pk=replica.pk).update(state=ReplicaState.READY, created_at=start + timedelta(seconds=age))
    return plan, endpoints, made


def _states(made) -> list[str]:
    return [Replica.objects.get(pk=replica.pk).state for replica in made]


def _reconcile(endpoint_ids) -> None:
    for endpoint_id in sorted(set(endpoint_ids)):
        scheduler.reconcile_endpoint(endpoint_id, _busy())


def _agent_confirms_the_drain(made) -> None:
    Replica.objects.filter(pk__in=[r.pk for r in made], state=ReplicaState.DRAINING).update(state=ReplicaState.STOPPED)


def test_a_plan_staff_lower_below_what_an_organisation_holds_drains_it_one_replica_at_a_time_newest_first(
        org, staff_client, reconciles_asked, django_capture_on_commit_callbacks):
    # Before, a lowered plan bounded only new placements: the organisation kept its four replicas on a plan of two,
    # for as long as its traffic kept them, and nothing said it was over its plan.
    plan, endpoints, made = _serving_four(org)
    reconciles_asked.clear()
    url = reverse("admin:controlplane_plan_change", args=[plan.pk])
    shown = staff_client.post(url, {**_as_shown(staff_client, url), "max_replicas": ["2"]})  # what it drains
    with django_capture_on_commit_callbacks(execute=True):  # confirmed (`test_quota_drain_grace.py`)
        response = staff_client.post(url, {**_shown_again(shown), "confirm_drain": ["on"]})
    assert response.status_code == 302, response.content.decode()[:2000]
    assert sorted(set(reconciles_asked)) == sorted(str(endpoint.pk) for endpoint in endpoints)

    _reconcile(reconciles_asked)

    READY, DRAINING, STOPPED = ReplicaState.READY, ReplicaState.DRAINING, ReplicaState.STOPPED
    assert _states(made) == [READY, READY, READY, DRAINING]  # the newest first, and only it
    for endpoint in endpoints:
        endpoint.refresh_from_db()
        assert endpoint.status_message.startswith("over quota: your plan now allows 2 replicas at once, fewer than "
                                                  "your endpoints hold"), endpoint.status_message
        assert endpoint.events.filter(message=endpoint.status_message).count() == 1  # its log says why, once
    event = AuditEvent.objects.get(action="replica.quota_drain")
    assert (event.organization, event.details["replica"], event.details["limit"]) == (org, str(made[3].pk), 2)

    _reconcile(str(endpoint.pk) for endpoint in endpoints)  # the next tick: the drain has not finished
    assert _states(made) == [READY, READY, READY, DRAINING]

    _agent_confirms_the_drain(made)
    _reconcile(str(endpoint.pk) for endpoint in endpoints)
    assert _states(made) == [READY, READY, DRAINING, STOPPED]

    _agent_confirms_the_drain(made)
    _reconcile(str(endpoint.pk) for endpoint in endpoints)
    assert _states(made) == [READY, READY, STOPPED, STOPPED]  # down to the plan, and no further
    assert AuditEvent.objects.filter(action="replica.quota_drain").count() == 2
    for endpoint in endpoints:
        endpoint.refresh_from_db()
        assert not endpoint.status_message.startswith("over quota"), endpoint.status_message
    assert Replica.objects.filter(endpoint__organization=org, state__in=[ReplicaState.PENDING, READY]).count() == 2


def test_an_organisation_moved_to_a_smaller_plan_drains_to_it_and_other_tenants_are_untouched(
        org, reconciles_asked, django_capture_on_commit_callbacks):
    _, endpoints, made = _serving_four(org)
    other = EndpointFactory(gpu_type="l4", max_replicas=1, target_concurrency=1)
    scheduler.reconcile_endpoint(str(other.pk), _busy())
    reconciles_asked.clear()
    small = save_plan(SYSTEM, Plan(name="small", max_replicas=8, max_gpus_by_type={"l4": 3}))

    with django_capture_on_commit_callbacks(execute=True):
        set_organization_plan(SYSTEM, org, small)
    _reconcile([*reconciles_asked, str(other.pk)])

    assert _states(made)[-1] == ReplicaState.DRAINING and _states(made)[:3] == [ReplicaState.READY] * 3
    endpoints[1].refresh_from_db()
    assert endpoints[1].status_message.startswith("over quota: your plan now allows 3 l4 GPUs at once")
    assert Replica.objects.filter(endpoint=other).exclude(state=ReplicaState.DRAINING).count() == 1


def test_the_tick_drains_an_organisation_over_its_plan_though_the_reconciles_asked_for_were_lost(org, reconciles_asked):
    # The reconciles a plan change asks for are hints (a broker out of reach loses them); the tick skipped an endpoint
    # serving what its autoscaler wants, so an organisation over its lowered plan was never drained.
    plan, endpoints, made = _serving_four(org)
    within = EndpointFactory(gpu_type="l4", max_replicas=1, target_concurrency=1)
    scheduler.reconcile_endpoint(str(within.pk), _busy())
    plan.max_replicas = 3
    save_plan(SYSTEM, plan)  # its reconciles never run (no commit in this test)
    ids = sorted(str(endpoint.pk) for endpoint in [*endpoints, within])

    changing = scheduler.endpoints_to_reconcile(ids, {endpoint_id: _busy() for endpoint_id in ids})

    assert changing == sorted(str(endpoint.pk) for endpoint in endpoints)
    _reconcile(changing)
    assert _states(made)[-1] == ReplicaState.DRAINING


def _ready(endpoint, node, created_at) -> Replica:
    return Replica.objects.create(endpoint=endpoint, node=node, state=ReplicaState.READY, created_at=created_at)


def test_an_organisation_past_its_gpus_drains_its_newest_replica_though_that_endpoint_takes_one_gpu_a_replica(org):
    # Before, an endpoint of one GPU a replica judged only the replica count where its plan bounded its GPU type no
    # lower: the organisation's newest replica was such an endpoint's, which found nothing over, and the endpoint of two
    # GPUs a replica that found its plan's GPUs past did not hold the newest. Nothing ever drained, and the tick
    # reconciled both at every tick, for as long as the organisation kept its replicas.
    plan = save_plan(SYSTEM, Plan(name="wide", max_replicas=8))
    set_organization_plan(SYSTEM, org, plan)
    wide = EndpointFactory(organization=org, gpu_type="l4", gpus_per_replica=2, max_replicas=1, target_concurrency=1)
    narrow = EndpointFactory(organization=org, gpu_type="l4", max_replicas=2, target_concurrency=1)
    node = make_node(memory_mb=80_000, num_gpus=8)
    start = timezone.now() - timedelta(minutes=10)
    made = [_ready(wide, node, start), _ready(narrow, node, start + timedelta(seconds=1)),
            _ready(narrow, node, start + timedelta(seconds=2))]
    plan.max_replicas = 3
    save_plan(SYSTEM, plan)  # 3 replicas are within it; their 4 l4 GPUs are not
    ids = sorted(str(endpoint.pk) for endpoint in (wide, narrow))

    _reconcile(scheduler.endpoints_to_reconcile(ids, {endpoint_id: _busy() for endpoint_id in ids}))

    assert _states(made) == [ReplicaState.READY, ReplicaState.READY, ReplicaState.DRAINING]
    narrow.refresh_from_db()
    assert narrow.status_message.startswith("over quota: your plan now allows 3 l4 GPUs at once"), narrow.status_message


def test_an_organisation_on_the_platform_defaults_keeps_its_replicas_when_a_process_reads_lower_defaults(org, settings):
    # The defaults are each process's environment (`INFERPLANE_DEFAULT_MAX_*`), not a row staff change: while a deploy
    # that raises them rolls out, the workers of the release before read the old ones, and a slip in a manifest reads
    # lower ones. Before, such a worker drained, one replica after another, every organisation on the defaults that held
    # more: a scale-down of every tenant without a plan, and in a rolling deploy each replica the new workers placed.
    # A lowered default still bounds what is placed (as before the drains).
    endpoint = EndpointFactory(organization=org, gpu_type="l4", max_replicas=4, target_concurrency=1)
    node = make_node(memory_mb=80_000, num_gpus=8)
    start = timezone.now() - timedelta(minutes=10)
    made = [_ready(endpoint, node, start + timedelta(seconds=n)) for n in range(3)]
    settings.DEFAULT_MAX_REPLICAS = 2
    ids = [str(endpoint.pk)]

    assert scheduler.endpoints_to_reconcile(ids, {ids[0]: _busy()}) == ids  # it wants 4: waiting for quota
    _reconcile(ids)

    assert _states(made) == [ReplicaState.READY] * 3
    assert Replica.objects.filter(endpoint=endpoint).count() == 3
    endpoint.refresh_from_db()
    assert endpoint.status_message.startswith("waiting for quota: your plan allows 2 replicas"), endpoint.status_message
    assert not AuditEvent.objects.filter(action="replica.quota_drain").exists()



def test_a_plan_raised_asks_for_no_reconcile_of_the_endpoints_of_the_organisations_on_it(
        org, reconciles_asked, django_capture_on_commit_callbacks):
    # Before, every change of a plan's replicas or GPUs, a raise too, asked for a reconcile of each endpoint serving for
    # each organisation on it, sent one by one after staff's save: on a plan thousands of organisations are on, thousands
    # of tasks in the workers' queue ahead of every tenant's cold start, for nothing to drain (and an endpoint waiting
    # for quota is reconciled by the tick, which its message brings it to).
    plan, endpoints, made = _serving_four(org)
    reconciles_asked.clear()
    plan.max_replicas, plan.max_gpus_by_type = 16, {"l4": 16}

    with django_capture_on_commit_callbacks(execute=True):
        save_plan(SYSTEM, plan)
        set_organization_plan(SYSTEM, org, save_plan(SYSTEM, Plan(name="larger", max_replicas=32)))

    assert reconciles_asked == []
    assert _states(made) == [ReplicaState.READY] * 4
