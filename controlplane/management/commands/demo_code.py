"""`manage.py demo_code`: the code the demo admin's authenticator would show now.

Staff pass a second factor (a TOTP code) after the password; `make run` seeds the demo admin with a device
whose key it keeps in `.data/demo.json`, so the first hour needs no phone. Only the demo's own key: a
deployment has no `demo.json`, and a real staff member's codes come from their own authenticator.
"""

from __future__ import annotations

import json

from django.core.management.base import BaseCommand, CommandError

from controlplane import embedded
from controlplane.demo import DEMO_EMAIL, current_code


class Command(BaseCommand):
    help = "Print the demo admin's current second-factor code (from the data folder's demo.json)."

    def handle(self, *args, **options):
        secrets_file = embedded.data_dir() / "demo.json"
        totp_key = json.loads(secrets_file.read_text()).get("totp_key") if secrets_file.exists() else None
        if not totp_key:
            raise CommandError(f"No demo authenticator in {secrets_file}: `make run` seeds one.")
        code, seconds_left = current_code(totp_key)
        self.stdout.write(code)
        self.stderr.write(f"{DEMO_EMAIL}'s code, for {seconds_left} s more; each code signs in once, "
                          "so a second sign-in takes the next one.")
