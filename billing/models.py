"""Billing state: the usage ledger, hourly rollups, spend caps, credits, alerts and the Stripe mirror.

Money is `Decimal` everywhere. Ledger and rollup costs are kept to the nano-dollar (9 places),
which is also the unit of the Redis counters in `billing.quota`.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime, timedelta
from decimal import ROUND_HALF_EVEN, Decimal
from typing import NamedTuple

from django.conf import settings
from django.contrib.postgres.indexes import BrinIndex
from django.db import models
from django.utils import timezone

MONEY_PLACES = 9
MONEY_QUANTUM = Decimal(1).scaleb(-MONEY_PLACES)  # one nano-dollar
MICRO_DOLLARS_PER_DOLLAR = 1_000_000


def MoneyField(**kwargs):  # noqa: N802 - reads like a field class
    return models.DecimalField(max_digits=20, decimal_places=MONEY_PLACES, **kwargs)


class UsageStatus(models.TextChoices):
    OK = "ok", "OK"
    CLIENT_ABORTED = "client_aborted", "Client aborted"
    UPSTREAM_ERROR = "upstream_error", "Upstream error"
    CUT_OFF = "cut_off", "Stopped at its reserved cost"
    # Its gateway was lost mid-call (killed, OOM): billed by the sweeper for its last progress (`billing.quota.sweeper`).
    GATEWAY_LOST = "gateway_lost", "Cut: its gateway was lost"


class BillingMode(models.TextChoices):
    POSTPAID = "postpaid", "Invoiced monthly"
    PREPAID = "prepaid", "Prepaid credits"


# The audit action of a switch of billing mode (`billing.services.set_billing_mode`): its details' `previous` is the
# mode before it, which `billing.ledger` reads for a journal's report that does not say the mode of its admission.
SET_MODE_AUDIT_ACTION = "billing.set_mode"


class UsageRecord(models.Model):
    """One inference request, written exactly once (keyed by the gateway's request id)."""

    request_id = models.CharField(max_length=128)
    # NOTE: no index of their own: `usage_org_finished` and `usage_key_finished` (Meta) lead with them and serve
    # every look-up by organisation or key, a key's deletion (SET_NULL) and an organisation's PROTECT check; a
    # single-column copy was one more B-tree insert per usage row, the ledger's hottest write.
    organization = models.ForeignKey("controlplane.Organization", on_delete=models.PROTECT, related_name="+",
                                     db_index=False)
    api_key = models.ForeignKey("controlplane.ApiKey", on_delete=models.SET_NULL, null=True, blank=True, related_name="+",
                                db_index=False)
    endpoint = models.ForeignKey("endpoints.Endpoint", on_delete=models.PROTECT, related_name="+")
    replica_id = models.CharField(max_length=64, blank=True)
    prompt_tokens = models.PositiveIntegerField()
    cached_tokens = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField()
    # Computed once, at write time, from the endpoint's prices then (never above what was reserved).
    cost = MoneyField()
    # The organisation's billing mode when the row was written: prepaid rows draw credit, postpaid
    # rows go to Stripe, never both (a switch of mode is exact at this row).
    billing_mode = models.CharField(max_length=16, choices=BillingMode.choices, default=BillingMode.POSTPAID)
    started_at = models.DateTimeField()
    first_token_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField()
    status = models.CharField(max_length=16, choices=UsageStatus.choices)
    cold_start_s = models.FloatField(default=0.0)  # measured, never billed
    # The cold start this request waited for, held to first token, and its split by phase
    # (`endpoints.gateway.anatomy.PHASES` → ms); null for a request that found a replica READY.
    cold_start_ms = models.PositiveIntegerField(null=True, blank=True)
    cold_start_phases = models.JSONField(null=True, blank=True)
    # The batch a line of which this request was ("" for an interactive call): priced at the
    # endpoint's batch price (`Endpoint.batch_price_fraction` of its prices).
    batch_id = models.CharField(max_length=40, blank=True, default="", db_default="")
    # The LoRA adapter the call named (`"<endpoint>:<adapter>"`), "" for the base model.
    adapter = models.CharField(max_length=63, blank=True, default="", db_default="")
    # When the row reached the ledger: rollups find late rows by it.
    recorded_at = models.DateTimeField(default=timezone.now)
    # The cost the row had as the sweeper's `gateway_lost` row, for one the call's own row superseded since
    # (`billing.ledger.supersede_lost_rows`): counted already, so the supersede's count adds the difference, and a
    # replay finishes the count of one killed between its commit and its count (`billing.quota.replayed`).
    lost_cost = MoneyField(null=True, blank=True)
    # When the sweeper's row reached the ledger, for one superseded since: its `lost_cost` was drawn from credit as of
    # then, the difference as of `recorded_at` (the supersede's: `billing.ledger.undrawn_prepaid_usage`). None for a
    # row not superseded, or superseded before the column existed (its `lost_cost` long drawn).
    lost_recorded_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["request_id"], name="usage_record_unique_request_id")]
        indexes = [
            models.Index(fields=["organization", "finished_at"], name="usage_org_finished"),
            models.Index(fields=["organization", "endpoint", "finished_at"], name="usage_org_endpoint_finished"),
            models.Index(fields=["api_key", "finished_at"], name="usage_key_finished"),
            # NOTE: append-only and time-ordered, so a BRIN index finds recent rows for almost nothing.
            BrinIndex(fields=["recorded_at"], name="usage_recorded_brin"),
            # The credit draw's read (`billing.ledger.undrawn_prepaid_usage`): the sum of an organisation's prepaid
            # cost from this index alone (an index-only scan of its own prepaid rows, `cost` included), and its rows
            # recorded since the last draw by a range of it. NOTE: before, the sum was a sequential scan of the whole
            # ledger, every organisation's rows, at every draw (bench/explain_credit_draw.py). Partial: postpaid rows,
            # most of the ledger's writes, pay no insert into it.
            models.Index(fields=["organization", "recorded_at"], include=["cost"], name="usage_org_prepaid_recorded",
                         condition=models.Q(billing_mode=BillingMode.PREPAID)),
            # The overcharges in an organisation's prepaid ledger (cheaper supersedes: `lost_cost` above `cost`), summed
            # by the credit draw to give back those not given back yet (`billing.ledger.undrawn_prepaid_usage`): from
            # this index alone. Partial: rows superseded by a cheaper one are few.
            models.Index(fields=["organization"], include=["cost", "lost_cost"], name="usage_org_prepaid_overcharged",
                         condition=models.Q(billing_mode=BillingMode.PREPAID, lost_recorded_at__isnull=False,
                                            lost_cost__gt=models.F("cost"))),
            # An ended batch's billed lines (`endpoints.batches.services._billed_unstored`): its own rows, and no clock
            # window. Partial: interactive calls ("" here), most of the ledger's writes, pay no insert into it.
            # NOTE: before, the read took the organisation's rows from an hour before the batch started, which trusted
            # two machines' clocks (the worker that started the batch, the process that wrote the row) to within the
            # hour, and read every row of the organisation in that range.
            models.Index(fields=["organization", "batch_id"], name="usage_org_batch", condition=~models.Q(batch_id="")),
        ]

    def __str__(self) -> str:
        return self.request_id


