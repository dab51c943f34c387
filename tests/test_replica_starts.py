"""Replica starts an hour: a tenant pays per token, a started replica costs its GPU (and a pool's machine) from its
start, so however it is woken (a call its client cut at once, a pause and resume, a spec change) an organisation
starts at most `INFERPLANE_REPLICA_STARTS_PER_HOUR` replicas an hour, and one without a payment method far fewer."""

import time
from datetime import timedelta

import pytest
from django.utils import timezone

from billing.models import BillingAccount
from controlplane.accounts.models import Plan
from endpoints import quotas
from endpoints.autoscaler import Load
from endpoints.models import Replica
from endpoints.nodes.models import NodeLaunch
from endpoints.scheduler import reconcile_endpoint
from gpu_agent.protocol import ReplicaState
from tests.factories import EndpointFactory, OrganizationFactory
from tests.fleet.test_pool_failing_endpoints import ONE_REPLICA_MB
from tests.fleet.test_pool_policy import TINY, RecordingProvider, make_pool, tick
from tests.test_placement import make_node

pytestmark = pytest.mark.django_db

WITHOUT_CARD = ("waiting for quota: replica starts an hour: an organisation without a payment method starts at most 2 "
                "replicas an hour; add one on the billing page to start more")


@pytest.fixture(autouse=True)
def _billed_through_stripe(settings):
    """Stripe configured (no call reaches it here): an organisation without a card is held to the lower bound."""
    settings.STRIPE_SECRET_KEY = "sk_test_inferplane"
    settings.REPLICA_STARTS_PER_HOUR = 4
    settings.REPLICA_STARTS_PER_HOUR_WITHOUT_CARD = 2


def called_now() -> Load:
    """One call waiting for the endpoint, or just left: it wants a replica for its idle timeout."""
    return Load(num_inflight=0, num_waiting=1, last_request_at=time.time(), peak_concurrency=1)


def with_card(organization):
    account = BillingAccount.objects.for_organization(organization)
    account.payment_method_on_file = True
    account.save(update_fields=["payment_method_on_file"])
    return organization


def test_an_organisation_without_a_card_starts_at_most_its_replicas_an_hour_and_its_endpoint_says_why():
    """Before: ten endpoints each woken by a call its client cut at once (unbilled) placed ten replicas, bounded by the
    replica quota alone, and again every time they scaled to zero."""
    organization = OrganizationFactory()
    for _ in range(4):
        make_node(memory_mb=80_000)
    endpoints = [EndpointFactory(organization=organization, gpu_type="l4") for _ in range(3)]

    for endpoint in endpoints:
        reconcile_endpoint(str(endpoint.pk), called_now())

    assert Replica.objects.filter(endpoint__organization=organization).count() == 2
    endpoints[2].refresh_from_db()
    assert endpoints[2].status_message == WITHOUT_CARD
    assert endpoints[2].unplaced_replicas == 0  # no machine is asked for it either


def test_a_woken_endpoint_whose_callers_left_counts_its_start_when_it_scales_to_zero_and_wakes_again():
    """Before: wake, walk away, let it scale to zero, wake again: a replica (a machine) each time, for nothing."""
    organization = OrganizationFactory()
    make_node(memory_mb=80_000)
    endpoint = EndpointFactory(organization=organization, gpu_type="l4")
    for _ in range(3):
        reconcile_endpoint(str(endpoint.pk), called_now())
        Replica.objects.filter(endpoint=endpoint).update(state=ReplicaState.STOPPED)  # scaled to zero since

    assert Replica.objects.filter(endpoint=endpoint).count() == 2
    endpoint.refresh_from_db()
    assert endpoint.status_message == WITHOUT_CARD


def test_pause_and_resume_in_a_loop_starts_no_more_replicas_than_the_hour_allows(owner_client, org):
    make_node(memory_mb=80_000)
    endpoint = EndpointFactory(organization=org, gpu_type="l4")
    for _ in range(4):
        assert owner_client.post(f"/api/v1/endpoints/{endpoint.pk}/pause/").status_code == 200
        assert owner_client.post(f"/api/v1/endpoints/{endpoint.pk}/resume/").status_code == 200
        reconcile_endpoint(str(endpoint.pk), called_now())  # the reconcile the resume asked for

    assert Replica.objects.filter(endpoint=endpoint).count() == 2
    endpoint.refresh_from_db()
    assert endpoint.status_message == WITHOUT_CARD


def test_a_card_raises_the_bound_and_another_organisation_is_not_held_back_by_it():
    for _ in range(6):
        make_node(memory_mb=80_000)
    # a plan of 2 replicas at once, each scaled to zero after its start: the bound (4) is above twice the plan's, so
    # the hour's bound is what refuses the fifth
    carded = with_card(OrganizationFactory(plan=Plan.objects.create(name="narrow", max_replicas=2)))
    for _ in range(5):
        reconcile_endpoint(str(EndpointFactory(organization=carded, gpu_type="l4").pk), called_now())
        Replica.objects.filter(endpoint__organization=carded).update(state=ReplicaState.STOPPED)
    other = EndpointFactory(gpu_type="l4")
    reconcile_endpoint(str(other.pk), called_now())

    assert Replica.objects.filter(endpoint__organization=carded).count() == 4
    assert Replica.objects.filter(endpoint=other).count() == 1
    assert (carded.endpoints.exclude(replicas__isnull=False).get().status_message
            == "waiting for quota: replica starts an hour: your organisation starts at most 4 replicas an hour")


