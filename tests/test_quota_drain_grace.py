"""A plan lowered by mistake must not scale a fleet's tenants down within a minute: staff see what a lowering drains and
confirm it (the admin's plan and organisation pages), and the drains start only after a grace
(`INFERPLANE_QUOTA_DRAIN_GRACE_S`), counted from a start stored in the database, which a plan raised back cancels."""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.db.models.functions import Now
from django.urls import reverse

from controlplane.accounts.models import AuditEvent, Organization, Plan
from controlplane.accounts.services import SYSTEM, save_plan, set_organization_plan
from endpoints import scheduler
from endpoints.models import Endpoint, Replica
from gpu_agent.protocol import ReplicaState
from tests.test_admin_stale_edits import _as_shown, _shown_again
from tests.test_quota_lowered import _busy, _reconcile, _serving_four, _states, reconciles_asked  # noqa: F401

# NOTE: the reconciles a change asks for are noted, not sent to the broker; each test reconciles itself
pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("reconciles_asked")]

READY, DRAINING = ReplicaState.READY, ReplicaState.DRAINING
GRACE_S = 600


@pytest.fixture(autouse=True)
def _grace(settings):
    settings.QUOTA_DRAIN_GRACE_S = GRACE_S


def _refused_for_confirmation(response) -> str:
    assert response.status_code == 200, response.content.decode()[:2000]
    errors = response.context["adminform"].form.errors
    assert list(errors) == ["confirm_drain"], errors
    return errors["confirm_drain"][0]


def _lower(plan, **quotas) -> None:
    for name, value in quotas.items():
        setattr(plan, name, value)
    save_plan(SYSTEM, plan)


@contextlib.contextmanager
def _row_held_by_another_write(org, *, hold_s: float | None = None, before_release=None):
    """The organisation's row held by another connection (as a key revocation or an endpoint's edit holds it) for the
    block, or for `hold_s` from its start; `before_release` runs in that connection's thread, the row still held."""
    held, release = threading.Event(), threading.Event()

    def another_write():
        try:
            with transaction.atomic():
                Organization.objects.select_for_update(no_key=True).filter(pk=org.pk).values_list("pk").first()
                held.set()
                if hold_s is None:
                    release.wait(10)
                else:
                    time.sleep(hold_s)
                if before_release is not None:
                    before_release()
        finally:
            connection.close()

    with ThreadPoolExecutor(1) as pool:
        holder = pool.submit(another_write)
        assert held.wait(10)
        try:
            yield
        finally:
            release.set()
        holder.result()


def _lowered(org, capture_on_commit, **quotas):
    """`_serving_four`'s organisation, its plan lowered to `quotas` (committed) and its endpoints reconciled."""
    plan, endpoints, made = _serving_four(org)
    with capture_on_commit(execute=True):
        _lower(plan, **quotas)
    _reconcile(str(endpoint.pk) for endpoint in endpoints)
    return plan, endpoints, made


def test_staff_who_lower_a_plan_see_what_it_drains_and_nothing_is_saved_until_they_confirm(
        org, staff_client, django_capture_on_commit_callbacks):
    # Before, a mistyped plan (max_replicas 0) was saved at once, and every tenant on it drained to zero within a
    # minute, one replica a tick.
    plan, endpoints, made = _serving_four(org)
    url = reverse("admin:controlplane_plan_change", args=[plan.pk])

    response = staff_client.post(url, {**_as_shown(staff_client, url), "max_replicas": ["0"]})

    message = _refused_for_confirmation(response)
    assert "4 replica(s) of 2 endpoint(s) in 1 organisation(s)" in message, message
    plan.refresh_from_db()
    assert plan.max_replicas == 4
    assert not AuditEvent.objects.filter(action__in=["plan.update", "plan.change"]).exists()

    with django_capture_on_commit_callbacks(execute=True):
        response = staff_client.post(url, {**_shown_again(response), "confirm_drain": ["on"]})

    assert response.status_code == 302, response.content.decode()[:2000]
    plan.refresh_from_db()
    assert plan.max_replicas == 0
    event = AuditEvent.objects.get(action="plan.change")
    assert (event.details["num_organizations"], event.details["num_endpoints"], event.details["num_replicas"],
            event.details["confirmed"], event.actor) == (1, 2, 4, True, staff_client.staff)
    assert _states(made) == [READY] * 4  # the grace first


