"""Usage and billing API: `/api/v1/usage/`, `/api/v1/usage/export.csv`, `/api/v1/billing/`, Stripe webhooks."""

from __future__ import annotations

import csv
import logging
from decimal import Decimal

import stripe
from django.conf import settings
from django.http import HttpResponse
from drf_spectacular.utils import OpenApiResponse, extend_schema, inline_serializer
from rest_framework import serializers, status
from rest_framework.exceptions import PermissionDenied, ValidationError
from rest_framework.generics import GenericAPIView, get_object_or_404
from rest_framework.permissions import AllowAny
from rest_framework.response import Response
from rest_framework.views import APIView

from billing import ledger, services, standing, stripe_sync
from billing.models import BillingAccount, BillingMode, CreditGrant, Invoice
from billing.periods import Period, period_containing
from billing.serializers import (
    CreditGrantSerializer,
    InvoiceSerializer,
    SpendCapSerializer,
    UsageQuerySerializer,
    format_money,
)
from billing.webhooks import InvalidWebhook, handle_stripe_webhook
from controlplane.accounts.api import OrganizationScopedMixin
from controlplane.accounts.members import NotPermitted
from controlplane.accounts.models import ApiKey, Role
from controlplane.clock import database_now

logger = logging.getLogger(__name__)

# A spreadsheet reads a cell that starts with one of these as a formula (or, for tab and carriage
# return, strips them and reads what follows): `=HYPERLINK(...)` in a key's name must stay text.
FORMULA_TRIGGERS = ("=", "+", "-", "@", "\t", "\r")


def spreadsheet_cell(value):
    """`value` as a CSV cell that no spreadsheet evaluates: text that could start a formula gets a
    leading `'` (OWASP's CSV injection advice); numbers and other values pass unchanged."""
    if isinstance(value, str) and value.startswith(FORMULA_TRIGGERS):
        return "'" + value
    return value


class UsageView(OrganizationScopedMixin, GenericAPIView):
    serializer_class = UsageQuerySerializer
    # NOTE: one answer, not a page. With the default paginator, the browsable API (a browser following the usage
    # page's JSON link) took `{"results": …}` for a list to filter and asked for a queryset this view has not: a 500.
    pagination_class = None

    def _results(self, request) -> tuple[str, list[dict]]:
        query = UsageQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        group_by = query.validated_data["group_by"]
        rows = ledger.summarize_usage(self.organization, group_by=group_by,
                                      start=query.validated_data["start"], end=query.validated_data["end"])
        return group_by, rows

    @extend_schema(parameters=[UsageQuerySerializer], responses=inline_serializer("Usage", {"results": serializers.ListField()}))
    def get(self, request):
        _, rows = self._results(request)
        return Response({"results": [row | {"cost": format_money(row["cost"])} for row in rows]})


class UsageExportView(UsageView):
    def perform_content_negotiation(self, request, force=False):
        """NOTE: a client generated from the schema sends `Accept: text/csv` here, the answer documented; no renderer
        of DRF's takes it, and it got a 406 in no schema. The view writes its CSV itself; errors are JSON."""
        return super().perform_content_negotiation(request, force=True)

    @extend_schema(parameters=[UsageQuerySerializer], responses={(200, "text/csv"): OpenApiResponse(description="CSV")})
    def get(self, request):
        group_by, rows = self._results(request)
        response = HttpResponse(content_type="text/csv; charset=utf-8")
        response["Content-Disposition"] = f'attachment; filename="usage-by-{group_by}.csv"'
        columns = [group_by, *(["key_name"] if group_by == "key" else []),
                   "requests", "prompt_tokens", "cached_tokens", "completion_tokens", "cost",
                   "cold_starts", "cold_start_ms"]
        writer = csv.writer(response)
        writer.writerow(columns)
        for row in rows:
            writer.writerow([spreadsheet_cell(format_money(row[c]) if c == "cost" else row[c]) for c in columns])
        return response


def billing_overview(organization) -> dict:
    account = BillingAccount.objects.for_organization(organization)
    # NOTE: one reading of PostgreSQL's clock for the whole answer, as the billing page's (`views._billing_page`): read
    # once for the month (`current_period`) and again for the credit left, an answer across a month's edge paired
    # last month's period and spend with the credit as of the new month.
    now = database_now()
    period = period_containing(now)
    return {
        "current_period": {
            "start": period.start.isoformat(),
            "end": period.end.isoformat(),
            "spend": format_money(ledger.period_spend(organization.pk, period)),
        },
        "spend_cap": format_money(account.spend_cap) if account.spend_cap is not None else None,
        "mode": account.mode,
        "standing": _standing_fields(account, period),
        "credits": CreditGrantSerializer(CreditGrant.objects.for_org(organization), many=True,
                                         context={"now": now}).data,
        "invoices": InvoiceSerializer(Invoice.objects.for_org(organization).prefetch_related("lines")[:24], many=True).data,
    }


