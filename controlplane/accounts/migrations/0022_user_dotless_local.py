"""`auth_user_dotless_local`: accounts by their address's local part without its sub-address and dots, for the accounts
one Gmail mailbox reaches (`organizations.same_mailbox`, which reads it through `organizations.dotless_local`, the same
expression to the letter: another one finds nothing by it).

NOTE: Gmail ignores a local part's dots: `a.da@gmail.com` is `ada@gmail.com`'s inbox, and each spelling had its own
allowance without a card. Without the index, each write of an organisation's limits whose person is at Gmail read every
account. Built CONCURRENTLY (`controlplane.migration_indexes`): sign-ups go on meanwhile. Django's own table, so no
model state: the index is the database's alone.
"""

from django.db import migrations

from controlplane.migration_indexes import built_concurrently

_INDEXES = {
    "auth_user_dotless_local": """((replace(split_part(split_part("username", '@', 1), '+', 1), '.', '')))""",
}


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [
        ("controlplane", "0021_mark_staff_audit_events"),
        ("auth", "0012_alter_user_first_name_max_length"),
    ]

    operations = [
        # NOTE: the database's alone, as 0019's are within theirs: no model of ours has the index
        migrations.SeparateDatabaseAndState(database_operations=built_concurrently("auth_user", _INDEXES)),
    ]