class RollupKind(models.TextChoices):
    HOURLY = "hourly", "Hourly total"
    ADJUSTMENT = "adjustment", "Late usage for a closed hour"


class UsageRollupQuerySet(models.QuerySet):
    def for_org(self, organization):
        return self.filter(organization=organization)

    def pushable(self):
        """Closed postpaid rollups not yet in Stripe (prepaid usage is paid from credit, never metered)."""
        return self.filter(closed_at__isnull=False, pushed_at__isnull=True, billing_mode=BillingMode.POSTPAID)


_PUSH_UID_NAMESPACE = uuid.UUID("5b2c1a9e-3f0d-4c57-9b1e-7d0f2e6a8c41")  # `UsageRollup.push_uid_of`'s, fixed for ever


class UsageRollup(models.Model):
    """Usage of one organisation on one endpoint in one hour, in one billing mode.

    Sequence 0 is the hour's total while it is open. Once closed it never changes: usage that
    arrives later for that hour becomes an ADJUSTMENT with the next sequence, visible and pushed
    on its own. The sum over sequences always equals the ledger.
    """

    organization = models.ForeignKey("controlplane.Organization", on_delete=models.PROTECT, related_name="+")
    endpoint = models.ForeignKey("endpoints.Endpoint", on_delete=models.PROTECT, related_name="+")
    hour_start = models.DateTimeField()
    billing_mode = models.CharField(max_length=16, choices=BillingMode.choices, default=BillingMode.POSTPAID)
    sequence = models.PositiveIntegerField(default=0)
    kind = models.CharField(max_length=16, choices=RollupKind.choices, default=RollupKind.HOURLY)
    # NOTE: signed: an ADJUSTMENT carries the whole difference, and a superseding row (`billing.ledger`) may lower a
    # field of a closed hour while it raises another (a lost row's progress priced a prefix-cached prompt at the full
    # input price; the call's own row, replayed late, says it was cached: less input and cost, more cached tokens).
    num_requests = models.BigIntegerField(default=0)
    prompt_tokens = models.BigIntegerField(default=0)
    cached_tokens = models.BigIntegerField(default=0)
    completion_tokens = models.BigIntegerField(default=0)
    cost = MoneyField(default=Decimal(0))
    computed_at = models.DateTimeField(default=timezone.now)
    closed_at = models.DateTimeField(null=True, blank=True)
    # Stripe push: a worker claims the row (push_claimed_at) and marks it pushed when every meter event is in.
    push_claimed_at = models.DateTimeField(null=True, blank=True)
    pushed_at = models.DateTimeField(null=True, blank=True)
    push_error = models.CharField(max_length=300, blank=True)
    # Part of its meter events' idempotency keys, raised after each Stripe server error (`stripe_sync.IdempotencyKey`).
    push_key_generation = models.PositiveIntegerField(default=0, db_default=0)
    # When a meter event of it was first sent to Stripe, and when its push was held for an operator: an event not yet
    # confirmed whose first try is older than Stripe's duplicate window (`stripe_sync.IDENTIFIER_TRUSTED_FOR`).
    push_first_tried_at = models.DateTimeField(null=True, blank=True)
    push_held_at = models.DateTimeField(null=True, blank=True)
    # Push runs failed for an ended subscription's invoice line whose price cannot be told: held for an operator at
    # `stripe_sync.UNKNOWN_LINES_HOLD_AFTER` (before, it failed every run for ever).
    num_unknown_lines_failures = models.PositiveIntegerField(default=0, db_default=0)
    # What its meter events' `identifier`s are made of (`stripe_sync.meter_event_identifier`): what the rollup is
    # (`push_uid_of`: its endpoint, a random UUID, its hour, billing mode and sequence), never the row's id, which
    # PostgreSQL hands out again after a point-in-time restore or a failover to a replica that was behind (another
    # rollup's events were then refused as duplicates and never billed); and not random either, since a rollup pushed
    # after the point the database went back to is made again from the usage that is still there, and its events,
    # new to Stripe, billed the hour twice. Null only for rollups made before it (`billing/0016`), whose events keep
    # the identifiers made of their id.
    push_uid = models.UUIDField(null=True, blank=True, unique=True, default=uuid.uuid4, editable=False)
    # Part of its meter events' `identifier`s from 1 on: raised when the Stripe customer its events went to was deleted
    # before invoicing them (`billing.services.push_again`), so that they go again, to the next customer, as new
    # events (Stripe would drop a known identifier as a duplicate).
    push_generation = models.PositiveIntegerField(default=0, db_default=0)
    # A held duplicate's "send the difference" begun (`stripe_sync.send_held_difference`): when its first run claimed
    # it, committed before any of its events was sent, and what that run sends (Stripe's values as entered, the
    # customer, the events' date), fixed for every run after it. Cleared when the rollup is marked pushed.
    difference_started_at = models.DateTimeField(null=True, blank=True)
    difference_pending = models.JSONField(null=True, blank=True)

    objects = UsageRollupQuerySet.as_manager()

    @staticmethod
    def push_uid_of(endpoint_id, hour_start, billing_mode: str, sequence: int) -> uuid.UUID:
        """The `push_uid` of the rollup of `endpoint_id`'s hour `hour_start` in `billing_mode` with `sequence`: the
        same whenever that rollup is made (the endpoint's id is a random UUID: another installation's never match)."""
        return uuid.uuid5(_PUSH_UID_NAMESPACE, f"{endpoint_id}/{hour_start.timestamp():.0f}/{billing_mode}/{sequence}")

    class Meta:
        ordering = ["hour_start", "sequence"]
        constraints = [
            models.UniqueConstraint(fields=["organization", "endpoint", "hour_start", "billing_mode", "sequence"],
                                    name="rollup_unique_hour_mode_sequence"),
        ]
        indexes = [
            models.Index(fields=["closed_at", "pushed_at"], name="rollup_push_queue"),
            models.Index(fields=["organization", "hour_start"], name="rollup_org_hour"),
            # The few held for an operator, counted every minute (`billing.held_rollups`) and listed in the admin.
            models.Index(fields=["push_held_at"], name="rollup_held", condition=models.Q(push_held_at__isnull=False)),
        ]

    def __str__(self) -> str:
        return f"{self.organization_id}/{self.endpoint_id}@{self.hour_start:%Y-%m-%dT%H}/{self.billing_mode}#{self.sequence}"

    @property
    def input_tokens(self) -> int:
        """Prompt tokens billed at the full input rate."""
        return self.prompt_tokens - self.cached_tokens

    @property
    def cost_micro_dollars(self) -> int:
        """The cost in whole micro-dollars, as Stripe's cost meter counts it.

        Rounded half to even, once per rollup: a rollup is off by at most half a micro-dollar and
        the errors do not drift one way, so an organisation's billed total is within
        0.5 micro-dollar × its number of rollups of the ledger (under $0.0004 for a month of hours).
        """
        return int((self.cost * MICRO_DOLLARS_PER_DOLLAR).quantize(Decimal(1), rounding=ROUND_HALF_EVEN))


