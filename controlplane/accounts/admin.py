"""The Django admin for accounts and organisations: staff look, the services change. Users staff create
here count as verified; plans (quotas) and which plan each organisation is on are saved through the
services that audit (`save_plan`, `set_organization_plan`).

Users that staff create here count as verified; deactivating one revokes every key they created
(`keys.revoke_api_keys_of`) and every invitation they sent that is still pending (`members.revoke_invitations_sent_by`),
as removing a member does. Deleting one (its page, or the list's bulk delete) is the account's own deletion
(`departures.end_account`, the endpoints app's `closing.end_account`): refused while it is the only owner of an open
organisation others or live resources depend on, otherwise its row kept, deactivated and tombstoned. Everything else is
read-only: organisations,
members, keys and the audit log change only through the services the API and console use
(a key is revoked with the "Revoke" action, which calls `revoke_api_key`). A staff account without an
authenticator gets its enrolment code from the users' "Issue an enrolment code" action
(`second_factor.issue_staff_enrolment_code`), shown once to the staff member who issued it; authenticators and
recovery codes (django-otp's devices) are only shown.

Who may sign in and with what powers is audited as staff change it (`user.create`, `user.update`, `user.set_password`,
`group.*`), naming them, and a change page shown before a change made since saves nothing (`stale_edits`).
"""

import json

from django import forms
from django.conf import settings
from django.contrib import admin, messages
from django.contrib.admin.actions import delete_selected as django_delete_selected
from django.contrib.admin.utils import unquote
from django.contrib.auth import admin as auth_admin
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.core.exceptions import ValidationError
from django.core.serializers.json import DjangoJSONEncoder
from django.db import transaction
from django.http import HttpResponseRedirect
from django.template.response import TemplateResponse
from django.utils.safestring import SafeString, mark_safe
from django.utils.text import capfirst
from django_otp.plugins.otp_static.admin import StaticDeviceAdmin
from django_otp.plugins.otp_static.models import StaticDevice
from django_otp.plugins.otp_totp.admin import TOTPDeviceAdmin
from django_otp.plugins.otp_totp.models import TOTPDevice

from controlplane.accounts import departures
from controlplane.accounts.backends import normalize_email
from controlplane.accounts.enrolment_codes import ENROLMENT_CODE_TTL
from controlplane.accounts.erasure import ADDRESS_CHANGE, is_erased
from controlplane.accounts.keys import revoke_api_key, revoke_api_keys_of
from controlplane.accounts.members import revoke_invitations_sent_by
from controlplane.accounts.models import ApiKey, AuditEvent, Organization, Plan, lock_person
from controlplane.accounts.second_factor import (
    EnrolmentCodeRefused,
    has_staff_powers,
    issue_staff_enrolment_code,
)
from controlplane.accounts.services import (
    PLAN_FIELDS,
    REPLICA_QUOTA_FIELDS,
    Actor,
    Drains,
    drains_of_organization_plan,
    drains_of_plan_change,
    record_audit,
    save_plan,
    set_organization_plan,
)
from controlplane.accounts.signup import mark_email_verified
from controlplane.accounts.stale_edits import LocksEditedRow, RefusesStaleEdits, StaleEditsRefusedForm
from controlplane.text import shown_name

User = get_user_model()

ERASED_ACCOUNT = ("This account was deleted: its page is read-only, and nothing sent from it was saved (its address "
                  "and name stay erased).")


class AccountErased(ValueError):
    """A change of a deleted account, which stays as its deletion left it (`erasure.is_erased`)."""


class UserChangeForm(RefusesStaleEdits, auth_admin.UserChangeForm):
    def clean_email(self):
        # NOTE: stored as sign-up and invitations store it (`backends.normalize_email`), its length checked so:
        # a typed address that lengthens once lowered was a 500 at its verification's insert (`mark_email_verified`).
        # NOTE: only an address staff change: one stored before `normalize_email` refused format characters (a
        # direction override in its domain) was refused on every save of its user, who could not be deactivated.
        if "email" not in self.changed_data:
            return self.cleaned_data["email"]
        return normalize_email(self.cleaned_data["email"])


