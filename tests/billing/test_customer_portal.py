"""The Customer Portal that owners and admins are sent to (`POST /api/v1/billing/portal/`, the billing page's
button) uses the platform's own configuration: cards, the billing email and address, and invoices, but no
cancellation, pause or change of plan. Before, it used the account's default configuration, whatever the Dashboard
said there: a cancellation at once (the portal never invoices usage at a cancellation) discarded the period's usage,
and a pause could void its invoices."""

from datetime import timedelta

import pytest
from django.utils import timezone

from billing import stripe_sync
from billing.ledger import record_usage
from billing.models import BillingAccount
from billing.rollups import rollup_usage
from tests.billing.conftest import usage_report
from tests.factories import EndpointFactory
from tests.fakes.stripe_server import PortalRefused

pytestmark = pytest.mark.django_db

PORTAL = "/api/v1/billing/portal/"


def _subscribe(organization) -> str:
    endpoint = EndpointFactory(organization=organization)
    hour = timezone.now().replace(minute=0, second=0, microsecond=0) - timedelta(hours=3)
    record_usage(usage_report(endpoint, finished_at=hour + timedelta(minutes=5)))
    rollup_usage()
    assert stripe_sync.push_pending_rollups() == 1
    return BillingAccount.objects.get(organization=organization).stripe_subscription_id


def _session(fake_stripe) -> dict:
    return list(fake_stripe.portal_sessions.values())[-1]


def _ours(fake_stripe) -> list[dict]:
    return [
        configuration
        for configuration in fake_stripe.portal_configurations.values()
        if not configuration["is_default"]
    ]


def test_the_customer_portal_offers_no_cancellation_and_its_configuration_is_made_once(
    owner_client, fake_stripe
):
    subscription_id = _subscribe(owner_client.organization)

    assert owner_client.post(PORTAL).status_code == 200
    first = _session(fake_stripe)
    assert owner_client.post(PORTAL).status_code == 200

    [configuration] = _ours(fake_stripe)
    assert {session["configuration"] for session in fake_stripe.portal_sessions.values()} == {
        configuration["id"]
    }
    features = configuration["features"]
    assert [
        features[name]["enabled"]
        for name in ("subscription_cancel", "subscription_pause", "subscription_update")
    ] == [False, False, False]
    assert features["payment_method_update"]["enabled"] and features["invoice_history"]["enabled"]
    assert len(fake_stripe.calls_to("/v1/billing_portal/configurations")) == 1
    with pytest.raises(PortalRefused):
        fake_stripe.cancel_in_portal(first["id"], subscription_id)
    assert fake_stripe.subscriptions[subscription_id]["status"] == "active"


def test_a_portal_configuration_changed_in_the_dashboard_to_cancel_at_once_is_set_back(
    owner_client, fake_stripe
):
    subscription_id = _subscribe(owner_client.organization)
    assert owner_client.post(PORTAL).status_code == 200
    [configuration] = _ours(fake_stripe)
    configuration["features"]["subscription_cancel"].update(
        enabled=True, mode="immediately"
    )  # in the Dashboard

    assert owner_client.post(PORTAL).status_code == 200

    assert (
        _ours(fake_stripe) == [configuration]
        and not configuration["features"]["subscription_cancel"]["enabled"]
    )
    with pytest.raises(PortalRefused):
        fake_stripe.cancel_in_portal(_session(fake_stripe)["id"], subscription_id)


def test_a_portal_configuration_deactivated_in_the_dashboard_is_made_active_again(owner_client, fake_stripe):
    # Looked for among the active ones only, it was created again under the same idempotency key, whose answer (the
    # inactive configuration) Stripe replays for a day: every portal session refused meanwhile (the review of this
    # stop's diff).
    _subscribe(owner_client.organization)
    assert owner_client.post(PORTAL).status_code == 200
    [configuration] = _ours(fake_stripe)
    configuration["active"] = False  # in the Dashboard

    assert owner_client.post(PORTAL).status_code == 200
    assert _ours(fake_stripe) == [configuration] and configuration["active"]
    assert _session(fake_stripe)["configuration"] == configuration["id"]
