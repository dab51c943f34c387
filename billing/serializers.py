"""Shapes of the usage and billing APIs."""

from __future__ import annotations

from datetime import UTC, date, timedelta
from decimal import Decimal

from rest_framework import serializers

from billing.ledger import GROUPINGS
from billing.models import MONEY_QUANTUM, BillingAccount, CreditGrant, Invoice, InvoiceLine
from controlplane.accounts.serializers import StrictModelSerializer
from controlplane.clock import database_now

MAX_USAGE_RANGE = timedelta(days=366)
MAX_SPEND_CAP = Decimal("1000000")  # NOTE: keeps the Redis counters exact (see billing.quota)


def format_money(amount: Decimal) -> str:
    """Exact to the nano-dollar, without trailing zeros past the cents: "12.50", "0.000123"."""
    text = f"{amount.quantize(MONEY_QUANTUM):f}".rstrip("0")
    whole, _, fraction = text.partition(".")
    return f"{whole}.{fraction.ljust(2, '0')}"


# The days a usage report may name: a period's arithmetic (the day after its end, the days before a default start)
# stays inside the dates Python can hold. NOTE: `?end=9999-12-31` was a 500 (`date value out of range`).
EARLIEST_REPORT_DAY = date(2000, 1, 1)
LATEST_REPORT_DAY = date(9998, 12, 31)


class ReportDateField(serializers.DateField):
    """A report's `YYYY-MM-DD`, from `EARLIEST_REPORT_DAY` to `LATEST_REPORT_DAY`."""

    def __init__(self, **kwargs):
        super().__init__(input_formats=["%Y-%m-%d"], **kwargs)

    def to_internal_value(self, value):
        day = super().to_internal_value(value)
        if problem := report_day_problem(day):
            raise serializers.ValidationError(problem)
        return day


def report_day_problem(day: date) -> str:
    """Why a report does not take `day` ("" when it does): the API's fields and the console's usage page."""
    if EARLIEST_REPORT_DAY <= day <= LATEST_REPORT_DAY:
        return ""
    return f"Dates run from {EARLIEST_REPORT_DAY} to {LATEST_REPORT_DAY}."


class DatePeriodSerializer(serializers.Serializer):
    """`?start=YYYY-MM-DD&end=YYYY-MM-DD` (inclusive, UTC; default: this month), at most
    `max_days_apart` days from start to end: the one reading of a report's period."""

    max_days_apart = MAX_USAGE_RANGE.days

    start = ReportDateField(required=False)
    end = ReportDateField(required=False)

    def validate(self, data):
        # NOTE: by PostgreSQL's clock, which usage is stamped by (`database_now`): by this pod's own, one behind into
        # last month answered last month's usage for "this month", and one a day behind left out today's.
        today = database_now().astimezone(UTC).date()
        data.setdefault("end", today)
        data.setdefault("start", min(today.replace(day=1), data["end"]))
        if data["start"] > data["end"]:
            raise serializers.ValidationError({"start": ["Must be on or before end."]})
        if (data["end"] - data["start"]).days > self.max_days_apart:
            raise serializers.ValidationError({"start": [f"The range may span at most {MAX_USAGE_RANGE.days} days."]})
        return data


class UsageQuerySerializer(DatePeriodSerializer):
    """`?group_by=endpoint|day|key&start=YYYY-MM-DD&end=YYYY-MM-DD` (inclusive, UTC; default: this month)."""

    group_by = serializers.ChoiceField(choices=GROUPINGS, default="endpoint")


class SpendCapSerializer(StrictModelSerializer):
    spend_cap = serializers.DecimalField(
        max_digits=12, decimal_places=2, min_value=Decimal(0), max_value=MAX_SPEND_CAP, allow_null=True,
        help_text="Monthly hard cap in USD; null removes it.",
    )

    class Meta:
        model = BillingAccount
        fields = ["spend_cap"]


class CreditGrantSerializer(serializers.ModelSerializer):
    amount = serializers.SerializerMethodField()
    remaining = serializers.SerializerMethodField()
    expired = serializers.SerializerMethodField()

    class Meta:
        model = CreditGrant
        fields = ["id", "amount", "remaining", "note", "granted_at", "expires_at", "expired"]
        read_only_fields = fields

    def get_amount(self, grant) -> str:
        return format_money(grant.amount)

    def _now(self):
        """PostgreSQL's clock, as grants are stamped (`granted_at`) and spent by: the context's `now`, else read once.
        NOTE: by the web pod's own, one 10 minutes behind showed a top-up made a moment ago as 0.00 remaining."""
        if "now" not in self.context:  # the list's own (`Serializer.context`: its root's), read once for all its grants
            self.context["now"] = database_now()
        return self.context["now"]

    def get_remaining(self, grant) -> str:
        return format_money(grant.remaining if grant.is_active(self._now()) else Decimal(0))

    def get_expired(self, grant) -> bool:
        return grant.expires_at is not None and grant.expires_at <= self._now()


class InvoiceLineSerializer(serializers.ModelSerializer):
    class Meta:
        model = InvoiceLine
        fields = ["description", "quantity", "amount"]
        read_only_fields = fields


class _UrlOrNull(serializers.URLField):
    """A URL stored as "" when there is none, shown as null (a blank is not a URL)."""

    def to_representation(self, value):
        return value or None


class InvoiceSerializer(serializers.ModelSerializer):
    lines = InvoiceLineSerializer(many=True, read_only=True)
    hosted_invoice_url = _UrlOrNull(read_only=True, allow_null=True,
                                    help_text="Stripe's page for the invoice (pay, PDF); null until Stripe gives one")

    class Meta:
        model = Invoice
        fields = [
            "id", "stripe_invoice_id", "number", "status", "currency", "amount_due", "amount_paid",
            "period_start", "period_end", "hosted_invoice_url", "payment_failed_at", "lines",
        ]
        read_only_fields = fields
