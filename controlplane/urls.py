"""The project's URLs: the management API (`/api/v1/`), its schema and docs, the agents' API
(`/agent/v1/`), the console, the admin, health probes. `/v1/` and `/metrics` never reach Django
(the gateway, `controlplane.asgi`, serves them ahead of it), except `/v1/files` and `/v1/batches`,
which the gateway hands over (`endpoints.batches.api`)."""

from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path
from drf_spectacular.views import SpectacularSwaggerSplitView
from rest_framework.routers import DefaultRouter

from controlplane import health
from controlplane.accounts import api as accounts_api
from controlplane.accounts import views
from controlplane.accounts.forms import PasswordResetForm
from controlplane.schema_view import CachedSchemaView
from endpoints import api as endpoints_api
from endpoints import closing_views
from endpoints.fleet import pool_api

# NOTE: no `.json` format-suffix routes: the schema documents none, and each custom action (`pause`, `revoke`, `events`,
# a member's PATCH, ...) answered one with a 500, its method taking no `format` argument. `?format=` still chooses.
# NOTE: and no root view (`/api/v1/`), which the schema does not document either: it listed every registered route to
# any key, the staff-only `fleet/pools` included, which answers everyone else a 404 as if it did not exist.
router = DefaultRouter(trailing_slash=True)
router.include_format_suffixes = False
router.include_root_view = False
router.register("endpoints", endpoints_api.EndpointViewSet, basename="endpoint")
router.register("credentials", endpoints_api.CredentialViewSet, basename="credential")
router.register("keys", accounts_api.ApiKeyViewSet, basename="api-key")
router.register("members", accounts_api.MembershipViewSet, basename="member")
router.register("invitations", accounts_api.InvitationViewSet, basename="invitation")
router.register("audit-log", accounts_api.AuditEventViewSet, basename="audit-event")
router.register("fleet/pools", pool_api.NodePoolViewSet, basename="node-pool")

api_v1 = [
    path("organization/", accounts_api.current_organization, name="current-organization"),
    path("organization/close/", closing_views.CloseOrganizationView.as_view(), name="organization-close"),
    path("organizations/", accounts_api.create_organization, name="organizations"),
    path("account/delete/", closing_views.DeleteAccountView.as_view(), name="account-delete"),
    path("quotas/", endpoints_api.quotas, name="quotas"),
    path("endpoints/<uuid:endpoint_pk>/adapters/",
         endpoints_api.AdapterViewSet.as_view({"get": "list", "post": "create"}), name="adapter-list"),
    path("endpoints/<uuid:endpoint_pk>/adapters/<uuid:pk>/",
         endpoints_api.AdapterViewSet.as_view({"get": "retrieve", "delete": "destroy"}), name="adapter-detail"),
    path("", include("billing.urls")),
    path("", include(router.urls)),
]

handler404 = "controlplane.accounts.api.not_found"
handler500 = "controlplane.database_unavailable.server_error"

urlpatterns = [
    path("healthz", health.healthz, name="healthz"),
    path("readyz", health.readyz, name="readyz"),
    path("api/v1/", include(api_v1)),
    path("agent/v1/", include("endpoints.fleet.urls")),
    path("v1/", include("endpoints.batches.urls")),
    path("api/schema/", CachedSchemaView.as_view(), name="schema"),
    # NOTE: the split view: Swagger UI's start-up script from `?script`, as a file of our own origin. The plain view
    # starts it with an inline script, which the Content-Security-Policy refuses: the page was blank in any browser.
    # Its page's inline <style> is a stylesheet of ours (`controlplane/api_docs.html`), as the policy wants too.
    path("api/docs/", SpectacularSwaggerSplitView.as_view(url_name="schema", template_name="controlplane/api_docs.html"),
         name="api-docs"),
    path("", views.home, name="home"),
    path("signup/", views.signup, name="signup"),
    path("signup/done/", views.signup_done, name="signup-done"),
    path("verify-email/", views.verify_email, name="verify-email"),
    path("verify-email/resend/", views.verify_email_resend, name="verify-email-resend"),
    path("verify-email/<str:token>/", views.verify_email_confirm, name="verify-email-confirm"),
    path("invitations/<str:token>/", views.invitation, name="invitation"),
    path("login/", views.LoginView.as_view(), name="login"),
    path("login/code/", views.second_factor_verify, name="second-factor"),
    path("login/code/enrol/", views.second_factor_enrol, name="second-factor-enrol"),
    path("login/code/recovery/", views.second_factor_recovery, name="second-factor-recovery"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    # NOTE: an address without an account is mailed too (`PasswordResetForm`): the answer's time tells nobody which.
    path("password-reset/", auth_views.PasswordResetView.as_view(form_class=PasswordResetForm), name="password_reset"),
    path("password-reset/done/", auth_views.PasswordResetDoneView.as_view(), name="password_reset_done"),
    # NOTE: a forgotten password's reset revokes the keys of an account whose address its owner never confirmed.
    path("reset/<uidb64>/<token>/", views.PasswordResetConfirmView.as_view(), name="password_reset_confirm"),
    path("reset/done/", auth_views.PasswordResetCompleteView.as_view(), name="password_reset_complete"),
    # NOTE: changing the password ends every other session (the session hash), keeping this one.
    path("password-change/", auth_views.PasswordChangeView.as_view(), name="password_change"),
    path("password-change/done/", auth_views.PasswordChangeDoneView.as_view(), name="password_change_done"),
    path("org/switch/", views.switch_organization, name="switch-organization"),
    path("org/new/", views.new_organization, name="new-organization"),
    path("account/delete/", closing_views.account_delete, name="account-delete"),
    path("console/", include("controlplane.console_urls")),
    path("django-admin/", admin.site.urls),
]
