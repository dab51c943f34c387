"""The credit draw's index (`usage_org_prepaid_recorded`, `billing.ledger.undrawn_prepaid_usage`): an organisation's
prepaid rows by when they reached the ledger, with their cost. Before it, the draw's sum of the organisation's prepaid
cost was a sequential scan of the whole ledger, every organisation's rows, at every draw.

Built CONCURRENTLY: the ledger takes the gateway's usage rows all the time, and a plain CREATE INDEX would stop
them for as long as it builds.
"""

from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [
        ("billing", "0028_usage_lost_recorded_at"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="usagerecord",
            index=models.Index(condition=models.Q(("billing_mode", "prepaid")), fields=["organization", "recorded_at"],
                               include=("cost",), name="usage_org_prepaid_recorded"),
        ),
    ]