def _standing_fields(account: BillingAccount, period: Period) -> dict:
    """`billing.standing.standing` in `period` as JSON: money as strings, the hold as an ISO 8601 moment."""
    shown = standing.standing(account, period=period)
    return {
        "payment_method_on_file": shown["payment_method_on_file"],
        "limit_without_payment_method": _money_or_none(shown["limit_without_payment_method"]),
        "spend_ceiling": _ceiling_fields(shown["spend_ceiling"]),
        "effective_spend_cap": _money_or_none(shown["effective_spend_cap"]),
        "limit_reason": shown["limit_reason"] or None,
        "past_due_since": shown["past_due_since"].isoformat() if shown["past_due_since"] else None,
        "hold_reason": shown["hold_reason"] or None,
        "num_unpaid_invoices_without_card": shown["num_unpaid_invoices_without_card"],
    }


def _ceiling_fields(ceiling: standing.SpendCeiling | None) -> dict | None:
    if ceiling is None:
        return None
    # NOTE: the organisation's own figures only: never what others of its card paid, spent, or how many they are.
    return {"amount": _money_or_none(ceiling.amount), "source": ceiling.source,
            "net_paid": format_money(ceiling.paid_by_itself),
            "next_paid": _money_or_none(ceiling.next_paid),
            "next_amount": _money_or_none(ceiling.next_amount) if ceiling.next_paid is not None else None,
            "shared_with_other_organizations": ceiling.is_shared}


def _money_or_none(amount: Decimal | None) -> str | None:
    return format_money(amount) if amount is not None else None


def _spend_cap_of(request) -> Decimal | None:
    """The `spend_cap` of a PATCH body (null removes the cap); 400 with field errors when bad or missing."""
    data = SpendCapSerializer(data=request.data)
    data.is_valid(raise_exception=True)
    if "spend_cap" not in data.validated_data:
        raise ValidationError({"spend_cap": ["This field is required."]})
    return data.validated_data["spend_cap"]


_MONEY = {"help_text": "USD, as a decimal string"}
BILLING_OVERVIEW = inline_serializer("BillingOverview", {
    "current_period": inline_serializer("BillingPeriod", {
        "start": serializers.DateTimeField(), "end": serializers.DateTimeField(), "spend": serializers.CharField(**_MONEY),
    }),
    "spend_cap": serializers.CharField(allow_null=True, help_text="The organisation's own monthly cap (USD); null: none"),
    "mode": serializers.ChoiceField(choices=BillingMode.choices),
    "standing": inline_serializer("PaymentStanding", {
        "payment_method_on_file": serializers.BooleanField(),
        "limit_without_payment_method": serializers.CharField(
            allow_null=True, help_text="The monthly limit that applies for want of a payment method (USD); null: none"),
        "spend_ceiling": inline_serializer("SpendCeiling", {
            "amount": serializers.CharField(allow_null=True, help_text="The monthly spending ceiling (USD); null: none"),
            "source": serializers.ChoiceField(
                choices=[standing.PAID_HISTORY, standing.GRANDFATHERED, standing.STAFF],
                help_text="paid_history (what the organisation has paid gives it), grandfathered (the floor its usage "
                          "before spending ceilings gave it, until its paid history gives more) or staff (set by "
                          "support)"),
            "net_paid": serializers.CharField(
                help_text="What its paid invoices paid, less refunds and payments disputed and not won (USD)"),
            "next_paid": serializers.CharField(
                allow_null=True, help_text="The paid total at which its history gives the next ceiling (USD); null: "
                                           "paying raises it no more (or staff set it)"),
            "next_amount": serializers.CharField(
                allow_null=True, help_text="That next ceiling (USD); null: none, or no next step"),
            "shared_with_other_organizations": serializers.BooleanField(
                help_text="Whether other organisations used the same card this month: what they spend counts against "
                          "the ceiling too, so calls may be refused before this organisation's own spend reaches it "
                          "(their number and figures are not shown)"),
        }, allow_null=True, help_text="Null where none applies: prepaid, invoiced without card, or no Stripe"),
        "effective_spend_cap": serializers.CharField(
            allow_null=True, help_text="The lowest of the cap, the spending ceiling and that limit: where calls stop "
                                       "(USD); null: none"),
        "limit_reason": serializers.ChoiceField(
            choices=list(standing.SPEND_LIMIT_REASONS), allow_null=True,
            help_text="Which of them it is: org_cap, payment_method, spend_ceiling (its paid history's) or "
                      "spend_ceiling_staff (set by support); null: no limit"),
        "past_due_since": serializers.DateTimeField(
            allow_null=True,
            help_text="Since when an unpaid invoice or a disputed payment stops inference; null: in good standing"),
        "hold_reason": serializers.ChoiceField(
            choices=["past_due", "disputed"], allow_null=True,
            help_text="What stops inference: past_due (an unpaid invoice) or disputed (a payment disputed with "
                      "the card's bank); null: in good standing"),
        "num_unpaid_invoices_without_card": serializers.IntegerField(
            help_text="Unpaid invoices of a Stripe customer deleted since: still owed, no card charges them; pay each "
                      "from its page (`hosted_invoice_url`). They stop inference only while no payment method is on file"),
    }),
    "credits": CreditGrantSerializer(many=True),
    "invoices": InvoiceSerializer(many=True),
})


