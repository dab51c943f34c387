"""Two indexes, both built CONCURRENTLY: the ledger takes the gateway's usage rows, and pushes and rollups write the
rollups, all the time, and a plain CREATE INDEX would stop those writes for as long as it builds.

- `usage_org_prepaid_recorded`, the credit draw's (`billing.ledger.undrawn_prepaid_usage`): an organisation's prepaid
  rows by when they reached the ledger, with their cost. Before it, the draw's sum of the organisation's prepaid cost
  was a sequential scan of the whole ledger, every organisation's rows, at every draw.
- `rollup_held`, the rollups held for an operator: the push task counts them every minute for the gauge
  `inferplane_usage_rollups_held` (`billing.held_rollups`), which read every rollup without it.
"""

from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [
        ("billing", "0029_spend_ceiling"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="usagerecord",
            index=models.Index(condition=models.Q(("billing_mode", "prepaid")), fields=["organization", "recorded_at"],
                               include=("cost",), name="usage_org_prepaid_recorded"),
        ),
        AddIndexConcurrently(
            model_name="usagerollup",
            index=models.Index(condition=models.Q(("push_held_at__isnull", False)), fields=["push_held_at"],
                               name="rollup_held"),
        ),
    ]
