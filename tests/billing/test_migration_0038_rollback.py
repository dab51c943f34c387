"""billing/0038 (the spend alert's kind, in its claim's uniqueness) reversed by a rollback to the release before, whose
constraint holds one alert per threshold and amount whatever the kind (README, *A rolling deploy*)."""

from decimal import Decimal

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.utils import timezone

from billing.models import SpendAlert
from billing.standing import ORG_CAP, SPEND_CEILING_STAFF
from tests.factories import OrganizationFactory

BEFORE = ("billing", "0037_credit_given_back_and_unpaid")
AFTER = ("billing", "0038_spend_alert_limit_reason")


def _migrate(target) -> None:
    executor = MigrationExecutor(connection)
    executor.migrate([target])


@pytest.mark.django_db(transaction=True)
def test_a_rollback_keeps_one_of_the_alerts_of_two_kinds_at_one_amount_and_migrates_forward_again():
    # Without the reverse step, the rollback stopped at the old constraint (IntegrityError: the two rows it refuses).
    organization = OrganizationFactory()
    period_start = timezone.now().replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    for reason in (SPEND_CEILING_STAFF, ORG_CAP):
        SpendAlert.objects.create(organization=organization, period_start=period_start, threshold_percent=100,
                                  spend=Decimal("10"), spend_cap=Decimal("8"), limit_reason=reason)
    try:
        _migrate(BEFORE)
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM billing_spendalert WHERE organization_id = %s", [organization.pk])
            assert cursor.fetchone() == (1,)
    finally:
        # NOTE: forward to billing's latest, not to AFTER: stopped there, every later migration (0039's grant kind) was
        # left unapplied for the tests after it on this database
        _migrate(AFTER)
        executor = MigrationExecutor(connection)
        executor.migrate([node for node in executor.loader.graph.leaf_nodes() if node[0] == "billing"])
    assert SpendAlert.objects.filter(organization=organization).count() == 1