class RollupCursor(models.Model):
    """Where the last rollup run started reading the ledger (a single row)."""

    id = models.PositiveSmallIntegerField(primary_key=True, default=1)
    recorded_since = models.DateTimeField(null=True, blank=True)
    last_run_at = models.DateTimeField(null=True, blank=True)


class BillingAccountQuerySet(models.QuerySet):
    def for_organization(self, organization) -> BillingAccount:
        """The account of `organization` (an Organization or its id), created on first use with the
        platform's default cap. On a `select_for_update()` queryset it comes back locked."""
        organization_id = getattr(organization, "pk", organization)
        account = self.filter(organization_id=organization_id).first()
        if account is not None:
            return account
        default_cap = settings.DEFAULT_MONTHLY_SPEND_CAP
        account, _ = self.get_or_create(
            organization_id=organization_id, defaults={"spend_cap": default_cap if default_cap > 0 else None}
        )
        return account


class BillingAccount(models.Model):
    """An organisation's billing settings and its Stripe customer (created when first needed:
    `BillingAccount.objects.for_organization`)."""

    organization = models.OneToOneField("controlplane.Organization", on_delete=models.CASCADE, related_name="billing_account")
    mode = models.CharField(max_length=16, choices=BillingMode.choices, default=BillingMode.POSTPAID)
    # Monthly hard cap on spend; null means none.
    spend_cap = MoneyField(null=True, blank=True)
    stripe_customer_id = models.CharField(max_length=64, blank=True)
    stripe_subscription_id = models.CharField(max_length=64, blank=True)
    # When that subscription's time began (its `start_date`): usage of an earlier hour pushed to it is dated from
    # here (`stripe_sync.push_rollup`). None for one stored before this was kept.
    stripe_subscription_started_at = models.DateTimeField(null=True, blank=True)
    # When a run began cancelling that subscription after its organisation's close (PostgreSQL's clock:
    # `billing.closed_subscriptions`); pushes leave the organisation's rollups until it is forgotten
    # (`services.record_subscription_ended` clears both) or the run finds usage still to push. None: no run is ending it.
    subscription_ending_at = models.DateTimeField(null=True, blank=True)
    # How much of the prepaid usage in the ledger has been drawn from credit grants (see billing.credits).
    credit_drawn = MoneyField(default=Decimal(0))
    # How much of the prepaid ledger's overcharges (cheaper supersedes: `lost_cost` less `cost`) the draws have given
    # back, the ledger's others drawn (`credit_drawn`, their net): the draw gives back those made since and draws the
    # usage made since, each apart (`ledger.undrawn_prepaid_usage`). None: not kept yet (drawn by code from before
    # billing/0037); the next draw sets it.
    credit_given_back = MoneyField(null=True, blank=True)
    # Prepaid usage drawn as nothing (no grant could pay it: `credit_shares`) and not offset since by an overcharge given
    # back: an overcharge is offset against it before any goes back to a grant (`credit_draw`).
    credit_unpaid = MoneyField(default=Decimal(0), db_default=Decimal(0))
    # Its prepaid usage changed and has not been drawn since: set with the rollups, cleared by the draw.
    credit_draw_due = models.BooleanField(default=False, db_default=False)
    # When credit was last drawn, on the database's clock (the transaction's `now()`; the worker's, before): the usage
    # not drawn yet was recorded after it, less `ledger.RECORDED_AT_MARGIN` (`ledger.undrawn_prepaid_usage`). None: never.
    credit_drawn_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    # Payment standing (`billing.standing`): whether the Stripe customer has a default payment method, as
    # read from Stripe at `payment_method_observed_ms` (Unix ms; 0: never read); staff may let an
    # organisation that pays by bank transfer spend without one.
    # NOTE: database defaults too: code of the previous version, during a deploy, writes rows without them.
    payment_method_on_file = models.BooleanField(default=False, db_default=False)
    payment_method_observed_ms = models.BigIntegerField(default=0, db_default=0)
    # The fingerprint Stripe gives the card of that default payment method (the same card number has the same one in
    # every customer and payment method), read with it; a bank debit's account's as `<type>:<fingerprint>`
    # (`billing.standing.card_fingerprint`); empty: none (no method, or one Stripe gives none: Link), or not read since
    # this was kept. Organisations with the same one share one spending ceiling (`billing.standing.spend_ceiling`).
    card_fingerprint = models.CharField(max_length=64, blank=True, default="", db_default="")
    invoiced_without_card = models.BooleanField(
        default=False, db_default=False, help_text="Staff: this organisation pays its invoices without a card on file (bank transfer); "
                                 "it is not held to the limit of accounts without a payment method.")
    # Since when an unpaid invoice or a disputed payment has stopped inference (None: in good standing), and which
    # (`hold_reason`, the gateway's refusal reason: `past_due` or `disputed`; empty on a hold kept before it was
    # stored, which is `past_due`).
    past_due_since = models.DateTimeField(null=True, blank=True)
    hold_reason = models.CharField(max_length=16, blank=True, default="", db_default="")
    # Staff's spending ceiling of the organisation in place of the one its paid history gives
    # (`billing.standing.spend_ceiling`): an amount, or `staff_lifted_spend_ceiling` for none; neither: its history's.
    staff_spend_ceiling = MoneyField(null=True, blank=True)
    staff_lifted_spend_ceiling = models.BooleanField(default=False, db_default=False)
    # The ceiling the upgrade gave an organisation already spending past its paid history's (`billing/0032`): a floor,
    # not staff's; its paid history's applies once higher (`billing.standing.spend_ceiling`).
    grandfathered_spend_ceiling = MoneyField(null=True, blank=True)
    # A change of its limits has not reached Redis yet (set with the change, cleared by the refresh).
    limits_stale = models.BooleanField(default=False, db_default=False)
    # Part of the idempotency keys that create its customer and subscription, raised after a Stripe server
    # error and when Stripe ends either (`stripe_sync.IdempotencyKey`): a new one never replays the old.
    stripe_key_generation = models.PositiveIntegerField(default=0, db_default=0)

    objects = BillingAccountQuerySet.as_manager()

    class Meta:
        constraints = [
            models.CheckConstraint(condition=~models.Q(staff_lifted_spend_ceiling=True, staff_spend_ceiling__isnull=False),
                                   name="staff_spend_ceiling_amount_or_lifted"),
        ]
        indexes = [
            models.Index(fields=["card_fingerprint"], name="billing_account_card",
                         condition=~models.Q(card_fingerprint="")),
        ]

    def __str__(self) -> str:
        return f"billing of {self.organization_id}"

    @property
    def is_prepaid(self) -> bool:
        return self.mode == BillingMode.PREPAID


