"""How long a call keeps its replicas idle when its organisation has no payment method: at most
`INFERPLANE_IDLE_TIMEOUT_WITHOUT_CARD_S`, whatever its endpoints' `idle_timeout_s` and keep-warm say. A tenant pays
per token; an idle replica costs its GPU (and a pool's machine) for as long as it stays."""

import time
from datetime import timedelta

import pytest
from django.utils import timezone

from billing.models import BillingAccount
from endpoints.autoscaler import Load, floor
from endpoints.models import Replica
from endpoints.quota_room import idle_caps
from endpoints.scheduler import endpoints_to_reconcile, reconcile_endpoint
from gpu_agent.protocol import ReplicaState
from tests.factories import EndpointFactory, OrganizationFactory
from tests.test_placement import make_node
from tests.test_sleep_mode import sleeping_endpoint

pytestmark = pytest.mark.django_db

A_DAY_S = 86_400


@pytest.fixture(autouse=True)
def _billed_through_stripe(settings):
    """Stripe configured (no call reaches it here): an organisation without a card is held to the cap."""
    settings.STRIPE_SECRET_KEY = "sk_test_inferplane"
    settings.IDLE_TIMEOUT_WITHOUT_CARD_S = 300


def serving_for_a_day(organization) -> Replica:
    """A READY replica of an endpoint that keeps it a day after a call and after its cold start (when it was called)."""
    endpoint = EndpointFactory(organization=organization, gpu_type="l4", idle_timeout_s=A_DAY_S,
                               keep_warm_after_cold_start_s=A_DAY_S,
                               last_cold_start_at=timezone.now() - timedelta(seconds=301))
    return Replica.objects.create(endpoint=endpoint, node=make_node(memory_mb=80_000), state=ReplicaState.READY,
                                  ready_at=timezone.now())


def last_call_ago(seconds: float) -> Load:
    return Load(num_inflight=0, num_waiting=0, last_request_at=time.time() - seconds, peak_concurrency=0)


def test_a_replica_an_organisation_without_a_card_woke_goes_at_the_cap_not_its_endpoints_day():
    """Before: one call, cut at once and unbilled, kept the replica it woke (and its machine) a whole day."""
    replica = serving_for_a_day(OrganizationFactory())

    reconcile_endpoint(str(replica.endpoint_id), last_call_ago(301))

    replica.refresh_from_db()
    assert replica.state == ReplicaState.DRAINING
    assert replica.endpoint.events.filter(
        message__contains="idle for 301 s (timeout 300 s, the most without a payment method)").exists()


def test_an_organisation_with_a_card_keeps_its_endpoints_own_idle_timeout():
    organization = OrganizationFactory()
    account = BillingAccount.objects.for_organization(organization)
    account.payment_method_on_file = True
    account.save(update_fields=["payment_method_on_file"])
    replica = serving_for_a_day(organization)

    reconcile_endpoint(str(replica.endpoint_id), last_call_ago(301))

    replica.refresh_from_db()
    assert replica.state == ReplicaState.READY


def test_the_tick_lets_it_go_at_the_cap_itself_not_a_tick_later():
    replica = serving_for_a_day(OrganizationFactory())
    endpoint_id = str(replica.endpoint_id)
    now = time.time()
    deadlines = {}

    endpoints_to_reconcile([endpoint_id], {endpoint_id: Load(0, 0, now - 299.5, 0)}, idle_deadlines=deadlines, now=now)

    assert deadlines == {endpoint_id: pytest.approx(now + 0.5, abs=0.01)}


def test_an_organisation_without_a_card_keeps_no_replica_asleep_past_the_cap_as_a_sleeper_holds_its_gpu(settings):
    """An endpoint that sleeps its idle replicas (`idle_action: sleep`) kept one asleep, its GPU and machine held,
    `INFERPLANE_SLEEP_STOP_AFTER_S` (30 minutes) after the cap; a call, even cut at once, woke it for free (a wake is
    no start) and kept it so again: one cut call every half hour held a GPU for ever. Past the cap it stops."""
    settings.SLEEP_MODE = True
    settings.SLEEP_STOP_AFTER_S = 1800
    endpoint, _, replica = sleeping_endpoint(organization=OrganizationFactory())

    reconcile_endpoint(str(endpoint.pk), last_call_ago(301))

    replica.refresh_from_db()
    assert replica.state == ReplicaState.DRAINING
    asleep = Replica.objects.create(endpoint=endpoint, node=replica.node, state=ReplicaState.SLEEPING,
                                    state_changed_at=timezone.now())  # asleep from before, or a card since removed
    reconcile_endpoint(str(endpoint.pk), last_call_ago(400))
    asleep.refresh_from_db()
    assert asleep.state in (ReplicaState.DRAINING, ReplicaState.STOPPED)


def test_an_organisation_with_a_card_still_sleeps_its_idle_replicas(settings):
    settings.SLEEP_MODE = True
    organization = OrganizationFactory()
    account = BillingAccount.objects.for_organization(organization)
    account.payment_method_on_file = True
    account.save(update_fields=["payment_method_on_file"])
    endpoint, _, replica = sleeping_endpoint(organization=organization)

    reconcile_endpoint(str(endpoint.pk), last_call_ago(301))

    replica.refresh_from_db()
    assert replica.state == ReplicaState.SLEEPING


def test_an_organisation_without_a_card_keeps_no_warm_floor_of_min_replicas_or_pre_warm_windows():
    """Before: `min_replicas: 2` kept two GPUs (and their pools' machines) for ever, without a call, for an organisation
    that may never pay. Its floor applies once it has a card."""
    replica = serving_for_a_day(OrganizationFactory())
    endpoint = replica.endpoint
    endpoint.min_replicas = 1
    endpoint.prewarm_windows = [{"schedule": "* * * * *", "timezone": "UTC", "duration_minutes": 60, "min_replicas": 1}]
    endpoint.save(update_fields=["min_replicas", "prewarm_windows"])

    reconcile_endpoint(str(endpoint.pk), last_call_ago(301))

    replica.refresh_from_db()
    assert replica.state == ReplicaState.DRAINING
    assert endpoint.events.filter(message__contains="its warm floor (min_replicas, pre-warm windows) needs a payment "
                                                    "method").exists()

    account = BillingAccount.objects.for_organization(endpoint.organization)
    account.payment_method_on_file = True
    account.save(update_fields=["payment_method_on_file"])
    assert floor(endpoint, time.time(), idle_cap_s=idle_caps([endpoint.organization_id]).get(
        endpoint.organization_id, 0)).replicas == 1
