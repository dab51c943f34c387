"""Replica starts an hour without a card are a person's, not an organisation's: the starts of the other organisations
of its people (`organizations.organizations_of_its_people`, as the allowance without a card counts their spend) that
have no card either count against its `INFERPLANE_REPLICA_STARTS_PER_HOUR_WITHOUT_CARD` (`quota_room.replica_starts`).

Before, each organisation had its own: one person with `MAX_OWNED_ORGANIZATIONS` organisations started five times the
bound an hour, each a GPU (and a pool's machine) for nothing paid."""

import threading
import time

import pytest
from django.db import connection, transaction

from billing.models import BillingAccount
from controlplane import tasks as controlplane_tasks
from controlplane.accounts.models import Membership, Role
from controlplane.accounts.services import Actor, create_organization
from endpoints import quotas
from endpoints.models import Replica
from endpoints.quota_room import replica_starts
from endpoints.scheduler import reconcile_endpoint
from gpu_agent.protocol import NodeState, ReplicaState
from tests.factories import EndpointFactory, MembershipFactory, OrganizationFactory, UserFactory
from tests.test_placement import make_node
from tests.test_replica_starts import _billed_through_stripe, called_now  # noqa: F401 (the fixture)

pytestmark = pytest.mark.django_db


def her_organizations(num: int):
    user = UserFactory()
    return [create_organization(Actor(user=user), name=f"hers {index}", owner=user) for index in range(num)]


def test_a_person_without_a_card_starts_the_hours_replicas_once_across_all_her_organisations():
    for _ in range(4):
        make_node(memory_mb=80_000)
    first, second = her_organizations(2)
    endpoints = [EndpointFactory(organization=organization, gpu_type="l4")
                 for organization in (first, first, second, second)]

    for endpoint in endpoints:
        reconcile_endpoint(str(endpoint.pk), called_now())

    assert Replica.objects.filter(endpoint__organization__in=[first, second]).count() == 2
    endpoints[2].refresh_from_db()
    assert endpoints[2].status_message == (
        "waiting for quota: replica starts an hour: an organisation without a payment method starts at most 2 "
        "replicas an hour, with the other organisations of its people; add one on the billing page to start more")


def test_her_organisation_with_a_card_starts_on_its_own_bound_and_counts_for_none_of_her_others():
    make_node(memory_mb=80_000)
    carded, cardless = her_organizations(2)
    account = BillingAccount.objects.for_organization(carded)
    account.payment_method_on_file = True
    account.save(update_fields=["payment_method_on_file"])
    for _ in range(3):
        Replica.objects.create(endpoint=EndpointFactory(organization=carded))

    assert replica_starts(cardless).num_left == 2
    assert replica_starts(carded).num_started == 3


def test_another_persons_starts_count_for_none_of_hers():
    mine, = her_organizations(1)
    Replica.objects.create(endpoint=EndpointFactory(organization=OrganizationFactory()))

    assert replica_starts(mine).num_started == 0


@pytest.mark.parametrize("num_organizations", [1, 5])
def test_her_organisations_are_read_in_the_same_few_queries_however_many_she_has(num_organizations,
                                                                                django_assert_max_num_queries):
    """Read at every placement and refusal of an organisation without a card, and by the pools' demand: never a query
    an organisation of hers."""
    organizations = her_organizations(num_organizations)
    for organization in organizations:
        Replica.objects.create(endpoint=EndpointFactory(organization=organization))
    with django_assert_max_num_queries(15):
        assert replica_starts(organizations[0]).num_started == num_organizations


def test_a_placement_reads_her_organisations_once_and_only_the_count_again_under_the_lock(django_assert_max_num_queries):
    """Before, the whole reading (15 queries) was made twice, the second under the lock, and a scale-up's second
    placement (or one after a sleeper's wake) made both while it held its GPU type's nodes, which heartbeats wait for."""
    organizations = her_organizations(5)
    for organization in organizations:
        Replica.objects.create(endpoint=EndpointFactory(organization=organization))
    endpoint = EndpointFactory(organization=organizations[0])
    with django_assert_max_num_queries(15 + 2):  # `replica_starts`, the lock, the count again
        assert quotas.start_refusal(endpoint) is not None  # her five starts, past her 2


@pytest.mark.django_db(transaction=True)
def test_two_of_her_organisations_placing_at_the_same_moment_do_not_both_pass_the_bound(settings):
    """Each placement holds its own organisation's row alone (`quotas.lock_organization`): two of hers at once each
    counted the other's start as not yet made, and a burst over her organisations started the bound in each."""
    settings.REPLICA_STARTS_PER_HOUR_WITHOUT_CARD = 1
    first, second = her_organizations(2)
    endpoints = [EndpointFactory(organization=organization, gpu_type="l4") for organization in (first, second)]

    assert _placed_at_once(endpoints) == 1 and Replica.objects.get().endpoint == endpoints[0]  # the second refused