class CardHolding(models.Model):
    """An organisation had the card of `fingerprint` (`BillingAccount.card_fingerprint`) on file from `first_seen_at`
    to `last_seen_at` (stamped when it leaves the card: another card, or none that is a card). A card's spending
    ceiling counts the month's spend of every organisation that held it in the month (`billing.standing.card_spend`),
    so leaving a card after spending frees none of its room."""

    organization = models.ForeignKey("controlplane.Organization", on_delete=models.CASCADE, related_name="+")
    fingerprint = models.CharField(max_length=64)
    first_seen_at = models.DateTimeField(default=timezone.now)
    last_seen_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["organization", "fingerprint"], name="one_card_holding_per_card")]
        indexes = [models.Index(fields=["fingerprint", "last_seen_at"], name="card_holding_card")]

    def __str__(self) -> str:
        return f"{self.organization_id} held {self.fingerprint}"


class DeletedStripeCustomer(models.Model):
    """A Stripe customer of the organisation that Stripe deleted (`billing.services.record_customer_deleted`): the
    account forgets it, this keeps whose it was and up to when its invoices bill its usage. An invoice's webhook that
    comes after the deletion's is mirrored to this organisation (`billing.webhooks.mirror_invoice`), and a push that
    sent usage to it while it was deleted goes again only if its invoices do not bill it (`stripe_sync.push_rollup`)."""

    stripe_customer_id = models.CharField(max_length=64, unique=True)
    organization = models.ForeignKey("controlplane.Organization", on_delete=models.CASCADE, related_name="+")
    # The latest period end of its invoices that Stripe finalised, as read with the deletion's webhook (None: none,
    # or not read: Stripe not configured, or recorded from the audit log by `billing/0019`).
    invoiced_until = models.DateTimeField(null=True, blank=True)
    # Stripe's `created` of the deletion's event (or when it was recorded, if the event had none), on the clock that
    # dates its invoices' failures: one that failed before it keeps holding (`billing.standing.past_due_since`).
    deleted_at = models.DateTimeField(default=timezone.now)
    # [start, end, quantity, invoice id, final] of each of its invoices that bill their period, as read with the
    # deletion's webhook (Stripe's seconds; units of `BILLED_METER_EVENT_NAME`, of the usage price's lines alone, null
    # where not final or not known: `billing.stripe_sync.usage_quantity`; final: false for a draft Stripe still
    # advances, until its webhook tells its quantity; no id, nor final, in those kept before they were): which of the
    # events Stripe received in the deletion's own second it billed, and which it dropped
    # (`billing.services._pushed_uninvoiced`); and, read after the deletion, which invoices were not void then
    # (`billing_invoice_ids`).
    billed_periods = models.JSONField(default=list, db_default=[], blank=True)

    def __str__(self) -> str:
        return self.stripe_customer_id

    @property
    def billing_invoice_ids(self) -> set[str]:
        """The invoices that billed their period when read with the deletion's webhook, after the deletion: one of them
        voided since was voided after the deletion, whatever the second Stripe's clock gives the void."""
        return {period[3] for period in self.billed_periods if len(period) > 3}


class VoidedInvoiceMark(models.Model):
    """What was done once with a void invoice, whatever how often its void is told (`invoice.voided`,
    `invoice.updated`) or in which order with its customer's deletion (`billing.services.push_again_voided`): written
    off (a live customer's: audited once) or held for an operator (one voided in its customer's deletion's second).

    NOTE: a unique row, found by its index: before, every void's webhook looked for an audit event by a key of its
    JSON details, a scan of the whole audit log."""

    class Kind(models.TextChoices):
        WRITTEN_OFF = "written_off"
        HELD = "held"

    stripe_invoice_id = models.CharField(max_length=64)
    kind = models.CharField(max_length=16, choices=Kind.choices)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["stripe_invoice_id", "kind"], name="voided_invoice_mark_unique")]

    def __str__(self) -> str:
        return f"{self.stripe_invoice_id} {self.kind}"

    @classmethod
    def mark(cls, stripe_invoice_id: str, kind: str) -> bool:
        """Mark the invoice `kind`; False if it was already (nothing to do again)."""
        _, created = cls.objects.get_or_create(stripe_invoice_id=stripe_invoice_id, kind=kind)
        return created


