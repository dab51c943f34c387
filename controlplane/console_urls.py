"""The web console's pages, mounted at /console/ (namespace `console`)."""

from django.urls import path

from billing import views as billing_views
from controlplane.accounts import views as account_views
from endpoints import closing_views
from endpoints import views as endpoint_views
from endpoints.batches import views as batch_views
from endpoints.fleet import pool_views
from endpoints.fleet import views as fleet_views

app_name = "console"

urlpatterns = [
    path("", endpoint_views.dashboard, name="dashboard"),
    path("endpoints/", endpoint_views.endpoint_list, name="endpoints"),
    path("endpoints/live/", endpoint_views.endpoints_live, name="endpoints-live"),
    path("endpoints/new/", endpoint_views.endpoint_new, name="endpoint-new"),
    path("endpoints/quantizations/", endpoint_views.quantization_field, name="endpoint-quantizations"),
    path("endpoints/gpus/", endpoint_views.gpus_field, name="endpoint-gpus"),
    path("endpoints/<uuid:pk>/", endpoint_views.endpoint_detail, name="endpoint"),
    path("endpoints/<uuid:pk>/live/", endpoint_views.endpoint_live, name="endpoint-live"),
    path("endpoints/<uuid:pk>/metrics.json", endpoint_views.endpoint_metrics, name="endpoint-metrics"),
    path("endpoints/<uuid:pk>/edit/", endpoint_views.endpoint_edit, name="endpoint-edit"),
    path("endpoints/<uuid:pk>/pause/", endpoint_views.endpoint_pause, name="endpoint-pause"),
    path("endpoints/<uuid:pk>/resume/", endpoint_views.endpoint_resume, name="endpoint-resume"),
    path("endpoints/<uuid:pk>/delete/", endpoint_views.endpoint_delete, name="endpoint-delete"),
    path("credentials/", endpoint_views.credential_list, name="credentials"),
    path("credentials/<uuid:pk>/", endpoint_views.credential_edit, name="credential-edit"),
    path("credentials/<uuid:pk>/delete/", endpoint_views.credential_delete, name="credential-delete"),
    path("batches/", batch_views.batch_list, name="batches"),
    path("batches/<str:batch_id>/", batch_views.batch_detail, name="batch"),
    path("batches/<str:batch_id>/live/", batch_views.batch_live, name="batch-live"),
    path("batches/<str:batch_id>/cancel/", batch_views.batch_cancel, name="batch-cancel"),
    path("files/<str:file_id>/download/", batch_views.file_download, name="file-download"),
    path("keys/", account_views.api_keys, name="keys"),
    path("keys/<int:pk>/revoke/", account_views.api_key_revoke, name="key-revoke"),
    path("members/", account_views.members, name="members"),
    path("organization/close/", closing_views.organization_close, name="organization-close"),
    path("members/<int:pk>/role/", account_views.member_role, name="member-role"),
    path("members/<int:pk>/remove/", account_views.member_remove, name="member-remove"),
    path("invitations/<int:pk>/revoke/", account_views.invitation_revoke, name="invitation-revoke"),
    path("usage/", billing_views.usage, name="usage"),
    path("billing/", billing_views.billing, name="billing"),
    path("billing/cap/", billing_views.billing_cap, name="billing-cap"),
    path("billing/payment-method/", billing_views.payment_method, name="billing-payment-method"),
    path("fleet/", fleet_views.fleet, name="fleet"),
    path("fleet/live/", fleet_views.fleet_live, name="fleet-live"),
    path("fleet/nodes/<uuid:pk>/state/", fleet_views.node_state, name="node-state"),
    path("fleet/pools/new/", pool_views.pool_new, name="pool-new"),
    path("fleet/pools/<int:pk>/", pool_views.pool_edit, name="pool-edit"),
    path("fleet/pools/<int:pk>/delete/", pool_views.pool_delete, name="pool-delete"),
    path("fleet/join-tokens/", fleet_views.join_token_create, name="join-token-create"),
    path("fleet/join-tokens/<int:pk>/revoke/", fleet_views.join_token_revoke, name="join-token-revoke"),
    path("fleet/join-tokens/<int:pk>/rotate/", fleet_views.join_token_rotate, name="join-token-rotate"),
]
