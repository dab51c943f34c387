"""Staff pages for billing. Caps, billing modes and credit change only through `billing.services`
and `billing.credits`, as in the API: each change is audited and the gateway's limits refreshed."""

from decimal import Decimal, InvalidOperation

import stripe
from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin import widgets as admin_widgets
from django.template.response import TemplateResponse

from billing import credits, services, standing, stripe_sync
from billing.models import BillingAccount, CreditGrant, CreditKind, Dispute, Invoice, SpendAlert, UsageRollup
from billing.serializers import MAX_SPEND_CAP
from controlplane.accounts.admin import ReadOnlyAdmin
from controlplane.accounts.services import Actor
from controlplane.accounts.stale_edits import LocksEditedRow, RefusesStaleEdits

NO_CEILING = "none"


class SpendCeilingField(forms.CharField):
    """Staff's spending ceiling: empty (the one its paid history gives), an amount in USD, or "none"."""

    def clean(self, value):
        value = super().clean(value).strip().lower()
        if value in ("", NO_CEILING):
            return value
        try:
            amount = Decimal(value)
        except InvalidOperation:
            raise forms.ValidationError('Enter an amount in USD, "none" or nothing.') from None
        if not amount.is_finite() or amount < 0 or amount > MAX_SPEND_CAP or amount != amount.quantize(Decimal("0.01")):
            raise forms.ValidationError(f"Enter an amount from 0 to {MAX_SPEND_CAP} with at most two decimal places.")
        return amount


class BillingAccountForm(RefusesStaleEdits, forms.ModelForm):
    spend_cap = forms.DecimalField(required=False, min_value=Decimal(0), max_value=MAX_SPEND_CAP, decimal_places=2,
                                   help_text="Monthly hard cap in USD; empty for none.")
    spend_ceiling = SpendCeilingField(
        required=False, label="Spending ceiling (staff)",
        help_text='Monthly ceiling in USD in place of the one its paid history gives; "none" for no ceiling; empty: '
                  "its paid history's (INFERPLANE_SPEND_CEILINGS). Audited; the gateway sees it at once.")

    class Meta:
        model = BillingAccount
        fields = ["mode", "spend_cap", "spend_ceiling", "invoiced_without_card"]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        account = self.instance
        if account.spend_cap is not None:
            # NOTE: shown with the field's two places (a cap has no more: `SpendCapSerializer`). The column's nine
            # ("500.000000000") were refused at the page's next save, "no more than 2 decimal places": no other field
            # of an account with a cap could be saved without the cap typed again.
            self.initial["spend_cap"] = account.spend_cap.quantize(Decimal("0.01"))
        if account.staff_lifted_spend_ceiling:
            self.initial["spend_ceiling"] = NO_CEILING
        elif account.staff_spend_ceiling is not None:
            self.initial["spend_ceiling"] = f"{account.staff_spend_ceiling:.2f}"


class CreditGrantForm(forms.ModelForm):
    amount = forms.DecimalField(min_value=Decimal("0.01"), decimal_places=9)
    # NOTE: blank, the grant starts now by PostgreSQL's clock (`credits.grant_credits`), the one the credit figure judges
    # it by. The model's default filled it with the web pod's own now as the form was shown, posted back as it was: a
    # grant through a web pod 10 minutes ahead was "not yet granted" for 10 minutes (the prepaid organisation 402).
    granted_at = forms.SplitDateTimeField(required=False, widget=admin_widgets.AdminSplitDateTime,
                                          help_text="Leave blank to grant it now.")
    # NOTE: purchased unless staff say otherwise: a close is refused while purchased credit remains and forfeits
    # promotional credit (`endpoints.closing`), so a grant of unknown kind is kept as the customer's money.
    kind = forms.ChoiceField(choices=CreditKind.choices, required=False, initial=CreditKind.PURCHASED,
                             help_text="Purchased: the customer paid for it (refunded by support at a close). "
                                       "Promotional: given by us (forfeited at a close).")

    def clean_kind(self):
        return self.cleaned_data.get("kind") or CreditKind.PURCHASED

    def clean_organization(self):
        # NOTE: `credits.grant_credits` refuses it too, under the organisation's lock (a close racing the grant)
        organization = self.cleaned_data.get("organization")
        if organization is not None and organization.closed_at is not None:
            raise forms.ValidationError("This organisation is closed: credit granted to it is nobody's to use.")
        return organization

    class Meta:
        model = CreditGrant
        fields = ["organization", "amount", "kind", "granted_at", "expires_at", "note"]


