from django.apps import AppConfig
from django.contrib.admin import apps as admin_apps

# NOTE: connects its `user_logged_in` receiver; it imports no model, so it loads before the app registry is ready.
from controlplane.accounts import staff_sessions  # noqa: F401


class AccountsConfig(AppConfig):
    """Organisations, members, invitations, API keys, plans and the audit log.

    The label stays `controlplane`, from when these models lived in the project package: tables,
    content types and migration history carry over unchanged on existing databases.
    """

    name = "controlplane.accounts"
    label = "controlplane"
    verbose_name = "Accounts and organisations"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        from django.contrib.auth.signals import user_logged_in
        from django.db.models.signals import post_delete, post_save

        from controlplane.accounts.models import Membership
        from controlplane.accounts.organizations import note_handed_on
        from controlplane.accounts.tenancy import choose_first_at_login

        user_logged_in.connect(choose_first_at_login, dispatch_uid="inferplane-choose-first-organization")
        # NOTE: every change of who owns an organisation, whichever path made it (members, invitations, an account's
        # deletion, the admin), stamps when its creator handed it on (`Organization.handed_on_at`).
        post_save.connect(note_handed_on, sender=Membership, dispatch_uid="accounts.membership_saved")
        post_delete.connect(note_handed_on, sender=Membership, dispatch_uid="accounts.membership_deleted")


class StaffAdminConfig(admin_apps.AdminConfig):
    """Django's admin, whose site lets in staff only in a session that passed the second factor."""

    default = False  # NOTE: this module's default is AccountsConfig; the admin's inherited `default = True`
    default_site = "controlplane.accounts.admin_site.StaffAdminSite"
