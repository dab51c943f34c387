"""EXPLAIN of the credit draw's read (`billing.ledger.undrawn_prepaid_usage`) on a realistic ledger: `--rows` usage rows
(200,000 by default) across `--organizations` organisations, half of them the largest one's, prepaid and postpaid
mixed, recorded over 90 days; the draw of the largest organisation, last drawn 10 minutes ago.

    INFERPLANE_DATA_DIR=/tmp/explain .venv/bin/python bench/explain_credit_draw.py [--rows 200000] [--without-index]

Seeds the ledger of the database it runs against once (not the test suite's: run it against a scratch data folder).
`--without-index` runs the same in a transaction that drops `usage_org_prepaid_recorded` first and is rolled back:
the plan as it was before that index (`billing/0030`). The record is in that migration's commit message.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta

import django

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
django.setup()

from django.db import connection, transaction  # noqa: E402
from django.utils import timezone  # noqa: E402

from billing import ledger  # noqa: E402
from billing.models import BillingAccount, BillingMode, UsageRecord  # noqa: E402
from controlplane.accounts.models import Organization  # noqa: E402
from endpoints.models import Endpoint  # noqa: E402

SEED_MARK = "explain-credit-draw-"


def seed(num_rows: int, num_organizations: int) -> int:
    """The largest organisation's id, seeding the ledger first if it has no rows of this script."""
    if UsageRecord.objects.filter(request_id__startswith=SEED_MARK).exists():
        return Organization.objects.get(slug=f"{SEED_MARK}0").pk
    from tests.factories import EndpointFactory

    endpoints = [EndpointFactory(organization=Organization.objects.create(name=f"Explain {n}", slug=f"{SEED_MARK}{n}"))
                 for n in range(num_organizations)]
    with connection.cursor() as cursor:
        # Half the rows are the first organisation's, the rest spread over the others; every third row postpaid.
        cursor.execute(f"""
            INSERT INTO {UsageRecord._meta.db_table} (request_id, organization_id, endpoint_id, replica_id, prompt_tokens,
                cached_tokens, completion_tokens, cost, billing_mode, started_at, finished_at, status, cold_start_s,
                batch_id, adapter, recorded_at)
            SELECT %(mark)s || n, e.organization_id, e.id, '', 100, 0, 50, 0.000125,
                   CASE WHEN n %% 3 = 0 THEN %(postpaid)s ELSE %(prepaid)s END,
                   t - interval '2 seconds', t, 'ok', 0, '', '', t
            FROM generate_series(1, %(rows)s) n
            CROSS JOIN LATERAL (SELECT now() - (interval '90 days') * (1 - n::float / %(rows)s) AS t) times
            JOIN (SELECT array_position(%(endpoints)s, id) - 1 AS k, id, organization_id
                  FROM {Endpoint._meta.db_table} WHERE id = ANY(%(endpoints)s)) e
              ON e.k = CASE WHEN n %% 2 = 0 THEN 0 ELSE 1 + n %% (%(orgs)s - 1) END
        """, {"mark": SEED_MARK, "rows": num_rows, "orgs": num_organizations, "prepaid": BillingMode.PREPAID,
              "postpaid": BillingMode.POSTPAID, "endpoints": [endpoint.pk for endpoint in endpoints]})
        cursor.execute(f"VACUUM ANALYZE {UsageRecord._meta.db_table}")
    return endpoints[0].organization_id


def explain(organization_id: int) -> None:
    account = BillingAccount.objects.for_organization(organization_id)
    account.credit_drawn_at = timezone.now() - timedelta(minutes=10)
    account.credit_drawn = ledger.undrawn_prepaid_spend(account) - UsageRecord.objects.filter(
        organization_id=organization_id, billing_mode=BillingMode.PREPAID,
        recorded_at__gte=account.credit_drawn_at).count() * ledger.Decimal("0.000125")
    recorded_since = account.credit_drawn_at - ledger.RECORDED_AT_MARGIN
    since = " AND {}recorded_at >= %(recorded_since)s"
    sql = ledger._UNDRAWN_BY_MINUTE.format(row_since=since.format("u."), part_since=since.format(""))
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN (ANALYZE, BUFFERS) " + sql, {
            "drawn": account.credit_drawn, "given_back": account.credit_given_back, "organization_id": organization_id,
            "recorded_since": recorded_since})
        print("\n".join(row[0] for row in cursor.fetchall()))
    print("undrawn:", ledger.undrawn_prepaid_usage(account).amount)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--organizations", type=int, default=20)
    parser.add_argument("--without-index", action="store_true")
    args = parser.parse_args()
    organization_id = seed(args.rows, args.organizations)
    if not args.without_index:
        explain(organization_id)
        return
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("DROP INDEX IF EXISTS usage_org_prepaid_recorded")
        explain(organization_id)
        transaction.set_rollback(True)


if __name__ == "__main__":
    main()
