"""`manage.py reset_staff_second_factor <email>`: a staff member lost their authenticator and their recovery
codes, or a new staff account needs its first enrolment code.

Every device of theirs goes, with their recovery codes: sessions they verified lose staff powers at once, and
their next sign-in sets up a new device. It prints the enrolment code (single use, for 30 minutes) that the new
enrolment needs besides the password: hand it over yourself, by a channel that proves who asked (never by email:
a phishing page takes the password and the mailbox together). A verified staff member issues one in the Django
admin instead (Users, "Issue an enrolment code"), which resets nothing. Audited (`staff.second_factor.reset`,
`...enrolment_code.issue`).
"""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from controlplane.accounts.backends import accounts_with_email
from controlplane.accounts.enrolment_codes import ENROLMENT_CODE_TTL, Channel, issue_enrolment_code
from controlplane.accounts.second_factor import reset_second_factor
from controlplane.accounts.services import Actor


class Command(BaseCommand):
    help = ("Remove a staff member's second-factor devices and recovery codes, and print the enrolment code their "
            "next sign-in sets up a new authenticator with.")

    def add_arguments(self, parser):
        parser.add_argument("email", help="the account's email (or exact username)")

    def handle(self, *args, email: str, **options):
        user = get_user_model()._default_manager.filter(username=email).first()
        if user is None:
            matches = list(accounts_with_email(email)[:2])
            if len(matches) != 1:
                raise CommandError(f"No single account has the email {email!r}.")
            user = matches[0]
        operator = Actor.at_shell()  # NOTE: named by the audit events, which named nobody before
        num_devices = reset_second_factor(operator, user)
        code = issue_enrolment_code(operator, user, channel=Channel.OPERATOR)
        self.stdout.write(f"Removed {num_devices} device(s) of {user.email or user.get_username()}: "
                          "their next sign-in sets up a new authenticator with this enrolment code "
                          f"(once, within {int(ENROLMENT_CODE_TTL.total_seconds() // 60)} minutes):\n{code}")