class BillingView(OrganizationScopedMixin, GenericAPIView):
    """GET: the period's spend, cap, payment standing, credits and invoices. PATCH `{"spend_cap": "12.50"}`:
    owners and admins (403 for an API key with a cap of its own raising or removing it)."""

    serializer_class = SpendCapSerializer
    required_role = Role.ADMIN
    patch_sets_every_field = True  # `spend_cap` (null removes it): `controlplane.schema`

    @extend_schema(responses=BILLING_OVERVIEW)
    def get(self, request):
        return Response(billing_overview(self.organization))

    @extend_schema(request=SpendCapSerializer, responses={200: BILLING_OVERVIEW, 403: OpenApiResponse(description=(
        "The caller may not set the cap: its role (members and viewers), or the API key it calls with (a key with a "
        "spend cap of its own lowers the organisation's cap, never raises or removes it)."))})
    def patch(self, request):
        try:
            services.set_spend_cap(self.actor, self.organization, spend_cap=_spend_cap_of(request))
        except NotPermitted as exc:
            raise PermissionDenied(str(exc)) from None
        return Response(billing_overview(self.organization))


class KeySpendCapView(OrganizationScopedMixin, GenericAPIView):
    """PATCH `{"spend_cap": "5.00" | null}`: a monthly cap for one API key (owners and admins; 403 for an admin on
    an owner's key, or raising or removing a cap an owner set)."""

    serializer_class = SpendCapSerializer
    required_role = Role.ADMIN
    patch_sets_every_field = True  # `spend_cap` (null removes it): `controlplane.schema`

    # NOTE: the answer is not the request's shape: before, the schema said `spend_cap` alone (the request's serializer)
    # and the answer held `key` too, which a client generated from the schema never read.
    @extend_schema(responses=inline_serializer("KeySpendCap", {
        "key": serializers.CharField(help_text="The key's prefix as listed (`ip_…`), never its secret."),
        "spend_cap": serializers.DecimalField(max_digits=12, decimal_places=2, allow_null=True,
                                              help_text="Monthly hard cap in USD; null: none."),
    }))
    def patch(self, request, key_id: int):
        api_key = get_object_or_404(ApiKey.objects.for_org(self.organization), pk=key_id)
        try:
            cap = services.set_key_spend_cap(self.actor, api_key, spend_cap=_spend_cap_of(request))
        except NotPermitted as exc:
            raise PermissionDenied(str(exc)) from None
        return Response({"key": api_key.display_prefix, "spend_cap": format_money(cap.spend_cap) if cap else None})


class PortalLinkView(OrganizationScopedMixin, APIView):
    """POST: a Stripe Customer Portal link to add a payment method (owners and admins).

    NOTE: an `APIView`, not a `GenericAPIView`: it reads no body, and DRF's OPTIONS answer asks a
    generic view for a serializer it does not have (an AssertionError, a 500).
    """

    required_role = Role.ADMIN
    open_when_closed = True  # NOTE: a closed organisation still pays its last invoices there

    @extend_schema(request=None, responses={
        200: inline_serializer("PortalLink", {"url": serializers.URLField()}),
        503: OpenApiResponse(description="Stripe is not configured here, or could not be reached."),
    })
    def post(self, request):
        if not stripe_sync.is_configured():
            return Response({"detail": "Billing is not configured on this installation."}, status=status.HTTP_503_SERVICE_UNAVAILABLE)
        try:
            url = stripe_sync.create_portal_link(self.organization.pk, return_url=f"{settings.PUBLIC_URL}/console/billing/?from=portal")
        except stripe.StripeError:  # as the console's payment page: Stripe down or refusing is not our 500
            logger.exception("could not create a Stripe portal link for organisation %s", self.organization.pk)
            return Response({"detail": "Stripe could not be reached just now; please try again in a minute."},
                            status=status.HTTP_503_SERVICE_UNAVAILABLE)
        return Response({"url": url})


class StripeWebhookView(APIView):
    """Stripe's calls: verified by the `Stripe-Signature` header, applied once per event id."""

    authentication_classes: list = []
    permission_classes = [AllowAny]

    @extend_schema(exclude=True)
    def post(self, request):
        try:
            applied = handle_stripe_webhook(request.body, request.headers.get("Stripe-Signature"))
        except InvalidWebhook as exc:
            return Response({"detail": f"Invalid webhook: {exc}"}, status=status.HTTP_400_BAD_REQUEST)
        except stripe.StripeError:  # a customer or charge could not be read back: Stripe sends the event again later
            logger.exception("a Stripe webhook could not be applied now")
            return Response({"detail": "Try again later."}, status=status.HTTP_503_SERVICE_UNAVAILABLE,
                            headers={"Retry-After": "60"})
        return Response({"received": True, "duplicate": not applied})