def test_a_start_more_than_an_hour_old_no_longer_counts():
    organization = OrganizationFactory()
    make_node(memory_mb=80_000)
    endpoint = EndpointFactory(organization=organization, gpu_type="l4")
    for _ in range(2):
        Replica.objects.create(endpoint=endpoint, state=ReplicaState.STOPPED,
                               created_at=timezone.now() - timedelta(minutes=61))

    reconcile_endpoint(str(endpoint.pk), called_now())

    assert Replica.objects.filter(endpoint=endpoint, state=ReplicaState.PENDING).count() == 1


def test_waking_a_sleeping_replica_is_not_a_start():
    organization = OrganizationFactory()
    node = make_node(memory_mb=80_000)
    endpoint = EndpointFactory(organization=organization, gpu_type="l4", idle_action="sleep")
    for _ in range(2):
        Replica.objects.create(endpoint=endpoint, node=node, state=ReplicaState.STOPPED)
    asleep = Replica.objects.create(endpoint=endpoint, node=node, state=ReplicaState.SLEEPING,
                                    created_at=timezone.now() - timedelta(hours=2))

    reconcile_endpoint(str(endpoint.pk), called_now())

    asleep.refresh_from_db()
    assert asleep.state == ReplicaState.STARTING  # woken: it held its GPU already


def test_a_node_pool_launches_no_more_machines_for_an_organisations_wakes_than_it_may_start():
    """Before: five endpoints woken at once, each with a call cut at once, launched five machines (the replica quota,
    8, the only bound), each paid for from its launch to its release."""
    pool, provider = make_pool(gpu_memory_mb=ONE_REPLICA_MB, max_nodes=10), RecordingProvider()
    organization = OrganizationFactory()
    started = EndpointFactory(organization=organization, gpu_type="cpu", model_source=TINY, quantization="none")
    Replica.objects.create(endpoint=started, state=ReplicaState.STOPPED)  # one start of two this hour spent already
    for _ in range(5):
        endpoint = EndpointFactory(organization=organization, gpu_type="cpu", model_source=TINY, quantization="none")
        reconcile_endpoint(str(endpoint.pk), called_now())

    assert tick(provider) == 1
    assert NodeLaunch.objects.filter(pool=pool).count() == 1


def test_an_organisation_whose_calls_are_stopped_for_an_unpaid_invoice_starts_no_replica_for_its_warm_floor():
    """Before: every call of an organisation on hold was a 402, yet its endpoints' warm floors (and a resume, a
    batch's deadline) still started replicas, each a GPU, and a machine, that could serve nothing."""
    organization = with_card(OrganizationFactory())
    BillingAccount.objects.filter(organization=organization).update(past_due_since=timezone.now(), hold_reason="past_due")
    make_node(memory_mb=80_000)
    endpoint = EndpointFactory(organization=organization, gpu_type="l4", min_replicas=1)

    reconcile_endpoint(str(endpoint.pk), called_now())

    assert not Replica.objects.filter(endpoint=endpoint).exists()
    endpoint.refresh_from_db()
    assert endpoint.status_message.startswith(
        "waiting for quota: replica starts an hour: your organisation's calls are stopped for an unpaid invoice")
    assert endpoint.unplaced_replicas == 0


def test_the_quotas_api_shows_the_replicas_started_in_the_last_hour_beside_the_bound(owner_client, org):
    endpoint = EndpointFactory(organization=org, gpu_type="l4")
    Replica.objects.create(endpoint=endpoint, state=ReplicaState.STOPPED)

    rows = {row["quota"]: row for row in owner_client.get("/api/v1/quotas/").json()["quotas"]}

    assert rows["replica_starts_per_hour"]["used"] == 1 and rows["replica_starts_per_hour"]["limit"] == 2
    assert rows["replica_starts_per_hour"]["label"] == "Replicas started in the last hour (without a payment method)"


def test_the_replica_quota_checked_before_each_wake_or_placement_does_not_count_the_hours_starts(django_assert_num_queries):
    """`replica_refusal` runs before every replica a scale-up wakes or places, under its organisation's lock; the starts
    are judged once, before a placement (`start_refusal`). Before, it counted them too and threw the count away: two
    more queries a replica, a woken one (no start) too."""
    endpoint = EndpointFactory(organization=OrganizationFactory(), gpu_type="l4")
    with django_assert_num_queries(2):  # the replicas held, the GPUs held
        assert quotas.replica_refusal(endpoint) is None


def test_an_organisation_whose_plan_allows_more_replicas_than_the_hours_bound_scales_out_from_zero_within_the_hour():
    """Before: a plan of 5 replicas at once under a bound of 4 starts an hour could never hold its 5 from zero within
    the hour; the bound is now at least twice the replica quota (each replica started, and replaced once)."""
    for _ in range(5):
        make_node(memory_mb=80_000)
    carded = with_card(OrganizationFactory(plan=Plan.objects.create(name="wide", max_replicas=5)))
    endpoints = [EndpointFactory(organization=carded, gpu_type="l4") for _ in range(5)]

    for endpoint in endpoints:
        reconcile_endpoint(str(endpoint.pk), called_now())

    assert Replica.objects.filter(endpoint__organization=carded).count() == 5
    assert quotas.replica_starts(carded).limit == 10
