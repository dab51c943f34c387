"""Billing: usage rows written per second through the ledger service, and rollup time for a million rows.

Runs on the embedded PostgreSQL of the test data folder, in a throwaway database
(`inferplane_bench_billing`, dropped afterwards). Measures:
  * `record_usage`, one request per call (one INSERT … ON CONFLICT and commit each): the gateway's path;
  * `record_usage` from 8 threads at once (concurrent gateway requests share commits);
  * `arecord_usage` from 64 concurrent coroutines (what the async gateway does; they share commits);
  * `record_usage_batch`, 500 reports per statement: the path for a gateway that buffers;
  * a full rollup of 1,000,000 ledger rows (made with generate_series) into org × endpoint × hour,
    and an incremental run after 10,000 late rows.
Writes `bench/results/billing.json` and prints a markdown table. Target: ≥ 5,000 rows/s on 2 cores.

    .venv/bin/python bench/bench_billing.py [--rows 1000000]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
BENCH_DB = "inferplane_bench_billing"


def _admin_execute(sql: str) -> None:
    import psycopg
    from django.conf import settings

    db = settings.DATABASES["default"]
    with psycopg.connect(dbname="postgres", user=db["USER"] or "postgres", host=db["HOST"], port=db["PORT"] or None,
                         password=db["PASSWORD"] or None, autocommit=True) as conn:
        conn.execute(sql)


def setup_database():
    import django
    from django.conf import settings

    django.setup()
    _admin_execute(f"DROP DATABASE IF EXISTS {BENCH_DB} WITH (FORCE)")
    _admin_execute(f"CREATE DATABASE {BENCH_DB}")
    settings.DATABASES["default"]["NAME"] = BENCH_DB
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def make_endpoints(num_orgs: int = 2, endpoints_per_org: int = 5):
    from controlplane.accounts.models import Organization
    from endpoints.models import Endpoint

    endpoints = []
    for org_index in range(num_orgs):
        organization = Organization.objects.create(name=f"Bench {org_index}", slug=f"bench-{org_index}")
        for index in range(endpoints_per_org):
            endpoints.append(Endpoint.objects.create(
                organization=organization, name=f"model-{index}", model_source="hf:bench/model", gpu_type="l4",
                price_input_per_million="0.10", price_cached_input_per_million="0.05", price_output_per_million="0.30",
            ))
    return endpoints


def _report(endpoint, number: int, finished_at):
    from billing.ledger import UsageReport

    return UsageReport(
        request_id=f"bench-{uuid.uuid4().hex}", organization_id=endpoint.organization_id, api_key_id=None,
        endpoint_id=str(endpoint.pk), replica_id="r1", prompt_tokens=100 + number % 900, cached_tokens=number % 50,
        completion_tokens=number % 300, started_at=finished_at - timedelta(seconds=2),
        first_token_at=finished_at - timedelta(seconds=1), finished_at=finished_at, status="ok",
    )


def bench_single(endpoints, num_rows: int) -> float:
    from django.utils import timezone

    from billing.ledger import record_usage

    now = timezone.now()
    reports = [_report(endpoints[n % len(endpoints)], n, now) for n in range(num_rows)]
    started_at = time.perf_counter()
    for report in reports:
        record_usage(report)
    return num_rows / (time.perf_counter() - started_at)


def bench_concurrent(endpoints, num_rows: int, num_callers: int = 8) -> float:
    """`record_usage` from several threads at once, as concurrent gateway requests call it (group commit)."""
    from concurrent.futures import ThreadPoolExecutor

    from django.db import connection
    from django.utils import timezone

    from billing.ledger import record_usage

    now = timezone.now()
    reports = [_report(endpoints[n % len(endpoints)], n, now) for n in range(num_rows)]

    def write(chunk):
        try:
            for report in chunk:
                record_usage(report)
        finally:
            connection.close()

    chunks = [reports[index::num_callers] for index in range(num_callers)]
    started_at = time.perf_counter()
    with ThreadPoolExecutor(num_callers) as pool:
        list(pool.map(write, chunks))
    return num_rows / (time.perf_counter() - started_at)


def bench_async(endpoints, num_rows: int, concurrency: int = 64) -> float:
    """`arecord_usage` from many concurrent requests of one event loop, as the async gateway calls it."""
    import asyncio

    from django.utils import timezone

    from billing.usage_writer import arecord_usage

    now = timezone.now()
    reports = [_report(endpoints[n % len(endpoints)], n, now) for n in range(num_rows)]

    async def caller(chunk):
        for report in chunk:
            await arecord_usage(report)

    async def run():
        await asyncio.gather(*(caller(reports[index::concurrency]) for index in range(concurrency)))

    started_at = time.perf_counter()
    asyncio.run(run())
    return num_rows / (time.perf_counter() - started_at)


def bench_batch(endpoints, num_rows: int, batch_size: int = 500) -> float:
    from django.utils import timezone

    from billing.ledger import record_usage_batch

    now = timezone.now()
    reports = [_report(endpoints[n % len(endpoints)], n, now) for n in range(num_rows)]
    started_at = time.perf_counter()
    for start in range(0, num_rows, batch_size):
        record_usage_batch(reports[start:start + batch_size])
    return num_rows / (time.perf_counter() - started_at)


def generate_rows(endpoints, num_rows: int) -> float:
    """A week of usage over every endpoint, written by PostgreSQL itself."""
    from django.db import connection

    ids = "ARRAY[" + ",".join(f"'{e.pk}'::uuid" for e in endpoints) + "]"
    orgs = "ARRAY[" + ",".join(str(e.organization_id) for e in endpoints) + "]"
    started_at = time.perf_counter()
    with connection.cursor() as cursor:
        cursor.execute(f"""
            INSERT INTO billing_usagerecord (request_id, organization_id, api_key_id, endpoint_id, replica_id,
                prompt_tokens, cached_tokens, completion_tokens, cost, started_at, first_token_at, finished_at,
                status, cold_start_s, recorded_at)
            SELECT 'gen-' || g, ({orgs})[1 + g %% {len(endpoints)}], NULL, ({ids})[1 + g %% {len(endpoints)}], '',
                   p, c, o, round(((p - c) * 0.10 + c * 0.05 + o * 0.30) * 0.000001, 9),
                   f - interval '2 seconds', f - interval '1 second', f, 'ok', 0, f
            FROM generate_series(1, %s) AS g,
                 LATERAL (SELECT 100 + g %% 900 AS p, least(100 + g %% 900, (g %% 7) * 10) AS c, g %% 300 AS o,
                                 now() - interval '2 hours' - (g %% 604800) * interval '1 second' AS f) AS v
        """, [num_rows])
        cursor.execute("ANALYZE billing_usagerecord")
    return time.perf_counter() - started_at


def bench_rollups(endpoints) -> dict:
    from django.db import connection

    from billing.models import UsageRollup
    from billing.rollups import rollup_usage

    started_at = time.perf_counter()
    full = rollup_usage(full=True)
    full_s = time.perf_counter() - started_at
    num_rollups = UsageRollup.objects.count()

    num_late = 10_000
    generate_late = f"""
        UPDATE billing_usagerecord SET recorded_at = now()
        WHERE id IN (SELECT id FROM billing_usagerecord ORDER BY id DESC LIMIT {num_late})
    """
    with connection.cursor() as cursor:
        cursor.execute("UPDATE billing_rollupcursor SET recorded_since = now()")
        cursor.execute(generate_late)  # as if these rows had just arrived late
    started_at = time.perf_counter()
    incremental = rollup_usage()
    incremental_s = time.perf_counter() - started_at
    return {
        "full_rollup_s": round(full_s, 2), "num_groups": full.num_groups, "num_rollups": num_rollups,
        "incremental_rollup_s": round(incremental_s, 3), "incremental_groups": incremental.num_groups,
        "num_late_rows": num_late,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--single-rows", type=int, default=5_000)
    parser.add_argument("--batch-rows", type=int, default=100_000)
    args = parser.parse_args()

    setup_database()
    try:
        endpoints = make_endpoints()
        single_per_s = bench_single(endpoints, args.single_rows)
        concurrent_per_s = bench_concurrent(endpoints, args.single_rows * 2)
        async_per_s = bench_async(endpoints, args.batch_rows // 2)
        batch_per_s = bench_batch(endpoints, args.batch_rows)
        from django.db import connection

        with connection.cursor() as cursor:
            cursor.execute("TRUNCATE billing_usagerecord")
        generate_s = generate_rows(endpoints, args.rows)
        rollups = bench_rollups(endpoints)
    finally:
        from django.db import connections

        connections.close_all()
        _admin_execute(f"DROP DATABASE IF EXISTS {BENCH_DB} WITH (FORCE)")

    results = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "ledger_rows_per_s_single": round(single_per_s),
        "ledger_rows_per_s_8_concurrent_callers": round(concurrent_per_s),
        "ledger_rows_per_s_async_64_concurrent": round(async_per_s),
        "ledger_rows_per_s_batched_500": round(batch_per_s),
        "target_rows_per_s": 5000,
        "rollup_rows": args.rows,
        "generate_rows_s": round(generate_s, 1),
        **rollups,
    }
    out = REPO / "bench" / "results" / "billing.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")

    print("| measure | result |")
    print("|---|---|")
    print(f"| ledger writes, `record_usage` (one request per call) | {results['ledger_rows_per_s_single']:,} rows/s |")
    print(f"| ledger writes, `record_usage` from 8 concurrent callers | {results['ledger_rows_per_s_8_concurrent_callers']:,} rows/s |")
    print(f"| ledger writes, `arecord_usage` from 64 concurrent requests (shared commits) | {results['ledger_rows_per_s_async_64_concurrent']:,} rows/s |")
    print(f"| ledger writes, `record_usage_batch` (500 per statement) | {results['ledger_rows_per_s_batched_500']:,} rows/s |")
    print(f"| full rollup of {args.rows:,} rows ({rollups['num_rollups']:,} org × endpoint × hour rollups) | {rollups['full_rollup_s']} s |")
    print(f"| incremental rollup after {rollups['num_late_rows']:,} late rows ({rollups['incremental_groups']} hours) | {rollups['incremental_rollup_s']} s |")


if __name__ == "__main__":
    main()