class ApiKeySpendCap(models.Model):
    """An optional monthly hard cap for one API key, under the organisation's."""

    api_key = models.OneToOneField("controlplane.ApiKey", on_delete=models.CASCADE, related_name="spend_cap")
    spend_cap = MoneyField()
    # Who set it: while they are an owner, only owners may raise or remove it, and it stays theirs when someone
    # else lowers it (`services.set_key_spend_cap`).
    set_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True, related_name="+")
    updated_at = models.DateTimeField(auto_now=True)


class CreditGrantQuerySet(models.QuerySet):
    def for_org(self, organization):
        return self.filter(organization=organization)

    def active(self, now=None):
        now = now or timezone.now()
        return self.filter(granted_at__lte=now).filter(models.Q(expires_at__isnull=True) | models.Q(expires_at__gt=now))

    def paying_for(self, organization_id: int, *, since, now):
        """The grants the organisation's usage not drawn yet may be drawn from, soonest expiry first: those granted by
        `now` and active then, and those that expired after `since`, when the first of that usage began
        (`ledger.undrawn_prepaid_usage`). Which of them pays for each part of it: `credit_shares`."""
        return (self.filter(organization_id=organization_id, granted_at__lte=now)
                .filter(models.Q(expires_at__isnull=True) | models.Q(expires_at__gt=min(since, now)))
                .order_by(models.F("expires_at").asc(nulls_last=True), "granted_at", "pk"))


# A part of the usage not drawn yet is dated at the earliest start of its minute (`ledger.undrawn_prepaid_usage`): what
# it holds began within this much of that date. A grant made by then may have been there for some of it.
_PART_SPAN = timedelta(minutes=1)


def credit_shares(grants: Sequence[CreditGrant], usage: Sequence[tuple[datetime, Decimal]]) -> dict[int, Decimal]:
    """How much each of `grants` (`CreditGrantQuerySet.paying_for`, soonest expiry first) pays, by id, of `usage` (the
    start and the cost of each part of the usage not drawn yet, earliest first: `ledger.undrawn_prepaid_usage`): each
    part from the grants it was made under, those granted by and not expired when it started, soonest expiry first,
    within what each has left (granted by: within `_PART_SPAN` after the part's date, as its usage may have begun
    then). What none of them can pay is paid by none (`billing.credits.draw_credits` draws it as nothing).
    NOTE: before, a grant made after the usage began paid for it (a late row drawn after a top-up): whether it did
    hung on when the draw ran, not on what the usage was made under.

    NOTE: each part by its own start: usage made just before a grant expired but drawn after (draws follow the
    rollups, every minute, later with the worker down, and a row may reach the ledger hours late) is drawn from that
    grant, not from the next one while the expired one kept it as unspent (paid for twice); usage made after the
    expiry is never drawn from it, nor is usage of an account idle for months from every grant that expired unused
    meanwhile."""
    return _allocate(grants, usage, {grant.pk: grant.remaining for grant in grants})[0]


def credit_returns(grants: Sequence[CreditGrant], overcharge: Sequence[tuple[datetime, Decimal]],
                   consumed: dict[int, Decimal] | None = None) -> dict[int, Decimal]:
    """How much each of `grants` (`CreditGrantQuerySet.paying_for`, soonest expiry first) takes back, by id, of
    `overcharge` (the start of each part of usage drawn for more than the ledger now holds, and by how much, earliest
    first: `ledger.undrawn_prepaid_usage` with less in the ledger than drawn): `credit_shares` run backwards, each part
    to the grants it was drawn from, those granted by and not expired when it started, latest expiry first (the last a
    draw took from), within what each has consumed (`consumed`, by id; by default its `consumed`). A grant expired
    since takes its share back all the same: that credit expired unused, as it would have had the usage been priced
    right when drawn. What none of them holds is
    taken back by none (`credit_draw`).
    NOTE: draws record no grant per row, so which of the grants a part was made under paid for it is not known where
    several were: latest expiry first never gives back credit shorter-lived than what paid. Before, the overcharge went
    to whichever active grant had consumed any, soonest expiry first: non-expiring credit bought came back as a promo
    grant's, and expired unused with it."""
    if consumed is None:
        consumed = {grant.pk: grant.consumed for grant in grants}
    return _allocate(list(reversed(grants)), overcharge, consumed)[0]


class CreditDraw(NamedTuple):
    """What a credit draw does (`credit_draw`): how much each grant takes of the usage and gives back of the
    overcharges, by id, what the account has drawn as nothing after it (`BillingAccount.credit_unpaid`), and how much
    of the overcharges it netted against usage begun at the same time, drawn in the same draw (`_net_same_start`)."""

    taken: dict[int, Decimal]
    returned: dict[int, Decimal]
    unpaid: Decimal
    netted: Decimal = Decimal(0)