class HeldDifferenceForm(forms.Form):
    """What Stripe has of each event a rollup held as a duplicate names (`stripe_sync.send_held_difference`)."""

    def __init__(self, *args, rollup: UsageRollup, meters: list, **kwargs):
        super().__init__(*args, **kwargs)
        self.meters = meters
        for meter in meters:
            self.fields[meter.event_name] = forms.IntegerField(
                min_value=-stripe_sync.MAX_METER_EVENT_VALUE, max_value=stripe_sync.MAX_METER_EVENT_VALUE,
                label=f"Stripe's value of {stripe_sync.meter_event_identifier(rollup, meter.event_name)}",
                help_text=f"The ledger's: {getattr(rollup, meter.rollup_field)}. 0 if Stripe has no such event; "
                          "negative as Stripe shows it (an adjustment that lowers its meter).")

    stripe_customer_id = forms.CharField(
        required=False, max_length=64, label="The Stripe customer those events are on",
        help_text="As Stripe shows it (cus_…); may be empty only if Stripe has none of them. It must be the "
                  "organisation's customer now.")
    pending_in_stripe = forms.TypedChoiceField(
        required=False, label="Only when asked: does Stripe have the difference event named above?",
        choices=[("", "not asked"), ("yes", "yes: record it as sent"), ("no", "no: send it")],
        coerce=lambda answer: {"yes": True, "no": False}.get(answer), empty_value=None)

    def stripe_has(self) -> dict[str, int]:
        return {meter.event_name: self.cleaned_data[meter.event_name] for meter in self.meters}


class AbandonDifferenceForm(forms.Form):
    """The operator's answer to `stripe_sync.abandon_held_difference`'s question, when it asks."""

    difference_in_stripe = forms.TypedChoiceField(
        required=False, label="Only when asked: does Stripe have the difference event named above?",
        choices=[("", "not asked"), ("yes", "yes"), ("no", "no: none of this rollup's difference events")],
        coerce=lambda answer: {"yes": True, "no": False}.get(answer), empty_value=None)


