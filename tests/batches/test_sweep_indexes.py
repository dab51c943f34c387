"""The expiry sweep's reads (`services.sweep_expired_files`, every minute in the beat) go through indexes that bound
them: each organisation's oldest expired files (`file_org_expiring`) and the batches of the last days whose output
files are given their expiry (`batch_output_expiring`), never a scan of every file or every batch (batches/0013)."""

from __future__ import annotations

import io
import re
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from endpoints.batches import services
from endpoints.batches.models import Batch, File
from tests.factories import OrganizationFactory

pytestmark = pytest.mark.django_db(transaction=True)

LINES = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m", "messages": []}}\n'


def _plan(sql: str) -> str:
    with transaction.atomic(), connection.cursor() as cursor:
        # NOTE: on a test's few rows a sequential scan is the cheapest plan whatever the indexes: ruled out, the
        # planner shows what it would use on a large table (without an index, it scans the table all the same).
        cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute(f"EXPLAIN {sql}")
        return "\n".join(row[0] for row in cursor.fetchall())


def _sweep_queries(table: str, *, starting: str) -> list[str]:
    with CaptureQueriesContext(connection) as queries:
        services.sweep_expired_files()
    return [query["sql"] for query in queries if table in query["sql"] and query["sql"].startswith(starting)]


def test_the_sweep_reads_each_organisations_oldest_expired_files_by_an_index_not_every_expired_file(files_bucket):
    # Before: each page numbered every expired, undeleted file of every organisation (a window over all of them) and
    # sorted them: one tenant's backlog of millions of tiny files made each page slow enough to spend the run's budget.
    for organization in (OrganizationFactory(), OrganizationFactory()):
        for n in range(3):
            file = services.create_file(organization_id=organization.pk, purpose="batch", filename=f"{n}.jsonl",
                                        stream=io.BytesIO(LINES), size=len(LINES))
            File.objects.filter(pk=file.pk).update(expires_at=timezone.now() - timedelta(hours=1))

    reads = _sweep_queries(File._meta.db_table, starting="SELECT")
    expiry_reads = [sql for sql in reads if re.search(r'expires_at"? <=', sql)]  # not the files' rows read by id
    assert expiry_reads, reads
    for sql in expiry_reads:
        plan = _plan(sql)
        assert "Seq Scan on batches_file" not in plan and "Disabled" not in plan, plan
        scans = [line for line in plan.splitlines() if "on batches_file" in line]
        assert scans and all("using file_org_expiring on batches_file" in line for line in scans), plan
        # one organisation's files at a time, each scan stopped by its LIMIT
        assert "organization_id = " in plan and "WindowAgg" not in plan.split("Limit")[-1], plan
    assert File.objects.filter(deleted_at__isnull=True).count() == 0  # and every expired file went


def test_the_sweep_gives_output_files_their_expiry_reading_only_recent_batches_by_an_index(files_bucket):
    # Before: `backfill_output_expiry` filtered batches on `created_at` with no index that held it: a scan of every
    # batch ever made, at every run of the sweep (every minute).
    [update] = _sweep_queries(Batch._meta.db_table, starting="UPDATE")
    plan = _plan(update)

    assert "Seq Scan on batches_batch" not in plan and "Disabled" not in plan, plan
    assert "Index Cond: (created_at >= " in plan and ("using batch_output_expiring" in plan
                                                       or "Index Scan on batch_output_expiring" in plan), plan


def test_the_sweeps_walk_of_organisations_skips_deleted_and_unexpiring_files_by_the_index_on_realistic_rows():
    # Before: the walk (the next organisation with a live expiring file, ORDER BY organization_id LIMIT 1) was planned,
    # on a table of realistic rows (the rows of deleted files kept), on the foreign key's index of organization_id,
    # every deleted and unexpiring file read and filtered out at each step: each page read nearly every file ever
    # stored. Planned as is, not with sequential scans ruled out.
    organizations = [OrganizationFactory().pk for _ in range(50)]
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {File._meta.db_table} (id, organization_id, purpose, filename, bytes, s3_key, created_at, "
            "stored_at, deleted_at, expires_at) SELECT 'file-' || g, (%s::bigint[])[1 + g %% 50], 'batch', 'x', 1, "
            "'k' || g, now(), now(), CASE WHEN g %% 5 < 3 THEN now() END, CASE WHEN g %% 7 = 0 THEN NULL "
            "WHEN g %% 11 = 0 THEN now() - interval '1 hour' ELSE now() + interval '1 day' END "
            "FROM generate_series(1, 60000) AS g", [organizations])
        cursor.execute(f"ANALYZE {File._meta.db_table}")
        names = {"files": File._meta.db_table, "batches": Batch._meta.db_table}
        cursor.execute("EXPLAIN " + services._ORGANIZATIONS_WITH_EXPIRED.format(limit=1, **names),
                       {"grace": services.EXPIRED_FILES_GRACE, "open": ["validating", "in_progress"]})
        plan = "\n".join(row[0] for row in cursor.fetchall())

    scans = [line for line in plan.splitlines() if "on batches_file" in line]
    assert len(scans) >= 2 and all("using file_org_expiring on batches_file" in line for line in scans), plan
