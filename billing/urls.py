"""The billing and usage part of the management API, and Stripe's webhook."""

from django.urls import path

from billing import api

urlpatterns = [
    path("usage/", api.UsageView.as_view(), name="usage"),
    path("usage/export.csv", api.UsageExportView.as_view(), name="usage-export"),
    path("billing/", api.BillingView.as_view(), name="billing"),
    path("billing/keys/<int:key_id>/", api.KeySpendCapView.as_view(), name="billing-key-cap"),
    path("billing/portal/", api.PortalLinkView.as_view(), name="billing-portal"),
    path("billing/stripe/webhook", api.StripeWebhookView.as_view(), name="stripe-webhook"),
]