@admin.register(BillingAccount)
class BillingAccountAdmin(LocksEditedRow, admin.ModelAdmin):
    form = BillingAccountForm
    list_display = ["organization", "mode", "spend_cap", "payment_method_on_file", "past_due_since", "hold_reason",
                    "stripe_customer_id"]
    list_filter = ["mode", "payment_method_on_file", "invoiced_without_card"]
    search_fields = ["organization__slug", "stripe_customer_id", "=card_fingerprint"]  # a card's organisations
    fields = ["organization", "mode", "spend_cap", "spend_ceiling", "spend_ceiling_in_effect", "payment_method_on_file",
              "card_fingerprint", "invoiced_without_card", "past_due_since", "hold_reason", "stripe_customer_id",
              "stripe_subscription_id", "credit_drawn", "created_at"]
    readonly_fields = ["organization", "spend_ceiling_in_effect", "payment_method_on_file", "card_fingerprint",
                       "past_due_since", "hold_reason", "stripe_customer_id", "stripe_subscription_id", "credit_drawn",
                       "created_at"]

    @admin.display(description="Spending ceiling in effect")
    def spend_ceiling_in_effect(self, obj) -> str:
        ceiling = standing.spend_ceiling(obj)
        if ceiling is None:
            return "none applies (prepaid, invoiced without card, or no Stripe)"
        amount = "no ceiling" if ceiling.amount is None else f"${ceiling.amount:,.2f} a month"
        source = "set by staff" if ceiling.source == standing.STAFF else "from its paid history"
        if not ceiling.num_other_organizations_on_card:
            return f"{amount}, {source} (paid ${ceiling.paid:,.2f} net)"
        room = "" if ceiling.room is None else f"; ${ceiling.room:,.2f} left to it"
        return (f"{amount}, {source} (paid ${ceiling.paid:,.2f} net with the organisations of its card one of its "
                f"owners owns too, ${ceiling.paid_by_itself:,.2f} by itself; its card held this month by "
                f"{ceiling.num_other_organizations_on_card} other organisation(s), which spent "
                f"${ceiling.spent_by_others:,.2f}{room})")

    def has_add_permission(self, request):
        return False  # NOTE: an organisation's account is made when first needed (`BillingAccount.objects.for_organization`)

    def has_delete_permission(self, request, obj=None):
        return False

    def save_model(self, request, obj, form, change):
        actor = Actor.from_request(request)
        if "spend_cap" in form.changed_data:
            services.set_spend_cap(actor, obj.organization, spend_cap=form.cleaned_data["spend_cap"])
        if "spend_ceiling" in form.changed_data:
            ceiling = form.cleaned_data["spend_ceiling"]
            services.set_spend_ceiling(actor, obj.organization, ceiling=ceiling if isinstance(ceiling, Decimal) else None,
                                       lifted=ceiling == NO_CEILING)
        if "mode" in form.changed_data:
            services.set_billing_mode(actor, obj.organization, mode=form.cleaned_data["mode"])
        if "invoiced_without_card" in form.changed_data:
            services.set_invoiced_without_card(actor, obj.organization, allowed=form.cleaned_data["invoiced_without_card"])


@admin.register(CreditGrant)
class CreditGrantAdmin(admin.ModelAdmin):
    form = CreditGrantForm
    list_display = ["organization", "amount", "kind", "consumed", "granted_at", "expires_at", "note"]
    fields = ["organization", "amount", "kind", "granted_at", "expires_at", "note", "consumed"]
    readonly_fields = ["consumed"]

    def has_change_permission(self, request, obj=None):
        return obj is None  # NOTE: a grant is added, never edited: credit already drawn stays drawn

    actions = ["end_refunded"]

    @admin.action(description="End the selected grants: what they hold was refunded to the customer (in Stripe)",
                  permissions=["add"])
    def end_refunded(self, request, queryset):
        ended = credits.end_refunded_grants(Actor.from_request(request), list(queryset))
        self.message_user(request, f"Ended {queryset.count()} grant(s), {ended:.2f} USD of credit.", messages.SUCCESS)

    def has_delete_permission(self, request, obj=None):
        return False

    def save_model(self, request, obj, form, change):
        grant = credits.grant_credits(Actor.from_request(request), obj.organization, amount=obj.amount,
                                      expires_at=obj.expires_at, note=obj.note, granted_at=obj.granted_at,
                                      kind=obj.kind)
        obj.pk = grant.pk  # the admin's redirect and message name the grant the service made