def credit_draw(grants: Sequence[CreditGrant], usage: Sequence[tuple[datetime, Decimal]],
                overcharge: Sequence[tuple[datetime, Decimal]], *, returned: Decimal, unpaid: Decimal,
                now: datetime) -> CreditDraw:
    """What a draw does to `grants` (`CreditGrantQuerySet.paying_for` since the earliest part of either, soonest expiry
    first) for the usage not drawn yet (`ledger.undrawn_prepaid_usage`): first it nets each overcharge against the
    usage begun at the same time (a lost row drawn in the window of its cheaper supersede: `_net_same_start`), then
    draws `usage` from what the grants hold (`credit_shares`), then gives back `returned` (the overcharges made since the last draw, dated by
    `overcharge`'s parts, which make it or less) within what each has consumed after that; usage none held draws from
    what was given back. The same draw `billing.credits.draw_credits` writes and
    `billing.quota.rebuild` counts.

    The overcharge is first offset against what the account drew as nothing (`unpaid`: its usage was paid by no grant,
    and an overcharge of it gives no grant credit back), the undated rest of it then its latest parts; the rest goes
    back to the grants that paid for it (`credit_returns`); what they do not hold (usage dated at a draw rather than at
    its start, paid by a grant made later) to the grants active at `now` that have consumed any, latest expiry first.
    What none holds was paid by none: not given back. Usage no grant can pay adds to what is drawn as nothing.
    NOTE: before, the two were netted (the draw had their sum alone): a new call and a cheaper supersede in one draw
    window drew the call short and left the overcharge with the grant that paid it; and an overcharge of usage drawn as
    nothing went back to a grant as if it had paid it (credit from nothing). And it gave back before it drew, within
    what each grant had consumed before the draw: a lost row and its cheaper supersede in one window gave nothing back
    to a grant that had consumed nothing yet, drew the full lost cost, and counted the overcharge as given back; or,
    with grants holding consumption, took the lost cost from one and gave the overcharge back to another."""
    usage, overcharge, netted = _net_same_start(usage, overcharge)
    returned -= netted
    taken, short = _allocate(grants, usage, {grant.pk: grant.remaining for grant in grants})
    consumed = {grant.pk: grant.consumed + taken.get(grant.pk, Decimal(0)) for grant in grants}
    offset = min(unpaid, returned)
    parts = _less_latest(overcharge, offset - min(offset, returned - sum((cost for _, cost in overcharge), Decimal(0))))
    back = credit_returns(grants, parts, consumed)
    left = returned - offset - sum(back.values(), Decimal(0))
    for grant in reversed(grants):
        if left <= 0:
            break
        if grant.is_active(now):
            share = min(left, consumed[grant.pk] - back.get(grant.pk, Decimal(0)))
            if share > 0:
                back[grant.pk] = back.get(grant.pk, Decimal(0)) + share
                left -= share
    # What no grant held before the give-back draws from what it gave back.
    more, _ = _allocate(grants, short, {grant.pk: grant.remaining - taken.get(grant.pk, Decimal(0))
                                        + back.get(grant.pk, Decimal(0)) for grant in grants})
    for pk, share in more.items():
        taken[pk] = taken.get(pk, Decimal(0)) + share
    drawn_as_nothing = sum((cost for _, cost in usage), Decimal(0)) - sum(taken.values(), Decimal(0))
    return CreditDraw(taken, back, unpaid - offset + drawn_as_nothing, netted)


def _net_same_start(usage: Sequence[tuple[datetime, Decimal]], overcharge: Sequence[tuple[datetime, Decimal]]
                    ) -> tuple[list[tuple[datetime, Decimal]], list[tuple[datetime, Decimal]], Decimal]:
    """`usage` and `overcharge` less what each part of one has of the other's begun at the same time (a lost row drawn
    in the window its cheaper supersede came in: the grant that takes it takes its real cost), and the total netted."""
    over = dict(overcharge)
    net = []
    netted = Decimal(0)
    for started_at, cost in usage:
        less = min(cost, over.get(started_at, Decimal(0)))
        if less > 0:
            over[started_at] -= less
            netted += less
        if cost > less:
            net.append((started_at, cost - less))
    return net, [(started_at, over[started_at]) for started_at, _ in overcharge if over[started_at] > 0], netted


def _less_latest(parts: Sequence[tuple[datetime, Decimal]], amount: Decimal) -> list[tuple[datetime, Decimal]]:
    """`parts` (earliest first) less `amount`, taken from the latest."""
    kept = []
    for started_at, cost in reversed(parts):
        less = min(cost, amount)
        amount -= less
        if cost > less:
            kept.append((started_at, cost - less))
    return kept[::-1]


def _allocate(grants: Sequence[CreditGrant], parts: Sequence[tuple[datetime, Decimal]],
              room: dict[int, Decimal]) -> tuple[dict[int, Decimal], list[tuple[datetime, Decimal]]]:
    """Each of `parts` (a start and an amount) to the `grants` it was made under, in their order, within each's `room`
    (by id; what it may take of all the parts): how much each takes, by id, and what of the parts none took."""
    left = dict(room)
    taken: dict[int, Decimal] = {}
    short: list[tuple[datetime, Decimal]] = []
    for started_at, amount in parts:
        for grant in grants:
            if amount <= 0:
                break
            if not _made_under(grant, started_at):
                continue
            share = min(left[grant.pk], amount)
            if share > 0:
                left[grant.pk] -= share
                taken[grant.pk] = taken.get(grant.pk, Decimal(0)) + share
                amount -= share
        if amount > 0:
            short.append((started_at, amount))
    return taken, short


def _made_under(grant: CreditGrant, started_at: datetime) -> bool:
    """Whether usage begun at `started_at` (a part's date: within `_PART_SPAN` after it) was made under `grant`: granted
    by then and not expired."""
    return grant.granted_at < started_at + _PART_SPAN and (grant.expires_at is None or grant.expires_at > started_at)


class CreditKind(models.TextChoices):
    # Paid for by the customer (a top-up invoiced or wired): theirs, refunded by support, never forfeited by a close.
    PURCHASED = "purchased", "Purchased"
    # Given by the platform (a trial, a goodwill credit): ends with the organisation.
    PROMOTIONAL = "promotional", "Promotional"


class CreditGrant(models.Model):
    """Prepaid credit: usable from `granted_at` until `expires_at`; unused credit expires with it."""

    organization = models.ForeignKey("controlplane.Organization", on_delete=models.CASCADE, related_name="credit_grants")
    amount = MoneyField()
    # NOTE: grants made before this was kept are purchased, the careful reading: a close is refused while purchased
    # credit remains (`endpoints.closing`), so support looks at them rather than a close forfeiting a customer's money.
    kind = models.CharField(max_length=16, choices=CreditKind.choices, default=CreditKind.PURCHASED,
                            db_default=CreditKind.PURCHASED)
    consumed = MoneyField(default=Decimal(0))
    note = models.CharField(max_length=200, blank=True)
    granted_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField(null=True, blank=True)

    objects = CreditGrantQuerySet.as_manager()

    class Meta:
        ordering = ["expires_at", "granted_at"]
        constraints = [models.CheckConstraint(condition=models.Q(consumed__lte=models.F("amount")), name="credit_not_overdrawn")]

    def __str__(self) -> str:
        return f"{self.amount} for {self.organization_id}"

    @property
    def remaining(self) -> Decimal:
        return self.amount - self.consumed

    def is_active(self, now=None) -> bool:
        now = now or timezone.now()
        return self.granted_at <= now and (self.expires_at is None or self.expires_at > now)


