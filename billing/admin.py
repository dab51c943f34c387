from django.contrib import admin

from billing import quota
from billing.models import BillingAccount, CreditGrant, Invoice, SpendAlert, UsageRollup


@admin.register(BillingAccount)
class BillingAccountAdmin(admin.ModelAdmin):
    list_display = ["organization", "mode", "spend_cap", "stripe_customer_id"]
    search_fields = ["organization__slug", "stripe_customer_id"]


@admin.register(CreditGrant)
class CreditGrantAdmin(admin.ModelAdmin):
    list_display = ["organization", "amount", "consumed", "granted_at", "expires_at", "note"]
    readonly_fields = ["consumed"]

    def save_model(self, request, obj, form, change):
        super().save_model(request, obj, form, change)
        quota.refresh_limits(obj.organization_id)  # the gateway sees the new credit at once


@admin.register(UsageRollup)
class UsageRollupAdmin(admin.ModelAdmin):
    list_display = ["organization", "endpoint", "hour_start", "sequence", "kind", "num_requests", "cost", "closed_at", "pushed_at"]
    list_filter = ["kind"]

    def has_change_permission(self, request, obj=None):
        return False  # NOTE: closed hours never change; corrections are adjustments


@admin.register(Invoice)
class InvoiceAdmin(admin.ModelAdmin):
    list_display = ["organization", "number", "status", "amount_due", "amount_paid", "period_start"]


admin.site.register(SpendAlert)