def test_a_box_ticked_on_a_page_that_did_not_show_what_the_save_drains_confirms_nothing(org, staff_client):
    plan, endpoints, made = _serving_four(org)
    url = reverse("admin:controlplane_plan_change", args=[plan.pk])

    response = staff_client.post(url, {**_as_shown(staff_client, url), "max_replicas": ["0"], "confirm_drain": ["on"]})

    _refused_for_confirmation(response)
    assert "confirm_drain" not in _shown_again(response)  # shown again unticked
    plan.refresh_from_db()
    assert plan.max_replicas == 4


def test_a_confirmation_of_fewer_replicas_than_the_save_drains_now_confirms_nothing(org, staff_client):
    plan, endpoints, made = _serving_four(org)
    url = reverse("admin:controlplane_plan_change", args=[plan.pk])
    response = staff_client.post(url, {**_as_shown(staff_client, url), "max_replicas": ["3"]})
    assert "1 replica(s) of 1 endpoint(s)" in _refused_for_confirmation(response)
    Replica.objects.create(endpoint=endpoints[0], node=made[0].node, state=READY)  # the fleet grew since it was shown

    response = staff_client.post(url, {**_shown_again(response), "confirm_drain": ["on"]})

    assert "2 replica(s) of 2 endpoint(s)" in _refused_for_confirmation(response)
    plan.refresh_from_db()
    assert plan.max_replicas == 4


def test_a_plan_change_that_drains_nothing_is_saved_without_a_confirmation(org, staff_client):
    plan, endpoints, made = _serving_four(org)
    url = reverse("admin:controlplane_plan_change", args=[plan.pk])

    response = staff_client.post(url, {**_as_shown(staff_client, url), "max_replicas": ["4"], "max_endpoints": ["3"],
                                       "max_gpus_by_type": ['{"l4": 6}']})

    assert response.status_code == 302, response.content.decode()[:2000]
    plan.refresh_from_db()
    assert (plan.max_endpoints, plan.max_gpus_by_type) == (3, {"l4": 6})
    assert not AuditEvent.objects.filter(action="plan.change").exists()


def test_staff_who_move_an_organisation_to_a_smaller_plan_see_what_it_drains_and_confirm_it(org, staff_client):
    plan, endpoints, made = _serving_four(org)
    small = save_plan(SYSTEM, Plan(name="small", max_replicas=8, max_gpus_by_type={"l4": 3}))
    url = reverse("admin:controlplane_organization_change", args=[org.pk])

    response = staff_client.post(url, {**_as_shown(staff_client, url), "plan": [str(small.pk)]})

    message = _refused_for_confirmation(response)
    assert "1 replica(s) of 1 endpoint(s) in 1 organisation(s)" in message, message
    org.refresh_from_db()
    assert org.plan == plan

    response = staff_client.post(url, {**_shown_again(response), "confirm_drain": ["on"]})

    assert response.status_code == 302, response.content.decode()[:2000]
    org.refresh_from_db()
    assert org.plan == small
    event = AuditEvent.objects.get(action="plan.change")
    assert (event.organization, event.details["num_replicas"]) == (org, 1)


def test_a_lowered_plan_drains_nothing_during_its_grace_and_its_endpoints_say_from_when(
        org, django_capture_on_commit_callbacks):
    plan, endpoints, made = _lowered(org, django_capture_on_commit_callbacks, max_replicas=2)
    ids = sorted(str(endpoint.pk) for endpoint in endpoints)
    _reconcile(scheduler.endpoints_to_reconcile(ids, {endpoint_id: _busy() for endpoint_id in ids}))

    assert _states(made) == [READY] * 4
    org.refresh_from_db()
    drains_from = (org.over_quota_since + timedelta(seconds=GRACE_S)).strftime("%Y-%m-%d %H:%M:%S")
    for endpoint in endpoints:
        endpoint.refresh_from_db()
        assert endpoint.status_message.startswith(
            f"over quota: your plan now allows 2 replicas at once, fewer than your endpoints hold; replicas above it "
            f"stop from {drains_from} UTC"), endpoint.status_message
    assert not AuditEvent.objects.filter(action="replica.quota_drain").exists()


