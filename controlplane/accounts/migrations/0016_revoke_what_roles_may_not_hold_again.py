"""Migration 0014 again: what web pods of the code before it still made while it rolled out is revoked now.

0014 revoked, once, the keys and pending invitations their creators' roles may not make. A rolling deploy runs it
first, while pods of the code before it serve for minutes: a demotion or removal on one of those revoked nothing, so
a member demoted (or removed) then kept their `manage`, priority and high-limit keys and their invitations for good,
0014 having run. The same rules (0014's own function: a migration never imports code that changes later) applied to
what exists now; nothing is revoked twice (each revocation is conditional on the row being live)."""

import importlib

from django.db import migrations

_0014 = importlib.import_module("controlplane.accounts.migrations.0014_revoke_what_roles_may_not_hold")


class Migration(migrations.Migration):
    dependencies = [("controlplane", "0015_database_defaults_for_older_code")]

    operations = [
        migrations.RunPython(_0014.revoke_what_roles_may_not_hold, migrations.RunPython.noop),
    ]
