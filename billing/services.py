"""Writes with side effects for billing settings: accounts, spend caps, billing mode."""

from __future__ import annotations

from decimal import Decimal

from django.db import transaction

from billing.models import ApiKeySpendCap, BillingAccount, BillingMode
from billing.quota.counters import refresh_key_limit, refresh_limits
from controlplane.accounts.services import Actor, record_audit


def set_spend_cap(actor: Actor, organization, *, spend_cap: Decimal | None) -> BillingAccount:
    """Set (or with None remove) the organisation's monthly hard cap; the gateway sees it at once."""
    with transaction.atomic():
        account = BillingAccount.objects.select_for_update().for_organization(organization)
        previous = account.spend_cap
        account.spend_cap = spend_cap
        account.save(update_fields=["spend_cap"])
        record_audit(actor, organization, "billing.set_spend_cap", account,
                     spend_cap=_plain(spend_cap), previous=_plain(previous))
    refresh_limits(account)
    return account


def set_key_spend_cap(actor: Actor, api_key, *, spend_cap: Decimal | None) -> ApiKeySpendCap | None:
    with transaction.atomic():
        if spend_cap is None:
            ApiKeySpendCap.objects.filter(api_key=api_key).delete()
            cap = None
        else:
            cap, _ = ApiKeySpendCap.objects.update_or_create(api_key=api_key, defaults={"spend_cap": spend_cap})
        record_audit(actor, api_key.organization, "billing.set_key_spend_cap", api_key, spend_cap=_plain(spend_cap))
    refresh_limits(BillingAccount.objects.for_organization(api_key.organization_id))
    refresh_key_limit(api_key.organization_id, api_key.pk, spend_cap)
    return cap


def set_billing_mode(actor: Actor, organization, *, mode: str) -> BillingAccount:
    """Switch between prepaid credit and monthly invoices, from the next usage row written.

    NOTE: each usage row takes the mode of its organisation in the statement that writes it
    (`billing.ledger`), and this update holds the account's row lock until it commits: every row is
    in exactly one billing path, prepaid rows drawing credit, postpaid rows metered to Stripe.
    """
    if mode not in BillingMode.values:
        raise ValueError(f"mode must be one of {BillingMode.values}")
    with transaction.atomic():
        account = BillingAccount.objects.select_for_update().for_organization(organization)
        previous = account.mode
        account.mode = mode
        account.save(update_fields=["mode"])
        record_audit(actor, organization, "billing.set_mode", account, mode=mode, previous=previous)
    refresh_limits(account)
    return account


def _plain(value: Decimal | None) -> str | None:
    return None if value is None else str(value)
