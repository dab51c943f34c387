"""The index of rollups held for an operator (`rollup_held`): the push task counts them every minute for the gauge
`inferplane_usage_rollups_held` (`billing.held_rollups`), which read every rollup without it. Built CONCURRENTLY, as
`0029`: pushes and rollups write the table all the time."""

from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [
        ("billing", "0029_usage_org_prepaid_recorded"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="usagerollup",
            index=models.Index(condition=models.Q(("push_held_at__isnull", False)), fields=["push_held_at"],
                               name="rollup_held"),
        ),
    ]
