"""`createsuperuser` that knows accounts by email: it asks for the email first and uses it as the
username unless one is given (`--username`, `DJANGO_SUPERUSER_USERNAME`). Whatever the username,
the account logs in to the console with its email (`controlplane.accounts.backends.EmailBackend`).

NOTE: `controlplane` is listed before `django.contrib.auth` in INSTALLED_APPS so this command
replaces Django's.

Audited (`user.create`, `command: createsuperuser`), naming the operating-system account that ran it (`Actor.at_shell`).
"""

from __future__ import annotations

import os

from django.contrib.auth.management.commands import createsuperuser
from django.core import exceptions
from django.core.management.base import CommandError
from django.db import transaction

from controlplane.accounts.backends import email_in_use, normalize_email
from controlplane.accounts.services import Actor, record_audit
from controlplane.accounts.signup import mark_email_verified


class Command(createsuperuser.Command):
    help = "Create a staff superuser known by its email (the username defaults to the email)."

    def handle(self, *args, **options):
        username_field = self.UserModel.USERNAME_FIELD
        email = options.get("email") or os.environ.get("DJANGO_SUPERUSER_EMAIL")
        if options["interactive"] and not email and self._can_prompt():
            email = self._ask_email()
        if not email:
            raise CommandError("An email is required: accounts log in with it (--email or DJANGO_SUPERUSER_EMAIL).")
        email = self._clean_email(email)
        options["email"] = email
        if not options.get(username_field) and not os.environ.get(f"DJANGO_SUPERUSER_{username_field.upper()}"):
            options[username_field] = email
        # NOTE: the account, its verification and its audit event in one transaction: a command killed between them
        # left a staff account that no audit event names. (Its prompts run in it too: reads only, no lock held.)
        with transaction.atomic(using=options["database"]):
            result = super().handle(*args, **options)
            user = self.UserModel._default_manager.db_manager(options["database"]).get(email=email)
            # NOTE: an operator names this address: confirmed by its owner, so the account stays verified (and its
            # first reset keeps its keys) if it is ever no longer staff.
            mark_email_verified(user)
            # NOTE: a staff superuser made from a shell is audited as one made in the admin (`user.create`), its actor
            # the operating-system account that ran the command (`Actor.at_shell`): before, it left no audit event.
            record_audit(Actor.at_shell(), None, "user.create", user, command="createsuperuser",
                         is_staff=user.is_staff, is_superuser=user.is_superuser)
        return result

    def _can_prompt(self) -> bool:
        return hasattr(self.stdin, "isatty") and self.stdin.isatty()

    def _ask_email(self) -> str:
        field = self.UserModel._meta.get_field("email")
        while True:
            value = (self.get_input_data(field, "Email address: ") or "").strip()
            try:
                return self._clean_email(value)
            except CommandError as exc:
                self.stderr.write(f"Error: {exc}")

    def _clean_email(self, value: str) -> str:
        field = self.UserModel._meta.get_field("email")
        try:
            email = normalize_email(field.clean(value.strip(), None), max_length=field.max_length)
        except exceptions.ValidationError as exc:
            raise CommandError("; ".join(exc.messages)) from None
        if not email:
            raise CommandError("The email cannot be blank: accounts log in with it.")
        if email_in_use(email):
            raise CommandError(f"An account with the email {email} already exists.")
        return email
