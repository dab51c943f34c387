"""Replica starts an hour count the tenant's starts, not our moves: a replica placed to replace one the platform took
off its node for a reason of its own (the node drained, lost, retired or released, a sleeper that could not wake in
place) is no start of its organisation's (`Replica.moved_at`, `quota_room.replica_starts`)."""

from datetime import timedelta

import pytest
from django.utils import timezone

from billing.models import BillingAccount
from controlplane.accounts.models import Plan
from controlplane.accounts.services import SYSTEM
from endpoints import scheduler
from endpoints.fleet.services import retire_node, set_node_state
from endpoints.models import Replica
from endpoints.nodes.models import NodeLaunch
from endpoints.quota_room import replica_starts
from endpoints.replicas import drain_replica
from endpoints.scheduler import reconcile_endpoint
from gpu_agent.protocol import NodeState, ReplicaState
from tests.factories import EndpointFactory, OrganizationFactory
from tests.fleet.test_pool_failing_endpoints import ONE_REPLICA_MB
from tests.fleet.test_pool_policy import TINY, RecordingProvider, make_pool, tick
from tests.test_placement import make_node
from tests.test_replica_starts import _billed_through_stripe, called_now  # noqa: F401 (the fixture)

pytestmark = pytest.mark.django_db


def serving(endpoint) -> Replica:
    return Replica.objects.get(endpoint=endpoint, state__in=[ReplicaState.PENDING, ReplicaState.STARTING,
                                                             ReplicaState.READY])


def test_replicas_moved_off_drained_nodes_are_replaced_without_spending_the_organisations_starts():
    """Before: a replica placed to replace one on a drained node counted as a start: two drains in an hour and an
    organisation without a card (2 an hour here) had its endpoint refused, its calls a 429, for a fault of ours."""
    for _ in range(3):
        make_node(memory_mb=80_000)
    endpoint = EndpointFactory(organization=OrganizationFactory(), gpu_type="l4")
    reconcile_endpoint(str(endpoint.pk), called_now())

    for _ in range(2):
        set_node_state(SYSTEM, serving(endpoint).node, NodeState.DRAINING)
        reconcile_endpoint(str(endpoint.pk), called_now())

    endpoint.refresh_from_db()
    assert endpoint.status_message == ""
    assert serving(endpoint).state == ReplicaState.PENDING
    assert replica_starts(endpoint.organization).num_started == 1  # its own, the first


def test_a_replica_whose_node_went_silent_or_was_retired_is_replaced_without_spending_a_start():
    organization = OrganizationFactory()
    for _ in range(3):
        make_node(memory_mb=80_000)
    endpoint = EndpointFactory(organization=organization, gpu_type="l4")
    reconcile_endpoint(str(endpoint.pk), called_now())
    Replica.objects.create(endpoint=endpoint, state=ReplicaState.STOPPED)  # its second start this hour

    serving(endpoint).node.__class__.objects.filter(pk=serving(endpoint).node_id).update(
        last_heartbeat_at=timezone.now() - timedelta(hours=1))
    scheduler._sweep()
    reconcile_endpoint(str(endpoint.pk), called_now())
    retire_node(SYSTEM, serving(endpoint).node, reason="its pool released it")
    reconcile_endpoint(str(endpoint.pk), called_now())

    assert serving(endpoint).state == ReplicaState.PENDING
    assert replica_starts(organization).num_started == 2


def test_a_sleeper_that_cannot_wake_in_place_is_replaced_without_spending_a_start():
    """Before: its node cordoned while it slept, its wake fell back to a new start, refused once the hour's were
    spent: the endpoint served nothing though it had held its GPU all along."""
    organization = OrganizationFactory(plan=Plan.objects.create(name="two", max_replicas=2))  # 4 starts an hour
    account = BillingAccount.objects.for_organization(organization)
    account.payment_method_on_file = True
    account.save(update_fields=["payment_method_on_file"])
    make_node(memory_mb=80_000)
    endpoint = EndpointFactory(organization=organization, gpu_type="l4", idle_action="sleep")
    for _ in range(4):
        Replica.objects.create(endpoint=endpoint, state=ReplicaState.STOPPED)  # the hour's starts, spent
    Replica.objects.create(endpoint=endpoint, node=make_node(memory_mb=80_000, state=NodeState.CORDONED),
                           state=ReplicaState.SLEEPING, created_at=timezone.now() - timedelta(hours=2))

    reconcile_endpoint(str(endpoint.pk), called_now())

    endpoint.refresh_from_db()
    assert serving(endpoint).state == ReplicaState.PENDING
    assert endpoint.status_message == ""


def test_a_replica_the_tenant_was_letting_go_is_no_move_when_its_node_is_lost_meanwhile():
    """Its scale-down drained it (the tenant's doing): its node retired before it stopped leaves no replacement owed."""
    organization = OrganizationFactory()
    endpoint = EndpointFactory(organization=organization, gpu_type="l4")
    node = make_node(memory_mb=80_000)
    replica = Replica.objects.create(endpoint=endpoint, node=node, state=ReplicaState.READY)
    drain_replica(replica, reason="idle")

    retire_node(SYSTEM, node, reason="its pool released it")

    replica.refresh_from_db()
    assert replica.state == ReplicaState.FAILED and replica.moved_at is None
    assert replica_starts(organization).num_started == 1


def test_moves_give_back_at_most_the_hours_bound_so_a_tenant_whose_replicas_keep_losing_their_nodes_stays_bounded():
    """A tenant whose engine took its node down (or any run of bad luck) gets its moved replicas back up to its hour's
    bound again, no more: at most twice the bound an hour, never unbounded."""
    organization = OrganizationFactory()
    endpoint = EndpointFactory(organization=organization, gpu_type="l4")
    for _ in range(5):
        Replica.objects.create(endpoint=endpoint, state=ReplicaState.FAILED, moved_at=timezone.now())

    starts = replica_starts(organization)

    assert starts.num_started == 3 and starts.num_left == 0


def test_the_hours_starts_are_still_one_query_beside_the_billing_account(django_assert_num_queries):
    organization = OrganizationFactory()
    account = BillingAccount.objects.for_organization(organization)
    account.payment_method_on_file = True
    account.save(update_fields=["payment_method_on_file"])
    with django_assert_num_queries(2):  # its billing account, its replicas created or moved this hour
        replica_starts(organization)


def test_a_node_pool_launches_a_machine_for_a_replica_moved_off_a_lost_node_once_the_hours_starts_are_spent():
    """The pools' demand judges by the same count (`ReplicaRoom`): the replacement of a moved replica is demand for a
    machine even where the organisation's own starts are spent."""
    pool, provider = make_pool(gpu_memory_mb=ONE_REPLICA_MB, max_nodes=10), RecordingProvider()
    endpoint = EndpointFactory(organization=OrganizationFactory(), gpu_type="cpu", model_source=TINY, quantization="none")
    Replica.objects.create(endpoint=endpoint, state=ReplicaState.STOPPED)
    Replica.objects.create(endpoint=endpoint, state=ReplicaState.FAILED, moved_at=timezone.now())  # its node lost

    reconcile_endpoint(str(endpoint.pk), called_now())

    endpoint.refresh_from_db()
    assert endpoint.unplaced_replicas == 1
    assert tick(provider) == 1 and NodeLaunch.objects.filter(pool=pool).count() == 1