def test_a_plan_raised_back_during_the_grace_cancels_the_drain_with_nothing_stopped(
        org, django_capture_on_commit_callbacks):
    plan, endpoints, made = _lowered(org, django_capture_on_commit_callbacks, max_replicas=0)
    Organization.objects.filter(pk=org.pk).update(over_quota_since=Now() - timedelta(seconds=GRACE_S - 1))

    with django_capture_on_commit_callbacks(execute=True):
        _lower(plan, max_replicas=4)  # a second before the drains start
    Organization.objects.filter(pk=org.pk, over_quota_since__isnull=False).update(
        over_quota_since=Now() - timedelta(hours=1))  # the grace as it would have been, long ended
    _reconcile(str(endpoint.pk) for endpoint in endpoints)

    org.refresh_from_db()
    assert org.over_quota_since is None
    assert _states(made) == [READY] * 4
    for endpoint in endpoints:
        endpoint.refresh_from_db()
        assert not endpoint.status_message.startswith("over quota"), endpoint.status_message


def test_a_bigger_plan_during_the_grace_cancels_the_drain(org, django_capture_on_commit_callbacks):
    plan, endpoints, made = _serving_four(org)
    with django_capture_on_commit_callbacks(execute=True):
        _lower(plan, max_replicas=1)
        set_organization_plan(SYSTEM, org, save_plan(SYSTEM, Plan(name="bigger", max_replicas=16)))

    org.refresh_from_db()
    assert org.over_quota_since is None
    _reconcile(str(endpoint.pk) for endpoint in endpoints)
    assert _states(made) == [READY] * 4


def test_the_grace_counts_from_its_stored_start_so_a_restarted_scheduler_neither_restarts_nor_skips_it(
        org, django_capture_on_commit_callbacks):
    plan, endpoints, made = _serving_four(org)
    with django_capture_on_commit_callbacks(execute=True):
        _lower(plan, max_replicas=3)
    ids = sorted(str(endpoint.pk) for endpoint in endpoints)
    loads = {endpoint_id: _busy() for endpoint_id in ids}

    Organization.objects.filter(pk=org.pk).update(over_quota_since=Now() - timedelta(seconds=GRACE_S - 60))
    _reconcile(scheduler.endpoints_to_reconcile(ids, loads))
    assert _states(made) == [READY] * 4  # a minute to go: not skipped

    Organization.objects.filter(pk=org.pk).update(over_quota_since=Now() - timedelta(seconds=GRACE_S + 1))
    _reconcile(scheduler.endpoints_to_reconcile(ids, loads))  # a fresh process: nothing of the grace in memory
    assert _states(made) == [READY, READY, READY, DRAINING]  # not restarted either
    event = AuditEvent.objects.get(action="replica.quota_drain")
    assert (event.details["replica"], event.details["limit"]) == (str(made[3].pk), 3)


def test_an_organisation_back_within_its_plan_gets_a_new_grace_when_the_plan_is_lowered_again(
        org, django_capture_on_commit_callbacks):
    plan, endpoints, made = _serving_four(org)
    ids = sorted(str(endpoint.pk) for endpoint in endpoints)
    loads = {endpoint_id: _busy() for endpoint_id in ids}
    with django_capture_on_commit_callbacks(execute=True):
        _lower(plan, max_replicas=3)
    Organization.objects.filter(pk=org.pk).update(over_quota_since=Now() - timedelta(hours=1))
    _reconcile(scheduler.endpoints_to_reconcile(ids, loads))
    Replica.objects.filter(state=DRAINING).update(state=ReplicaState.STOPPED)  # the agent confirms the drain

    scheduler.endpoints_to_reconcile(ids, loads)  # within its plan: the tick ends its grace
    org.refresh_from_db()
    assert org.over_quota_since is None

    with django_capture_on_commit_callbacks(execute=True):
        _lower(plan, max_replicas=2)
    _reconcile(scheduler.endpoints_to_reconcile(ids, loads))
    assert _states(made)[:3] == [READY] * 3


