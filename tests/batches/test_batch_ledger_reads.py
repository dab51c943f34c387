"""An ended batch's billed but unstored lines are read from the usage ledger through an index: before, a cancel, an
expiry or a failure read the whole ledger, every tenant's rows, by a sequential scan (`batch_id` has no index), and
any tenant could repeat it at will by creating and cancelling batches."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from billing.models import UsageRecord, UsageStatus
from endpoints.batches import runner, services
from endpoints.batches.models import Batch
from tests.factories import EndpointFactory, OrganizationFactory

pytestmark = pytest.mark.django_db


def _usage_row(endpoint, request_id: str, *, batch_id: str, finished_at) -> UsageRecord:
    return UsageRecord.objects.create(
        request_id=request_id, organization_id=endpoint.organization_id, endpoint=endpoint, prompt_tokens=1,
        completion_tokens=1, cost=Decimal("0.000001"), started_at=finished_at, finished_at=finished_at,
        status=UsageStatus.OK, batch_id=batch_id)


def _ledger_queries(batch: Batch, done=frozenset()) -> tuple[set[int], list[str]]:
    with CaptureQueriesContext(connection) as queries:
        lost = services._billed_unstored(batch, done)
    return lost, [query["sql"] for query in queries if UsageRecord._meta.db_table in query["sql"]]


def test_an_ended_batchs_billed_lines_are_read_through_an_index_not_the_whole_ledger():
    endpoint = EndpointFactory(organization=OrganizationFactory())
    batch = Batch(id="batch_scan", organization_id=endpoint.organization_id,
                  in_progress_at=timezone.now() - timedelta(minutes=5))
    _, [sql] = _ledger_queries(batch)

    with connection.cursor() as cursor:
        cursor.execute("SET enable_seqscan = off")  # a plan that still scans the table has no index to use
        try:
            cursor.execute(f"EXPLAIN {sql}")
            plan = "\n".join(row[0] for row in cursor.fetchall())
        finally:
            cursor.execute("SET enable_seqscan = on")
    assert "Seq Scan on billing_usagerecord" not in plan, plan
    assert "Disabled" not in plan, plan
    # the organisation's rows of this batch (`usage_org_batch`), not every row of the organisation in a time range
    [condition] = [line for line in plan.splitlines() if "Index Cond:" in line]
    assert "using usage_org_batch " in plan and "organization_id = " in condition and "batch_id" in condition, plan
    assert "finished_at" not in sql, sql


def test_the_lines_billed_but_unstored_are_still_found_and_only_the_batchs_own():
    endpoint = EndpointFactory(organization=OrganizationFactory())
    other = EndpointFactory(organization=OrganizationFactory())
    started = timezone.now() - timedelta(minutes=5)
    batch = Batch(id="batch_found", organization_id=endpoint.organization_id, in_progress_at=started)
    for index in (0, 1, 2):
        _usage_row(endpoint, runner.line_request_id(batch.pk, index), batch_id=batch.pk, finished_at=started
                   + timedelta(seconds=index))
    # another organisation's row naming the same batch id (it cannot, but the read is the organisation's alone)
    _usage_row(other, runner.line_request_id(batch.pk, 3), batch_id=batch.pk, finished_at=started)

    assert services._billed_unstored(batch, {1}) == {0, 2}


def test_a_batch_that_never_ran_reads_nothing_of_the_ledger():
    endpoint = EndpointFactory(organization=OrganizationFactory())
    batch = Batch(id="batch_never_ran", organization_id=endpoint.organization_id, in_progress_at=None)

    lost, ledger_reads = _ledger_queries(batch)

    assert lost == set() and ledger_reads == []


def test_a_billed_line_is_found_whatever_the_clock_of_the_worker_that_started_the_batch():
    """The batch's start is the validating worker's clock, a row's end the clock of the process that ran the line.
    Before (a review's probe), the read took the organisation's rows from an hour before the batch started: a worker
    61 minutes fast hid a billed line whose result S3 refused (an expiry listed it as never run, a cancel left it out)."""
    endpoint = EndpointFactory(organization=OrganizationFactory())
    now = timezone.now()
    batch = Batch(id="batch_skew", organization_id=endpoint.organization_id, in_progress_at=now + timedelta(minutes=61))
    _usage_row(endpoint, runner.line_request_id(batch.pk, 0), batch_id=batch.pk, finished_at=now)

    assert services._billed_unstored(batch, set()) == {0}
