"""`changepassword` as Django's, audited: `user.set_password` (as staff setting one in the admin), with
`command: changepassword`, naming the operating-system account that ran it (`Actor.at_shell`). Before, a password set
from a shell, a staff account's included (whoever sets it may sign in as that account), left no audit event.

NOTE: `controlplane` is listed before `django.contrib.auth` in INSTALLED_APPS so this command replaces Django's.
"""

from __future__ import annotations

import getpass

from django.contrib.auth import get_user_model
from django.contrib.auth.management.commands import changepassword
from django.db import transaction

from controlplane.accounts.services import Actor, record_audit


class Command(changepassword.Command):
    def handle(self, *args, **options):
        # NOTE: the password and its audit event in one transaction (its prompts run in it too: reads only, no lock
        # held), so that no password is set unaudited.
        with transaction.atomic(using=options["database"]):
            result = super().handle(*args, **options)
            username = options["username"] or getpass.getuser()  # as Django's command finds the account
            user_model = get_user_model()
            user = user_model._default_manager.using(options["database"]).get(**{user_model.USERNAME_FIELD: username})
            record_audit(Actor.at_shell(), None, "user.set_password", user, usable=user.has_usable_password(),
                         command="changepassword")
        return result