@pytest.mark.django_db(transaction=True)  # NOTE: another connection holds the organisation's row
def test_the_tick_never_waits_for_an_organisation_row_another_write_holds_to_start_its_grace(org):
    # The grace is stamped on the organisation's row, which a key revocation walking thousands of keys holds for
    # seconds: waited for, the tick (every tenant's reconciles) waited too. A reconcile's task waits holding nothing
    # (`test_the_reconcile_a_lowering_asks_for_waits_for_a_held_organisation_row_to_start_its_grace`).
    plan, endpoints, made = _serving_four(org)
    _lower(plan, max_replicas=3)
    Organization.objects.filter(pk=org.pk).update(over_quota_since=None)  # the change's stamp not written
    ids = sorted(str(endpoint.pk) for endpoint in endpoints)
    with _row_held_by_another_write(org):
        started = time.monotonic()
        changing = scheduler.endpoints_to_reconcile(ids, {endpoint_id: _busy() for endpoint_id in ids})
        for endpoint_id in changing:
            scheduler.reconcile_endpoint(endpoint_id, _busy(), in_a_tick=True)
        took_s = time.monotonic() - started

    assert changing == ids
    assert took_s < 5, took_s
    assert _states(made) == [READY] * 4  # no grace stamped yet: nothing drains
    scheduler.endpoints_to_reconcile(ids, {endpoint_id: _busy() for endpoint_id in ids})
    org.refresh_from_db()
    assert org.over_quota_since is not None  # the next tick starts it


def test_a_plan_lowered_again_while_its_organisations_are_over_gives_them_a_new_grace(
        org, django_capture_on_commit_callbacks):
    # Before, an organisation still over kept its first grace's start: a mistyped further lowering (max_replicas 0)
    # made late in a grace, or while an earlier lowering still drained, drained at once, with no time to raise it back.
    plan, endpoints, made = _lowered(org, django_capture_on_commit_callbacks, max_replicas=3)
    Organization.objects.filter(pk=org.pk).update(over_quota_since=Now() - timedelta(seconds=GRACE_S + 1))

    with django_capture_on_commit_callbacks(execute=True):
        _lower(plan, max_replicas=0)
    _reconcile(str(endpoint.pk) for endpoint in endpoints)

    assert _states(made) == [READY] * 4
    org.refresh_from_db()
    assert org.over_quota_since > Organization.objects.annotate(now=Now()).get(pk=org.pk).now - timedelta(seconds=60)


def test_a_move_to_a_smaller_plan_while_over_gives_a_new_grace(org, django_capture_on_commit_callbacks):
    plan, endpoints, made = _lowered(org, django_capture_on_commit_callbacks, max_replicas=3)
    Organization.objects.filter(pk=org.pk).update(over_quota_since=Now() - timedelta(seconds=GRACE_S + 1))

    with django_capture_on_commit_callbacks(execute=True):
        set_organization_plan(SYSTEM, org, save_plan(SYSTEM, Plan(name="tiny", max_replicas=1)))
    _reconcile(str(endpoint.pk) for endpoint in endpoints)

    assert _states(made) == [READY] * 4


def test_a_plan_raised_but_still_below_what_an_organisation_holds_keeps_its_grace(
        org, django_capture_on_commit_callbacks):
    plan, endpoints, made = _lowered(org, django_capture_on_commit_callbacks, max_replicas=1)
    Organization.objects.filter(pk=org.pk).update(over_quota_since=Now() - timedelta(seconds=GRACE_S + 1))

    with django_capture_on_commit_callbacks(execute=True):
        _lower(plan, max_replicas=3)  # a raise restarts nothing: the drains it leaves were due
    _reconcile(str(endpoint.pk) for endpoint in endpoints)

    assert _states(made) == [READY, READY, READY, DRAINING]