@pytest.mark.django_db(transaction=True)
def test_an_organisation_handed_on_and_one_of_its_creators_do_not_both_pass_the_bound_placing_at_once(settings):
    """Whose bound is shared is no equivalence: handed on, an organisation counts its creator's and its new owner's
    others, each of those it alone. Before, each placed under the lowest id of its own circle: the handed-on one under
    its new owner's older organisation, her creator's other under its own, so the two, counting each other's starts,
    placed at once, each seeing the other's as not yet made."""
    settings.REPLICA_STARTS_PER_HOUR_WITHOUT_CARD = 1
    heir, maker = UserFactory(), UserFactory()
    create_organization(Actor(user=heir), name="heirs", owner=heir)  # the lowest id of the handed-on one's circle
    makers = create_organization(Actor(user=maker), name="makers", owner=maker)
    handed = create_organization(Actor(user=maker), name="handed", owner=maker)
    MembershipFactory(organization=handed, user=heir, role=Role.OWNER)
    Membership.objects.filter(organization=handed, user=maker).delete()  # handed on to the heir
    assert set(replica_starts(handed).shared_with) >= {makers.pk} and replica_starts(makers).shared_with == (handed.pk,)

    assert _placed_at_once([EndpointFactory(organization=organization, gpu_type="l4")
                            for organization in (handed, makers)]) == 1


def _placed_at_once(endpoints) -> int:
    """Each of two endpoints places one replica in a transaction of its own, the second while the first, placed, holds
    its locks; how many replicas were placed."""
    counted = threading.Event()

    def place(endpoint, *, first_in: bool) -> None:
        try:
            if not first_in:
                counted.wait(10)
            with transaction.atomic():
                quotas.lock_organization(endpoint.organization_id)
                if quotas.start_refusal(endpoint) is None:
                    Replica.objects.create(endpoint=endpoint)
                if first_in:
                    counted.set()
                    time.sleep(0.5)  # the other counts meanwhile
        finally:
            connection.close()

    threads = [threading.Thread(target=place, args=(endpoint,), kwargs={"first_in": index == 0})
               for index, endpoint in enumerate(endpoints)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return Replica.objects.filter(endpoint__in=endpoints).count()


@pytest.mark.django_db(transaction=True)
def test_her_organisation_waking_a_sleeper_it_must_replace_does_not_deadlock_with_another_of_hers_placing(monkeypatch):
    """A scale-up whose sleeper cannot wake in place locks its GPU type's nodes (`lock_nodes_to_wake`) before it counts
    its starts; another of her organisations placing meanwhile held the person's lock (`start_refusal`) and then waited
    for those nodes (`place_replica`). Before, the first waited for the person's lock holding the nodes: PostgreSQL
    found the deadlock and rolled one placement back, its call's cold start refused."""
    monkeypatch.setattr(controlplane_tasks.current_app, "send_task", lambda name, **kwargs: None)
    waking, placing = her_organizations(2)
    make_node(memory_mb=80_000)
    sleepy = EndpointFactory(organization=waking, gpu_type="l4")
    Replica.objects.create(endpoint=sleepy, node=make_node(memory_mb=80_000, state=NodeState.CORDONED),
                           state=ReplicaState.SLEEPING, gpu_indices=[0], reserved_memory_mb=1_000)
    cold = EndpointFactory(organization=placing, gpu_type="l4")
    go, real_start_refusal = threading.Event(), quotas.start_refusal

    def counted_then_paused(endpoint):
        refusal = real_start_refusal(endpoint)
        if endpoint.pk == cold.pk and not go.is_set():
            go.set()
            time.sleep(1.5)  # the person's lock held: the other scale-up locks its nodes meanwhile
        return refusal

    monkeypatch.setattr(quotas, "start_refusal", counted_then_paused)
    errors = {}

    def run(name, endpoint, *, first: bool):
        try:
            if not first:
                go.wait(10)
            reconcile_endpoint(str(endpoint.pk), called_now())
        except Exception as exc:  # noqa: BLE001
            errors[name] = repr(exc)[:300]
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=("placing", cold), kwargs={"first": True}),
               threading.Thread(target=run, args=("waking", sleepy), kwargs={"first": False})]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)

    assert go.is_set() and errors == {}
    assert Replica.objects.filter(endpoint__in=[sleepy, cold], state=ReplicaState.PENDING).count() == 2
