"""The credit draw reads an organisation's own prepaid rows through their index (`usage_org_prepaid_recorded`), never
the whole ledger (`billing.ledger.undrawn_prepaid_usage`; the plan on 200,000 rows: bench/explain_credit_draw.py)."""

from datetime import timedelta
from decimal import Decimal

import pytest
from django.db import connection
from django.utils import timezone

from billing import ledger
from billing.models import BillingAccount

pytestmark = pytest.mark.django_db


def _plan(sql: str, params: dict) -> str:
    with connection.cursor() as cursor:
        # NOTE: a test's ledger is tiny, and on it a sequential scan is the cheapest plan whatever the indexes: ruled
        # out, the planner shows what it would use on a large one (without an index, it scans the table all the same).
        cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute("EXPLAIN " + sql, params)
        return "\n".join(row[0] for row in cursor.fetchall())


@pytest.mark.parametrize("drawn_before", [False, True])
def test_the_credit_draw_reads_the_organisations_prepaid_rows_by_their_index(drawn_before):
    # Before billing/0030 the draw's total (every prepaid row of the organisation) had no index that held it: the test
    # saw an Index Scan of `usage_org_endpoint_finished` and the heap (on 200,000 rows, a sequential scan of every
    # organisation's rows), and no `usage_org_prepaid_recorded`.
    account = BillingAccount(organization_id=1, credit_drawn=0,
                             credit_drawn_at=timezone.now() - timedelta(minutes=10) if drawn_before else None)
    since = " AND {}recorded_at >= %(recorded_since)s" if drawn_before else ""
    plan = _plan(ledger._UNDRAWN_BY_MINUTE.format(row_since=since.format("u."), part_since=since.format("")), {
        "drawn": account.credit_drawn, "given_back": Decimal(0), "organization_id": account.organization_id,
        "recorded_since": account.credit_drawn_at})

    assert "Index Only Scan using usage_org_prepaid_recorded" in plan, plan
    # The overcharges given back apart from the usage (billing/0037): their sum from their own partial index.
    assert plan.count("Index Only Scan using usage_org_prepaid_overcharged") == 1, plan
    if drawn_before:
        assert plan.count("usage_org_prepaid_recorded") == 2, plan  # the parts too, by their range of it