@admin.register(UsageRollup)
class UsageRollupAdmin(admin.ModelAdmin):
    list_display = ["organization", "endpoint", "hour_start", "billing_mode", "sequence", "kind", "num_requests", "cost",
                    "closed_at", "pushed_at", "push_held_at", "push_error"]
    list_filter = ["kind", "billing_mode", ("push_held_at", admin.EmptyFieldListFilter)]
    actions = ["release_held", "confirm_held", "send_held_as_new", "send_held_difference", "abandon_held_difference",
               "send_held_again", "keep_held"]

    def has_add_permission(self, request):
        return False  # NOTE: made by the rollups alone; one added here was pushed to Stripe and billed

    def has_change_permission(self, request, obj=None):
        return False  # NOTE: closed hours never change; corrections are adjustments

    def has_delete_permission(self, request, obj=None):
        return False  # NOTE: the sum over an hour's rollups is the ledger's; the next run made a deleted one again

    @admin.action(description="Held: Stripe does NOT have the meter event named in its push error: send it again",
                  permissions=["release_held"])
    def release_held(self, request, queryset):
        in_difference = sorted(queryset.filter(push_held_at__isnull=False, difference_started_at__isnull=False)
                               .values_list("pk", flat=True))
        for rollup in queryset.filter(push_held_at__isnull=False, difference_started_at__isnull=True):
            self.log_change(request, rollup, "Released a held Stripe push")
        num_released = stripe_sync.release_held(queryset, actor=Actor.from_request(request))
        self.message_user(request, f"Released {num_released} held rollup(s).", messages.SUCCESS)
        if in_difference:
            self._refused_in_difference(request, in_difference, "released")

    def _refused_in_difference(self, request, pks: list[int], verb: str) -> None:
        """The one message for held rollups an action left alone because a "send the difference" has begun on them."""
        self.message_user(request, f"Rollups {pks} were NOT {verb}: a \"send the difference\" has begun on them; "
                                   "finish it (the same values again), or abandon it if it sent nothing.",
                          messages.ERROR)

    @admin.action(description="Held: Stripe HAS the meter event named in its push error: record it, push the rest",
                  permissions=["confirm_held"])
    def confirm_held(self, request, queryset):
        held = list(queryset.filter(push_held_at__isnull=False, pushed_at__isnull=True))
        num_confirmed = stripe_sync.confirm_held(queryset, actor=Actor.from_request(request))
        confirmed = set(queryset.filter(pk__in=[rollup.pk for rollup in held], push_held_at__isnull=True)
                        .values_list("pk", flat=True))
        for rollup in held:
            if rollup.pk in confirmed:
                self.log_change(request, rollup, "Confirmed a held Stripe meter event as in Stripe")
        self.message_user(request, f"Confirmed the held event of {num_confirmed} rollup(s).", messages.SUCCESS)
        in_difference = sorted(rollup.pk for rollup in held if rollup.difference_started_at is not None)
        if in_difference:
            self._refused_in_difference(request, in_difference, "confirmed")
        skipped = sorted(rollup.pk for rollup in held if rollup.pk not in confirmed and rollup.pk not in in_difference)
        if skipped:
            self.message_user(request, f"Rollups {skipped} were not confirmed: their push error names no meter event "
                                       "Stripe may have (held for an invoice line whose price cannot be told). Nothing "
                                       "of them was sent; send them again once Stripe can tell.", messages.ERROR)

    @admin.action(description="Held as a duplicate: Stripe has LESS than its push error names; you cancelled its "
                              "events in Stripe: send it again under new identifiers", permissions=["release_held"])
    def send_held_as_new(self, request, queryset):
        held = list(queryset.filter(push_held_at__isnull=False, pushed_at__isnull=True))
        too_late = sorted(stripe_sync.held_past_cancel_window(queryset).values_list("pk", flat=True))
        in_difference = sorted(rollup.pk for rollup in held
                               if rollup.difference_started_at is not None and rollup.pk not in too_late)
        num_sent = stripe_sync.send_held_as_new(queryset, actor=Actor.from_request(request))
        for rollup in UsageRollup.objects.filter(pk__in=[rollup.pk for rollup in held], push_held_at__isnull=True):
            self.log_change(request, rollup, "Sent a rollup held as a duplicate again under new identifiers")
        self.message_user(request, f"Sent {num_sent} held rollup(s) again as new events.", messages.SUCCESS)
        if too_late:
            hours = int(stripe_sync.METER_EVENT_CANCEL_WINDOW.total_seconds() // 3600)
            self.message_user(request, f"Rollups {too_late} were NOT sent: their hour ended over {hours} hours ago, "
                                       f"and Stripe may have received their events as early as that, so it may no "
                                       "longer cancel them; sent whole, they would bill what Stripe has twice. Use "
                                       "\"send the difference\" instead, with what Stripe has of each event.",
                              messages.ERROR)
        if in_difference:
            self._refused_in_difference(request, in_difference, "sent")

    @admin.action(description="Held as a duplicate: Stripe has LESS than its push error names and its events stay: "
                              "send the difference (enter Stripe's values)", permissions=["release_held"])
    def send_held_difference(self, request, queryset):
        """An intermediate page: what Stripe has of each event the rollup's hold names, then
        `stripe_sync.send_held_difference`; one rollup at a time."""
        held = list(stripe_sync.held_as_duplicate(queryset)[:2])
        if len(held) != 1 or queryset.count() != 1:
            self.message_user(request, "Select exactly one rollup held as a duplicate to send its difference.",
                              messages.ERROR)
            return None
        [rollup] = held
        meters = stripe_sync.held_difference_meters(rollup)
        form = HeldDifferenceForm(request.POST if "apply" in request.POST else None, rollup=rollup, meters=meters)
        if form.is_valid():
            try:
                marked = stripe_sync.send_held_difference(
                    Actor.from_request(request), rollup.pk, form.stripe_has(),
                    stripe_customer_id=form.cleaned_data["stripe_customer_id"],
                    pending_in_stripe=form.cleaned_data["pending_in_stripe"])
            except stripe_sync.DifferenceRefused as refused:
                form.add_error(None, str(refused))
            except stripe.StripeError as exc:
                form.add_error(None, f"Stripe failed ({exc.__class__.__name__}: {exc}); what was sent is recorded: "
                                     "submit again, with the same values, to send the rest")
            else:
                if not marked:
                    # NOTE: another run marked it first (it recorded and audited its own); before, this showed success.
                    self.message_user(request, f"Rollup {rollup.pk} was NOT marked by this run: another run sent its "
                                               "difference or it was released first. Look at its audit log.",
                                      messages.ERROR)
                    return None
                self.log_change(request, rollup, "Sent the difference of a rollup held as a duplicate")
                self.message_user(request, f"Sent the difference of rollup {rollup.pk}; it is pushed.",
                                  messages.SUCCESS)
                return None
        return TemplateResponse(request, "billing/send_held_difference.html", {
            **self.admin_site.each_context(request), "title": "Send the difference to Stripe", "rollup": rollup,
            "form": form, "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME, "opts": self.model._meta})

    @admin.action(description="Held as a duplicate, a \"send the difference\" begun that sent nothing (a value "
                              "entered wrong, its customer changed): abandon it", permissions=["release_held"])
    def abandon_held_difference(self, request, queryset):
        """An intermediate page, for the operator's answer when asked; `stripe_sync.abandon_held_difference`; one
        rollup at a time."""
        begun = list(queryset.filter(difference_started_at__isnull=False, pushed_at__isnull=True)[:2])
        if len(begun) != 1 or queryset.count() != 1:
            self.message_user(request, "Select exactly one rollup a \"send the difference\" has begun on.",
                              messages.ERROR)
            return None
        [rollup] = begun
        form = AbandonDifferenceForm(request.POST if "apply" in request.POST else None)
        if form.is_valid():
            try:
                abandoned = stripe_sync.abandon_held_difference(
                    Actor.from_request(request), rollup.pk,
                    difference_in_stripe=form.cleaned_data["difference_in_stripe"])
            except stripe_sync.DifferenceRefused as refused:
                form.add_error(None, str(refused))
            else:
                if not abandoned:
                    self.message_user(request, f"Rollup {rollup.pk} had no \"send the difference\" begun any more "
                                               "(finished or abandoned since). Look at its audit log.", messages.ERROR)
                    return None
                self.log_change(request, rollup, "Abandoned the \"send the difference\" begun on a held rollup")
                self.message_user(request, f"Abandoned the difference of rollup {rollup.pk}; it is still held: "
                                           "send the difference with the right values, or another held action.",
                                  messages.SUCCESS)
                return None
        return TemplateResponse(request, "billing/abandon_held_difference.html", {
            **self.admin_site.each_context(request), "title": "Abandon the difference", "rollup": rollup,
            "pending": rollup.difference_pending, "form": form, "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
            "opts": self.model._meta})

    @admin.action(description="Held for an operator (its customer deleted): NOT billed by that customer's invoices: "
                              "send it to the organisation's customer of now", permissions=["release_held"])
    def send_held_again(self, request, queryset):
        try:
            num_again = services.send_held_again(Actor.from_request(request), queryset)
        except services.WaitingForFinalInvoice as refused:
            self.message_user(request, str(refused), messages.ERROR)
            return
        self.message_user(request, f"Sent {num_again} held rollup(s) again.", messages.SUCCESS)

    @admin.action(description="Held for an operator (its customer deleted): billed by that customer's invoices, or "
                              "written off by staff: keep it, send nothing", permissions=["release_held"])
    def keep_held(self, request, queryset):
        num_kept = services.keep_held(Actor.from_request(request), queryset)
        self.message_user(request, f"Kept {num_kept} held rollup(s) as billed.", messages.SUCCESS)

    def has_release_held_permission(self, request):
        return request.user.is_superuser

    def has_confirm_held_permission(self, request):
        return request.user.is_superuser


@admin.register(Invoice)
class InvoiceAdmin(admin.ModelAdmin):
    list_display = ["organization", "number", "status", "amount_due", "amount_paid", "period_start"]

    # NOTE: Stripe's invoices as its webhooks last told them; they decide an organisation's payment standing
    # (`billing.standing`). Edited here, one marked paid lifted a past-due hold and one marked uncollectible held an
    # organisation, with no audit event. Corrections are made in Stripe and come back by webhook.
    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(Dispute)
class DisputeAdmin(admin.ModelAdmin):
    """Disputed payments as Stripe's webhooks mirror them; an open or lost one stops its organisation's inference
    (`billing.standing`). The one change staff make is to lift a hold, audited, through `billing.services`."""

    list_display = ["organization", "stripe_dispute_id", "status", "reason", "amount", "currency", "disputed_at",
                    "hold_lifted_at", "hold_lifted_by"]
    list_filter = ["status", ("hold_lifted_at", admin.EmptyFieldListFilter)]
    search_fields = ["organization__slug", "stripe_dispute_id", "stripe_charge_id"]
    actions = ["lift_hold"]

    def has_add_permission(self, request):
        return False  # NOTE: only Stripe's webhooks make them

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

    @admin.action(description="Settled with the organisation (a lost dispute repaid, say): lift its hold on inference",
                  permissions=["lift_hold"])
    def lift_hold(self, request, queryset):
        actor = Actor.from_request(request)
        lifted = 0
        for dispute in queryset.filter(hold_lifted_at__isnull=True):
            services.lift_dispute_hold(actor, dispute)
            self.log_change(request, dispute, "Lifted its hold on inference")
            lifted += 1
        self.message_user(request, f"Lifted the hold of {lifted} dispute(s).", messages.SUCCESS)

    def has_lift_hold_permission(self, request):
        return request.user.is_superuser


@admin.register(SpendAlert)
class SpendAlertAdmin(ReadOnlyAdmin):
    """The alerts sent: one per threshold and period (edited or deleted here, one was suppressed or sent twice)."""

    list_display = ["organization", "period_start", "threshold_percent", "spend", "spend_cap", "sent_at"]