class SpendAlert(models.Model):
    """A spend alert sent (or being sent) for one threshold of one period and one limit (`spend_cap` of its kind,
    `limit_reason`): at most one each. A limit raised in the month (a spending ceiling rises as invoices are paid) gets its own alerts, once the
    spend reaches them (`billing.alerts._alerted_at_this_spend`: a limit of a kind set at or below a spend already
    alerted at that kind sends nothing new)."""

    organization = models.ForeignKey("controlplane.Organization", on_delete=models.CASCADE, related_name="+")
    period_start = models.DateTimeField()
    threshold_percent = models.PositiveSmallIntegerField()
    spend = MoneyField()
    spend_cap = MoneyField()
    # The limit's kind (`billing.standing.SPEND_LIMIT_REASONS`: its own cap, a ceiling, the limit without a payment
    # method); "" for an alert of before it was kept (`billing/0038`), or made by a pod of the release before.
    limit_reason = models.CharField(max_length=32, blank=True, default="", db_default="")
    sent_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)  # claimed then (again, if left unsent: `billing.alerts`)

    class Meta:
        constraints = [
            # NOTE: the kind too: a limit of another kind at the same amount (a staff ceiling of $8 lifted, the
            # organisation's own $8 cap stopping its calls) found the earlier kind's claims taken, and nobody was
            # told that calls now stop for it, nor what to do (`billing/0038`).
            models.UniqueConstraint(fields=["organization", "period_start", "threshold_percent", "spend_cap",
                                            "limit_reason"], name="one_alert_per_threshold_period_and_limit"),
        ]


class StripeMeter(models.Model):
    """A Billing Meter (and its metered price) in our Stripe account, created when first needed."""

    event_name = models.CharField(max_length=100, unique=True)
    stripe_meter_id = models.CharField(max_length=64)
    stripe_price_id = models.CharField(max_length=64, blank=True)


class MeterEventPush(models.Model):
    """A meter event Stripe accepted: what we pushed, so we never push it twice."""

    rollup = models.ForeignKey(UsageRollup, on_delete=models.PROTECT, related_name="meter_events")
    event_name = models.CharField(max_length=100)
    identifier = models.CharField(max_length=100, unique=True)
    value = models.BigIntegerField()  # negative for an adjustment that lowers its meter (`UsageRollup`)
    pushed_at = models.DateTimeField(default=timezone.now)
    # The customer it went to and the time it was dated at (what decides which invoice bills it); blank and null for
    # events recorded before they were kept (`billing/0017`).
    stripe_customer_id = models.CharField(max_length=64, blank=True, default="", db_default="")
    event_at = models.DateTimeField(null=True, blank=True)
    push_generation = models.PositiveIntegerField(default=0, db_default=0)  # its rollup's when it was pushed
    # When Stripe received it (its answer's `created`, on Stripe's clock, in seconds): one received after its customer's
    # deletion was dropped, whatever invoice's period it is dated in (`billing.services._pushed_uninvoiced`). Null: not
    # known (Stripe refused it as a duplicate of an earlier try, or recorded before `billing/0022`).
    stripe_created_at = models.DateTimeField(null=True, blank=True)


# The meter Stripe bills by (`billing.stripe_sync.COST_METER`): its events' values are what an invoice's `quantity`
# counts, in micro-dollars.
BILLED_METER_EVENT_NAME = "inferplane_usage_cost"


class StripeEvent(models.Model):
    """A webhook event we processed (idempotency by Stripe's event id)."""

    stripe_event_id = models.CharField(max_length=100, unique=True)
    type = models.CharField(max_length=100)
    received_at = models.DateTimeField(default=timezone.now)


# Invoice states (Stripe's `status`) of an invoice that bills the usage of its period: finalised, and paid or owed.
# NOTE: not void: Stripe's void is a deletion that keeps a paper trail, owed by nobody, so it bills nothing and the
# usage of its period goes to the next invoice that can (`billing.services.push_again`). An uncollectible one is still
# owed (Stripe takes a payment of it, and its hold stands: `billing.standing`): billed, as an open one. A draft bills
# its period once finalised (`billing.stripe_sync.deleted_customer_invoices`).
BILLING_INVOICE_STATUSES = ("open", "paid", "uncollectible")
# A void invoice of a customer still live (of any of its subscriptions, the one billing now or an earlier one) is a
# staff write-off: its period's usage is forgiven, audited, and billed by no other invoice: never pushed again, nor
# billed by the next subscription, which starts where the ended one's invoices stopped, a void one's too
# (`billing.stripe_sync._invoiced_until`), nor by the next customer once its customer is deleted. Only an invoice
# voided after its customer's deletion (`Invoice.voided_at`, Stripe's clock) sends its period's usage again, to the
# organisation's customer of now (`billing.services.push_again_voided`): nobody forgave it.
WRITTEN_OFF_INVOICE_STATUS = "void"


def voided_after_deletion(voided_at: datetime | None, deleted_at: datetime) -> bool:
    """Whether an invoice voided at `voided_at` (Stripe's clock, in seconds) was voided a later second than its
    customer's deletion at `deleted_at` (the deletion event's `created`): its usage goes again.

    NOTE: Stripe's clock cannot order a void in the deletion's own second, or at a time not told
    (`voided_in_deletions_second`): not a write-off by rule, as before (the usage was never billed if voided after):
    the deletion's own read of the invoices may order it (`DeletedStripeCustomer.billing_invoice_ids`), else an
    operator decides (`billing.services.push_again_voided`)."""
    return voided_at is not None and voided_at > deleted_at


def voided_in_deletions_second(voided_at: datetime | None, deleted_at: datetime) -> bool:
    """Whether Stripe's clock cannot order a void at `voided_at` against its customer's deletion at `deleted_at`: the
    same second, or a void whose time Stripe does not tell (`voided_after_deletion`)."""
    return voided_at is None or voided_at == deleted_at