def _shown_escaped(response):
    """A page of the user admin with each character `shown_name` refuses escaped, once it is rendered."""
    if isinstance(response, TemplateResponse):
        def escape(rendered):
            rendered.content = shown_name(rendered.content.decode(rendered.charset)).encode(rendered.charset)
        response.add_post_render_callback(escape)
    return response


# What a user may do here, audited when staff change it (`user.update`).
USER_POWERS = ("is_active", "is_staff", "is_superuser", "groups", "user_permissions")


def _power_shown(value) -> bool | list[str]:
    """A power as audited: a flag as it is, groups and permissions by their names, sorted."""
    return value if isinstance(value, bool) else sorted(str(item) for item in value or ())


class UserAdmin(LocksEditedRow, auth_admin.UserAdmin):
    form = UserChangeForm
    # NOTE: facts, not settings: each sign-in changes `last_login`, which a page shown before it posted back as it was
    # (and, judged against the row, refused as changed since: `stale_edits`).
    readonly_fields = ["last_login", "date_joined"]
    actions = ["issue_enrolment_code", "delete_selected"]
    # NOTE: an address (an account's username is its address) stored before `normalize_email` refused format
    # characters is listed escaped (`text.shown_name`): its direction override reordered the list for staff
    list_display = ["username_shown", "email_shown", "first_name", "last_name", "is_staff"]

    @admin.display(description="username", ordering="username")
    def username_shown(self, user) -> str:
        return shown_name(user.username)

    @admin.display(description="email address", ordering="email")
    def email_shown(self, user) -> str:
        return shown_name(user.email)

    # NOTE: the user's name (`str(user)`, its username) in its page's heading and window title, and its history's,
    # escaped as in the list (the breadcrumbs: templates/admin/auth/user/): a direction override in one stored before
    # `normalize_email` refused it showed staff another name.
    def render_change_form(self, request, context, add=False, change=False, form_url="", obj=None):
        if obj is not None:
            context["subtitle"] = shown_name(str(obj))
        return super().render_change_form(request, context, add=add, change=change, form_url=form_url, obj=obj)

    def history_view(self, request, object_id, extra_context=None):
        user = self.get_object(request, unquote(object_id))
        shown = {"title": f"Change history: {shown_name(str(user))}"} if user is not None else {}
        return super().history_view(request, object_id, {**shown, **(extra_context or {})})

    # NOTE: and its password and delete pages (their headings, window titles, breadcrumbs, the objects a delete takes),
    # and the messages after a change or a delete ('The user "..." was deleted'), which showed it raw after the pages
    # above escaped it (the review of 6e92b978). Escaped as a whole: `shown_name` changes only the characters it
    # refuses, into `\u202e` (no markup), and neither page has a field whose value holds the name.
    # NOTE: and audited (`user.set_password`, in the password's own transaction): staff who set a tenant's password may
    # sign in as them; before, only the admin's own history said so.
    def user_change_password(self, request, id, form_url=""):
        with transaction.atomic():
            response = super().user_change_password(request, id, form_url)
            if request.method == "POST" and response.status_code == 302:
                user = self.get_object(request, unquote(id))
                record_audit(Actor.from_request(request), None, "user.set_password", user,
                             usable=user.has_usable_password())
        return _shown_escaped(response)

    def render_delete_form(self, request, context):
        return _shown_escaped(super().render_delete_form(request, context))

    def message_user(self, request, message, *args, **kwargs):
        shown = shown_name(str(message))
        return super().message_user(request, mark_safe(shown) if isinstance(message, SafeString) else shown,
                                    *args, **kwargs)

    # NOTE: a deleted account's page is read-only (`erasure.is_erased`: its row is kept, tombstoned), its password
    # page refused: a change form opened before the deletion and saved after it wrote the person's address and name
    # back over the tombstone, and made the account active again (its password could then be reset at that address).
    def has_change_permission(self, request, obj=None):
        return (obj is None or not is_erased(obj)) and super().has_change_permission(request, obj)

    def change_view(self, request, object_id, form_url="", extra_context=None):
        # NOTE: a form sent for a deleted account says why it is not saved, where Django's answer is a bare 403
        if request.method == "POST" and (user := self.get_object(request, unquote(object_id))) is not None \
                and is_erased(user):
            return self._refuse_erased(request)
        try:
            return super().change_view(request, object_id, form_url, extra_context)
        except AccountErased:  # NOTE: out of the view's transaction: nothing of the form was saved
            return self._refuse_erased(request)

    def _refuse_erased(self, request):
        self.message_user(request, ERASED_ACCOUNT, messages.ERROR)
        return HttpResponseRedirect(request.path)

    def save_model(self, request, obj, form, change):
        if change:
            # NOTE: the account's row held and read again, as its deletion holds it (`models.lock_person`): a
            # deletion that committed after this page's form was read is seen here, and nothing is written.
            if (current := lock_person(obj.pk)) is not None and is_erased(current):
                raise AccountErased(ERASED_ACCOUNT)
        super().save_model(request, obj, form, change)
        # NOTE: who may sign in, and with what powers (staff, superuser, groups, permissions), audited as staff change
        # it: before, an account made staff or superuser here, or reactivated, left no audit event.
        actor = Actor.from_request(request)
        if not change:
            record_audit(actor, None, "user.create", obj)
        elif powers := {name: {"from": _power_shown(form.initial.get(name)), "to": _power_shown(form.cleaned_data[name])}
                        for name in USER_POWERS if name in form.changed_data}:
            record_audit(actor, None, "user.update", obj, changes=powers)
        # NOTE: the addresses an account had before staff changed them, for its erasure (`erasure.addresses_of`): the
        # records copied them as text and nothing else remembered them, so a deleted account left them in its
        # organisations' audit logs (`organization.create`'s owner, `member.add`'s target).
        if change and (former := {field: form.initial.get(field) for field in ("username", "email")
                                   if field in form.changed_data and form.initial.get(field)}):
            record_audit(actor, None, ADDRESS_CHANGE, obj, **former)
        # NOTE: staff vouch for the address they type; only self-service sign-ups must prove theirs.
        if obj.email and (not change or "email" in form.changed_data):
            mark_email_verified(obj)
        # NOTE: an inactive creator's keys and invitations are refused, and would work again with the account: they
        # end with it.
        if change and "is_active" in form.changed_data and not obj.is_active:
            _revoke_what_they_made(request, obj, reason="user.deactivate")

    # NOTE: staff delete an account as its owner does (`departures.end_account`, `endpoints.closing.end_account`): the
    # same rule (refused while it is the only owner of an open organisation others or live resources depend on) and
    # the same work (memberships ended, keys and invitations revoked, records erased, the row kept, deactivated and
    # tombstoned). Before, the row's delete left such an organisation with no owner, for ever, and the audit log's
    # events lost their actor. The confirmation pages (this one and the list's bulk delete) show why it is refused,
    # and confirm nothing then; a refusal that arises meanwhile is judged again under the organisations' locks.
    def get_deleted_objects(self, objs, request):
        users = list(objs)
        refusals = [*_staff_refusals(request, users),
                    *(reason for user in users for reason in departures.account_deletion_refusals(user))]
        return [f"{capfirst(self.opts.verbose_name)}: {user}" for user in users], {
            self.opts.verbose_name_plural: len(users)}, set(), refusals

    def delete_view(self, request, object_id, extra_context=None):
        try:
            return super().delete_view(request, object_id, extra_context)
        except departures.AccountDeletionRefused as exc:  # NOTE: out of the view's transaction: its log entry too
            self.message_user(request, str(exc), messages.ERROR)
            return HttpResponseRedirect(request.path)

    def delete_model(self, request, obj):
        # NOTE: judged again with the active superusers' rows held: two superusers deleting each other at once each
        # saw the other remain on their page, and the platform was left with none
        if refusals := _staff_refusals(request, [obj], locked=True):
            raise departures.AccountDeletionRefused(refusals)
        departures.end_account(Actor.platform_staff(request), obj)

    # NOTE: every account in the one transaction the action runs in (`delete_selected`): one refused, none goes. The
    # active superusers' rows first, then the accounts', all of them, in one order, before any organisation's
    # (`models.lock_person`), as a single delete takes them (`delete_model`): taking the accounts' first, a bulk delete
    # and a single delete of two superusers at once each waited on the other and PostgreSQL failed one (a 500).
    def delete_queryset(self, request, queryset):
        if refusals := _staff_refusals(request, list(queryset), locked=True):
            raise departures.AccountDeletionRefused(refusals)
        for user_id in sorted(queryset.values_list("pk", flat=True)):
            lock_person(user_id)
        for user in queryset.order_by("pk"):
            self.delete_model(request, user)

    @admin.action(description="Delete selected users", permissions=["delete"])
    def delete_selected(self, request, queryset):
        """Django's bulk delete (its confirmation page), in one transaction with its log entries."""
        try:
            with transaction.atomic():
                return _shown_escaped(django_delete_selected(self, request, queryset))
        except departures.AccountDeletionRefused as exc:
            self.message_user(request, str(exc), messages.ERROR)
            return None

    @admin.action(description="Issue an enrolment code (staff accounts without an authenticator)",
                  permissions=["issue_enrolment_code"])
    def issue_enrolment_code(self, request, queryset):
        """Shows each selected staff account's new enrolment code, once: the issuer hands it over themselves."""
        actor = Actor.from_request(request)
        issued = []
        for user in queryset.order_by("pk"):
            try:
                issued.append((user, issue_staff_enrolment_code(actor, user)))
            except EnrolmentCodeRefused as exc:
                self.message_user(request, str(exc), messages.WARNING)
                continue
            self.log_change(request, user, "Issued a second-factor enrolment code")
        if not issued:
            return None
        # NOTE: the codes are in this answer only (no-store, as every page); a message would keep them in the
        # session.
        return TemplateResponse(request, "controlplane/enrolment_codes_issued.html", {
            **self.admin_site.each_context(request),
            "title": "Enrolment codes",
            "issued": issued,
            "ttl_min": int(ENROLMENT_CODE_TTL.total_seconds() // 60),
        })

    def has_issue_enrolment_code_permission(self, request):
        # NOTE: whoever may change accounts, in a session past their own second factor (as the admin site asks).
        return has_staff_powers(request.user) and self.has_change_permission(request)


def _staff_refusals(request, users, *, locked: bool = False) -> list[str]:
    """Why staff may not delete `users` here whatever their organisations: one of them is the staff member's own account
    (they would end their own session and powers mid-way, and a lone operator left the admin to no one), or the
    delete would leave no active staff superuser (the admin needs both flags; nobody was left to grant staff powers
    but a shell on the servers).
    `locked`: the active superusers' rows are held first (in a transaction), as the delete itself judges."""
    refusals = []
    if any(user.pk == request.user.pk for user in users):
        refusals.append(f"{request.user} is your own account: another staff member must delete it.")
    superusers = get_user_model().objects.filter(is_superuser=True, is_staff=True, is_active=True).order_by("pk")
    if locked:
        superusers = superusers.select_for_update()
    remaining = set(superusers.values_list("pk", flat=True))
    deleted = {user.pk for user in users}
    if remaining & deleted and not remaining - deleted:
        refusals.append("No active superuser would remain (an active staff account that is a superuser): make "
                        "another account one first.")
    return refusals


def _revoke_what_they_made(request, user, *, reason: str) -> None:
    """The keys a deactivated `user` created and the invitations they sent that are still pending, in every
    organisation: refused while the account is inactive, they would work again with it."""
    actor = Actor.platform_staff(request)
    revoke_api_keys_of(actor, user, reason=reason)
    revoke_invitations_sent_by(actor, user, reason=reason)


admin.site.unregister(User)
admin.site.register(User, UserAdmin)


class AuditedGroupAdmin(LocksEditedRow, auth_admin.GroupAdmin):
    """Django's groups, their permissions audited as staff change them: a group's members hold its permissions in the
    admin, so a permission added to a group was a power given, with no audit event."""

    form = StaleEditsRefusedForm

    def save_related(self, request, form, formsets, change):
        group = form.instance
        before = _power_shown(group.permissions.all()) if change else []
        super().save_related(request, form, formsets, change)
        after = _power_shown(group.permissions.all())
        if not change or before != after or "name" in form.changed_data:
            record_audit(Actor.from_request(request), None, "group.update" if change else "group.create", group,
                         permissions={"from": before, "to": after})

    def delete_model(self, request, obj):
        record_audit(Actor.from_request(request), None, "group.delete", obj,
                     permissions=_power_shown(obj.permissions.all()))
        super().delete_model(request, obj)

    def delete_queryset(self, request, queryset):
        for group in queryset:
            self.delete_model(request, group)


admin.site.unregister(Group)
admin.site.register(Group, AuditedGroupAdmin)


class ViewOnly:
    """An admin mixin: staff look, and add, change or delete nothing."""

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


class _DevicesOnlyShown(ViewOnly):
    """NOTE: staff's authenticators and recovery codes change only through `second_factor` (an enrolment with a code
    issued out of band, an operator's reset) and `recovery_codes`, which audit. django-otp's own admin let any staff
    member add a confirmed device with a key of their choosing to any account (another staff member's, an account
    about to be made staff), move a device to another account, clear its throttling or delete it, with no audit
    event: a second factor set up past the enrolment codes."""


class StaffTOTPDeviceAdmin(_DevicesOnlyShown, TOTPDeviceAdmin):
    """Staff's authenticator apps, shown (never their keys: `OTP_ADMIN_HIDE_SENSITIVE_DATA`)."""


class StaffStaticDeviceAdmin(_DevicesOnlyShown, StaticDeviceAdmin):
    """Staff's recovery codes' devices, shown (never their codes' digests: `OTP_ADMIN_HIDE_SENSITIVE_DATA`)."""


for device_model, device_admin in ((TOTPDevice, StaffTOTPDeviceAdmin), (StaticDevice, StaffStaticDeviceAdmin)):
    admin.site.unregister(device_model)  # NOTE: registered by django-otp's admin modules, imported above
    admin.site.register(device_model, device_admin)


class ReadOnlyAdmin(ViewOnly, admin.ModelAdmin):
    """Staff look; the services change. Every field shown, none editable, no add or delete.

    NOTE: a name a tenant set (`shown_names`) is shown through the admin's `<field>_shown` method, escaped as the console
    shows it (`text.shown_name`): one stored before the name rule kept its direction override in the lists and on the
    pages, another key's or organisation's name to staff."""

    shown_names: tuple[str, ...] = ()

    def get_readonly_fields(self, request, obj=None):
        return [f"{field.name}_shown" if field.name in self.shown_names else field.name for field in self.model._meta.fields]

    def get_exclude(self, request, obj=None):
        excluded = super().get_exclude(request, obj)
        if not self.shown_names:
            return excluded  # NOTE: None still lets a custom form's Meta.exclude count (`ModelAdmin.get_form`)
        return [*(excluded or ()), *self.shown_names]


class ConfirmsDrains(StaleEditsRefusedForm):
    """A change form whose save may put organisations past their plan's replicas or GPUs: staff are shown what it drains
    (`drains`) and save it only once they confirm it (`confirm_drain`), on a second submit of the page that showed it
    (`drains_shown`). A save that drains nothing needs no confirmation.

    NOTE: judged in the admin's change view under the edited row's lock (`LocksEditedRow`), as the stale edits are: a
    mistyped plan (`max_replicas` 0, a GPU type's limit dropped) took every tenant on it toward zero within a minute.
    NOTE: a box ticked on a page that did not show what the save drains, or showed less than it drains now (the fleet
    grew since), confirms nothing: the page comes back with what it drains now, unticked."""

    confirm_drain = forms.BooleanField(
        required=False, label="Confirm the drain",
        help_text="Needed only where the change stops replicas; the page says how many once saved. They drain one at a "
                  "time, newest first, after INFERPLANE_QUOTA_DRAIN_GRACE_S, unless the plan is raised back before.")
    drains_shown = forms.CharField(required=False, widget=forms.HiddenInput)
    confirmed_drains: Drains | None = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for name in ("confirm_drain", "drains_shown"):
            self.fields[name].show_hidden_initial = False  # NOTE: no stored value to be judged stale

    def drains(self) -> Drains:
        raise NotImplementedError

    def clean(self):
        cleaned = super().clean()
        if self.errors:
            return cleaned
        drains = self.drains()
        if drains and not (cleaned.get("confirm_drain") and cleaned.get("drains_shown") == str(drains)):
            self.data = self.data.copy()  # the page shown again says what was shown, unticked
            self.data["drains_shown"] = str(drains)
            self.data.pop("confirm_drain", None)
            self.add_error("confirm_drain", f"This change stops {drains} past the new limits, "
                                            f"{int(settings.QUOTA_DRAIN_GRACE_S)} s after it is saved: check "
                                            "“Confirm the drain” and save again to make it.")
        self.confirmed_drains = drains or None
        return cleaned


class PlanForm(ConfirmsDrains):
    def drains(self) -> Drains:
        if self.instance.pk is None or not set(self.changed_data) & set(REPLICA_QUOTA_FIELDS):
            return Drains()
        edited = Plan(**{name: self.cleaned_data.get(name, getattr(self.instance, name)) for name in PLAN_FIELDS})
        try:
            edited.clean()
        except ValidationError:
            # NOTE: the plan's own check runs after this form's (`_post_clean`) and refuses it on the page: its numbers
            # read here first (`quotas`) were a 500
            return Drains()
        return drains_of_plan_change(self.instance, edited.quotas)


class OrganizationForm(ConfirmsDrains):
    def drains(self) -> Drains:
        if "plan" not in self.changed_data:
            return Drains()
        return drains_of_organization_plan(self.instance, self.cleaned_data.get("plan"))


@admin.register(Plan)
class PlanAdmin(LocksEditedRow, admin.ModelAdmin):
    form = PlanForm
    list_display = ["name", "max_endpoints", "max_replicas", "max_min_replicas", "max_held_requests", "max_file_bytes",
                    "max_gpus_by_type"]
    fields = ["name", "max_endpoints", "max_replicas", "max_min_replicas", "max_held_requests", "max_file_bytes",
              "max_gpus_by_type", "confirm_drain", "drains_shown"]

    def save_model(self, request, obj, form, change):
        save_plan(Actor.from_request(request), obj, confirmed_drains=form.confirmed_drains)

    def has_delete_permission(self, request, obj=None):
        return False  # an organisation on it would be left without; move them first (PROTECT)


@admin.register(Organization)
class OrganizationAdmin(LocksEditedRow, ReadOnlyAdmin):
    form = OrganizationForm
    list_display = ["slug", "name_shown", "plan", "created_at"]
    shown_names = ("name",)
    list_filter = ["plan"]
    search_fields = ["slug", "name"]
    list_select_related = ["plan"]

    @admin.display(description="name", ordering="name")
    def name_shown(self, organization) -> str:
        return shown_name(organization.name)

    @admin.display(description="members")
    def member_list(self, organization) -> str:
        return ", ".join(f"{shown_name(m.user.email)} ({m.role})" for m in organization.memberships.select_related("user"))

    # NOTE: staff change the plan only (through the audited service); the rest is the owners'.
    def get_readonly_fields(self, request, obj=None):
        return [*(name for name in super().get_readonly_fields(request, obj) if name != "plan"), "member_list"]

    def has_change_permission(self, request, obj=None):
        return admin.ModelAdmin.has_change_permission(self, request, obj)

    def save_model(self, request, obj, form, change):
        if "plan" in form.changed_data:
            set_organization_plan(Actor.from_request(request), obj, obj.plan, confirmed_drains=form.confirmed_drains)


@admin.register(ApiKey)
class ApiKeyAdmin(ReadOnlyAdmin):
    list_display = ["name_shown", "organization", "created_by_shown", "created_at", "expires_at", "revoked_at",
                    "last_used_at"]
    list_filter = [("revoked_at", admin.EmptyFieldListFilter)]
    search_fields = ["name", "organization__slug", "created_by__email"]
    list_select_related = ["organization", "created_by"]
    exclude = ["digest"]
    actions = ["revoke"]
    shown_names = ("name",)

    def get_readonly_fields(self, request, obj=None):
        return [name for name in super().get_readonly_fields(request, obj) if name != "digest"]

    @admin.display(description="name", ordering="name")
    def name_shown(self, key) -> str:
        return shown_name(key.name)

    @admin.display(description="created by", ordering="created_by__username")
    def created_by_shown(self, key) -> str:  # NOTE: as `AuditEventAdmin.actor_shown`
        return shown_name(str(key.created_by)) if key.created_by is not None else "-"

    # NOTE: `permissions` is what makes Django ask `has_revoke_permission`: without it any staff member who may
    # view keys could revoke every tenant's.
    @admin.action(description="Revoke selected API keys", permissions=["revoke"])
    def revoke(self, request, queryset):
        # NOTE: staff act as the platform (no membership), named by the audit log.
        actor = Actor.platform_staff(request)
        num_revoked = 0
        for api_key in queryset.filter(revoked_at__isnull=True).select_related("organization"):
            revoke_api_key(actor, api_key)
            self.log_change(request, api_key, "Revoked")
            num_revoked += 1
        self.message_user(request, f"Revoked {num_revoked} API key(s).", messages.SUCCESS)

    def has_revoke_permission(self, request):
        return request.user.is_superuser


@admin.register(AuditEvent)
class AuditEventAdmin(ReadOnlyAdmin):
    list_display = ["created_at", "action", "organization", "actor_shown", "target_repr_shown", "source_ip"]
    shown_names = ("actor", "target_repr", "details")
    list_filter = ["action"]
    search_fields = ["action", "target_repr", "organization__slug", "actor__email"]
    list_select_related = ["organization", "actor"]
    date_hierarchy = "created_at"

    @admin.display(description="target repr", ordering="target_repr")
    def target_repr_shown(self, event) -> str:
        # NOTE: one recorded before `ApiKey.__str__` escaped a key's name kept its direction override
        return shown_name(event.target_repr)

    # NOTE: an account's address (its username too) stored before `normalize_email` refused format characters kept its
    # direction override here, as in the event's details (an accepted invitation's `email`, an organisation's `owner`),
    # which the API shows escaped (`serializers.AuditEventSerializer`).
    @admin.display(description="actor", ordering="actor__username")
    def actor_shown(self, event) -> str:
        return shown_name(str(event.actor)) if event.actor is not None else "-"

    @admin.display(description="details")
    def details_shown(self, event) -> str:
        # NOTE: Django's JSON, hidden characters then escaped as JSON escapes them (`\u202e`): still the same JSON
        return shown_name(json.dumps(event.details, ensure_ascii=False, cls=DjangoJSONEncoder))