@pytest.mark.parametrize("counts", ['{"l4": -1}', '{"l4": "two"}', "[2]"])
def test_a_plan_page_with_malformed_gpu_limits_says_so_rather_than_failing(org, staff_client, counts):
    # Before, the drains' count read the edited GPU limits before the plan's own check had refused them: a 500.
    plan, endpoints, made = _serving_four(org)
    url = reverse("admin:controlplane_plan_change", args=[plan.pk])

    response = staff_client.post(url, {**_as_shown(staff_client, url), "max_replicas": ["2"],
                                       "max_gpus_by_type": [counts]})

    assert response.status_code == 200, response.content.decode()[:2000]
    assert "max_gpus_by_type" in response.context["adminform"].form.errors
    plan.refresh_from_db()
    assert (plan.max_replicas, plan.max_gpus_by_type) == (4, {"l4": 4})


@pytest.mark.django_db(transaction=True)  # NOTE: another connection holds the organisation's row
def test_an_organisation_whose_grace_is_not_yet_stamped_shows_one_message_not_a_new_one_each_reconcile(org):
    # Before, each reconcile while the row was held said the drains start a grace from its own moment: a new status
    # message and event on every endpoint at every tick, for as long as other writes kept the row held.
    plan, endpoints, made = _serving_four(org)
    _lower(plan, max_replicas=3)
    Organization.objects.filter(pk=org.pk).update(over_quota_since=None)  # the change's stamp not written
    messages = []
    with _row_held_by_another_write(org):
        for _ in range(2):
            _reconcile([str(endpoints[0].pk)])
            endpoints[0].refresh_from_db()
            messages.append(endpoints[0].status_message)
            time.sleep(1.1)  # the next tick, a second on

    assert messages[0].startswith("over quota: your plan now allows 3 replicas at once"), messages[0]
    assert messages[0] == messages[1]
    assert _states(made) == [READY] * 4


@pytest.mark.django_db(transaction=True)  # NOTE: another connection holds the organisation's row
def test_the_reconcile_a_lowering_asks_for_waits_for_a_held_organisation_row_to_start_its_grace(org):
    # Before, it skipped the held row as the tick does: a tenant whose writes (keys, endpoints, uploads) kept its row
    # held at every tick and reconcile never had its grace started, and kept the replicas its lowered plan no longer
    # allows for as long as it kept them up.
    plan, endpoints, made = _serving_four(org)
    _lower(plan, max_replicas=3)
    Organization.objects.filter(pk=org.pk).update(over_quota_since=None)  # the change's stamp not written
    endpoint_free = []

    def endpoint_row_free():  # the reconcile waited meanwhile: holding nothing, its endpoint's row free
        endpoint_free.append(Endpoint.objects.select_for_update(skip_locked=True).filter(pk=endpoints[0].pk).exists())

    with _row_held_by_another_write(org, hold_s=1, before_release=endpoint_row_free):
        scheduler.reconcile_endpoint(str(endpoints[0].pk), _busy())  # the task, not the tick

    assert endpoint_free == [True]
    org.refresh_from_db()
    assert org.over_quota_since is not None
    assert _states(made) == [READY] * 4


@pytest.mark.django_db(transaction=True)  # NOTE: another connection holds the organisation's row
def test_a_further_lowering_restarts_the_grace_of_an_organisation_whose_row_another_write_holds(org):
    # Before, the change skipped the held row: the organisation kept its first grace's start, long ended, and drained
    # at once.
    plan, endpoints, made = _serving_four(org)
    _lower(plan, max_replicas=3)
    Organization.objects.filter(pk=org.pk).update(over_quota_since=Now() - timedelta(seconds=GRACE_S + 1))
    with _row_held_by_another_write(org, hold_s=1):
        _lower(plan, max_replicas=0)
    _reconcile(str(endpoint.pk) for endpoint in endpoints)

    assert _states(made) == [READY] * 4