class InvoiceQuerySet(models.QuerySet):
    def for_org(self, organization):
        return self.filter(organization=organization)

    def billing(self):
        """Those that bill the usage of their period (`BILLING_INVOICE_STATUSES`)."""
        return self.filter(status__in=BILLING_INVOICE_STATUSES)

    def written_off(self, deleted_at: datetime):
        """The void ones not voided after their customer's deletion at `deleted_at` (`voided_after_deletion`): voided
        before it, written off, or in its second (`voided_in_deletions_second`: their usage is held for an operator,
        never sent again by rule)."""
        return self.filter(models.Q(voided_at__isnull=True) | models.Q(voided_at__lte=deleted_at),
                           status=WRITTEN_OFF_INVOICE_STATUS)

    def voided_in_deletions_second(self, deleted_at: datetime):
        """The void ones whose void Stripe's clock cannot order against their customer's deletion at `deleted_at`."""
        return self.filter(models.Q(voided_at__isnull=True) | models.Q(voided_at=deleted_at),
                           status=WRITTEN_OFF_INVOICE_STATUS)


class Invoice(models.Model):
    """Our mirror of a Stripe invoice, kept up to date by webhooks."""

    organization = models.ForeignKey("controlplane.Organization", on_delete=models.CASCADE, related_name="invoices")
    stripe_invoice_id = models.CharField(max_length=64, unique=True)
    # The Stripe customer it bills (empty: mirrored before it was kept, `billing/0020`): one deleted since
    # (`DeletedStripeCustomer`) has no card to charge (`billing.standing.past_due_since`).
    stripe_customer_id = models.CharField(max_length=64, blank=True, db_index=True, default="", db_default="")
    number = models.CharField(max_length=64, blank=True)
    status = models.CharField(max_length=32)  # draft, open, paid, uncollectible, void
    currency = models.CharField(max_length=8, default="usd")
    # Amounts in the currency's minor unit (cents), as Stripe sends them.
    amount_due = models.BigIntegerField(default=0)
    amount_paid = models.BigIntegerField(default=0)
    period_start = models.DateTimeField(null=True, blank=True)
    period_end = models.DateTimeField(null=True, blank=True)
    hosted_invoice_url = models.URLField(max_length=500, blank=True)
    payment_failed_at = models.DateTimeField(null=True, blank=True)
    # When Stripe first marked it uncollectible (its event's `created`; before `billing/0021`, its failure or last
    # change): one owed before its customer was deleted keeps holding (`billing.standing.past_due_since`).
    uncollectible_at = models.DateTimeField(null=True, blank=True)
    # When Stripe voided it (`status_transitions.voided_at`, Stripe's clock, in seconds; null: not void, or not told):
    # a void before its customer's deletion is a write-off, one in its second is held for an operator unless the
    # deletion's read orders it; only one after it sends its usage again
    # (`billing.services.push_again_voided`).
    voided_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)
    # Stripe's `created` of the newest event applied: an older event never overwrites a newer one.
    stripe_event_created = models.BigIntegerField(default=0)

    objects = InvoiceQuerySet.as_manager()

    class Meta:
        ordering = ["-period_start", "-id"]

    def __str__(self) -> str:
        return self.number or self.stripe_invoice_id


class Dispute(models.Model):
    """Our mirror of a Stripe dispute on one of the organisation's payments (a chargeback, or the inquiry before
    one), kept up to date by `charge.dispute.*` webhooks. An open or lost one stops its inference
    (`billing.standing.disputed_since`) until it is won, or staff lift its hold (`services.lift_dispute_hold`)."""

    organization = models.ForeignKey("controlplane.Organization", on_delete=models.CASCADE, related_name="disputes")
    stripe_dispute_id = models.CharField(max_length=64, unique=True)
    stripe_charge_id = models.CharField(max_length=64, blank=True)
    # Stripe's: warning_needs_response, warning_under_review, warning_closed, needs_response, under_review, won,
    # lost or prevented.
    status = models.CharField(max_length=32)
    reason = models.CharField(max_length=64, blank=True)  # fraudulent, product_not_received, ...
    currency = models.CharField(max_length=8, default="usd")
    amount = models.BigIntegerField(default=0)  # in the currency's minor unit, as Stripe sends it
    disputed_at = models.DateTimeField(null=True, blank=True)  # Stripe's `created` of the dispute
    updated_at = models.DateTimeField(auto_now=True)
    # Stripe's `created` of the newest event applied: an older event never overwrites a newer one.
    stripe_event_created = models.BigIntegerField(default=0)
    # Staff settled it with the organisation (a lost dispute repaid, say): it holds nothing any more.
    hold_lifted_at = models.DateTimeField(null=True, blank=True)
    hold_lifted_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True,
                                       related_name="+")

    class Meta:
        ordering = ["-disputed_at", "-id"]

    def __str__(self) -> str:
        return self.stripe_dispute_id


class RefundedCharge(models.Model):
    """Our mirror of what Stripe refunded of one of the organisation's payments (`charge.refunded`; those refunded
    before it was sent, read back by `manage.py backfill_refunds`): money that came back counts out of its paid history
    (`billing.standing.net_paid`)."""

    organization = models.ForeignKey("controlplane.Organization", on_delete=models.CASCADE, related_name="+")
    stripe_charge_id = models.CharField(max_length=64, unique=True)
    currency = models.CharField(max_length=8, default="usd")
    amount_refunded = models.BigIntegerField(default=0)  # the charge's refunds in all, minor unit, as Stripe sends it

    def __str__(self) -> str:
        return self.stripe_charge_id

    def raise_refunded(self, amount: int, currency: str) -> bool:
        """Record that Stripe has refunded `amount` (the charge's running total, minor unit) as read now, from a
        `charge.refunded` event or read back from Stripe; whether that changed anything. The caller holds the row's
        lock.

        NOTE: a charge's refunds only add up (a failed refund sends no `charge.refunded`), so the larger of what is
        recorded and `amount` is the truth, whatever the order things arrive in: an older event that Stripe retries
        after `manage.py backfill_refunds` read a newer total never lowers it."""
        if amount <= self.amount_refunded:
            return False
        self.amount_refunded = amount
        self.currency = currency or "usd"
        self.save(update_fields=["amount_refunded", "currency"])
        return True


class InvoiceLine(models.Model):
    invoice = models.ForeignKey(Invoice, on_delete=models.CASCADE, related_name="lines")
    stripe_line_id = models.CharField(max_length=64)
    description = models.CharField(max_length=500, blank=True)
    quantity = models.BigIntegerField(null=True, blank=True)
    amount = models.BigIntegerField(default=0)  # minor unit

    class Meta:
        ordering = ["id"]
        constraints = [models.UniqueConstraint(fields=["invoice", "stripe_line_id"], name="invoice_line_unique")]
