"""Migration 0028 again: what pods of the code before it still wrote while it rolled out is scrubbed now.

0028 took the fleet's free memory out of the events and statuses tenants read. A rolling deploy runs it first, while
pods of the code before it serve for minutes (workers and the agent API's handlers, beat not waiting at all): their
placement and wake reasons still said "the most free on a l4 node is 1024 MB", kept in the events for good (they are
never pruned), 0028 having run. The same rewrites (0028's own function: a migration never imports code that changes
later) applied to what exists now; non-atomic as 0028, and run over rows already scrubbed it changes nothing.

NOTE: a repeat helps only in a release after the first run's (README, *What a release may assume of the version
before it*): shipped in the same one, it runs in the same `migrate` Job, before the older pods are gone.
"""

import importlib

from django.db import migrations

_0028 = importlib.import_module("endpoints.migrations.0028_scrub_fleet_memory_from_tenant_reasons")


class Migration(migrations.Migration):
    atomic = False  # 0028's batches, each a short transaction of its own

    dependencies = [
        ('endpoints', '0028_scrub_fleet_memory_from_tenant_reasons'),
    ]

    operations = [
        migrations.RunPython(_0028.scrub_fleet_memory, migrations.RunPython.noop),
    ]
