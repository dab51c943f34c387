"""PostgreSQL's CPU per usage-ledger row, by batch size and by what the row's statement carries (issue #20, round 18).

Writes synthetic rows of the bench organisation's endpoint (`bench_gateway.seed`) through the usage writer's own
path (`billing.usage_writer`'s connection, `ledger.record_usage_batch_on`: the prepared INSERT, autocommit, a commit a
batch) and reads the CPU of the bench's PostgreSQL from `/proc` (its postmaster, reaped and live backends:
`bench.proc_cpu.tree_cpu_s`) and of this process (the writer's side: the JSON, psycopg).

    .venv/bin/python bench/probe_ledger_rows.py [--batches 5,15,50,150] [--rows 6000] [--rounds 3]
    .venv/bin/python bench/probe_ledger_rows.py --without on-conflict,indexes,foreign-keys

`--without` measures, in alternating rounds of batches of 15, the statement as it is against one without each piece,
each variant inside a transaction rolled back at its end (its DDL too: nothing changes in the ledger); no commit per
batch there, so compare those figures only with each other. The record: `bench/results/gateway_profile.md`, round 18.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import bench_gateway as bench  # noqa: E402 - sets the benchmark's environment first
from bench.proc_cpu import server_pids, tree_cpu_s  # noqa: E402

_SECONDARY_INDEXES = ("usage_org_finished", "usage_org_endpoint_finished", "usage_key_finished")
_FOREIGN_KEYS = ("organization_id", "api_key_id", "endpoint_id")


def postgres_cpu_s() -> float:
    return tree_cpu_s(server_pids(bench.DATA_DIR)[1])


def reports(num: int, organization_id: int, api_key_id: int, endpoint_id: str) -> list:
    from billing.ledger import UsageReport

    now = datetime.now(UTC)
    return [UsageReport(request_id=f"req_{random.getrandbits(128):032x}", organization_id=organization_id,
                        api_key_id=api_key_id, endpoint_id=endpoint_id, replica_id="probe", prompt_tokens=12,
                        cached_tokens=0, completion_tokens=16, started_at=now - timedelta(milliseconds=5),
                        first_token_at=now, finished_at=now, status="ok", max_cost=Decimal("0.001"),
                        price_input_per_million=Decimal("0.1"), price_cached_input_per_million=Decimal("0.05"),
                        price_output_per_million=Decimal("0.2"), billing_mode="postpaid")
            for _ in range(num)]


async def per_row_us(batch: int, num_rows: int, caller: tuple) -> tuple[float, float]:
    """PostgreSQL's and this process's CPU µs a row, `num_rows` rows in batches of `batch`, a commit each."""
    from billing import usage_writer
    from billing.ledger import record_usage_batch_on

    connection = await usage_writer._connect()
    try:
        for _ in range(5):  # prepared, warm
            await record_usage_batch_on(connection, reports(batch, *caller))
        postgres, own = postgres_cpu_s(), time.process_time()
        for _ in range(num_rows // batch):
            await record_usage_batch_on(connection, reports(batch, *caller))
        return ((postgres_cpu_s() - postgres) / num_rows * 1e6, (time.process_time() - own) / num_rows * 1e6)
    finally:
        await connection.close()


async def variant_us(without: str, num_rows: int, caller: tuple) -> float:
    """PostgreSQL's CPU µs a row without `without` (or as it is, for ""), in one transaction rolled back."""
    from billing import ledger, usage_writer

    statement = ledger._INSERT_SQL
    if without == "on-conflict":
        statement = statement.replace("ON CONFLICT (request_id) DO NOTHING", "")
    connection = await usage_writer._connect()
    try:
        await connection.execute("BEGIN")
        table = ledger._TABLE
        if without == "indexes":
            names = [row[0] for row in await (await connection.execute(
                "SELECT indexname FROM pg_indexes WHERE tablename = %s AND indexdef LIKE %s",
                [table, "%(endpoint_id)"])).fetchall()]
            for name in [*_SECONDARY_INDEXES, *names]:
                await connection.execute(f'DROP INDEX "{name}"')
        if without == "foreign-keys":
            for (name,) in await (await connection.execute(
                    "SELECT conname FROM pg_constraint WHERE conrelid = %s::regclass AND contype = 'f'",
                    [table])).fetchall():
                await connection.execute(f'ALTER TABLE "{table}" DROP CONSTRAINT "{name}"')
        async with connection.cursor() as cursor:
            for _ in range(5):
                await cursor.execute(statement, ledger._rows(reports(15, *caller)))
            postgres = postgres_cpu_s()
            for _ in range(num_rows // 15):
                await cursor.execute(statement, ledger._rows(reports(15, *caller)))
            used = postgres_cpu_s() - postgres
        return used / num_rows * 1e6
    finally:
        await connection.execute("ROLLBACK")
        await connection.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="5,15,50,150")
    parser.add_argument("--rows", type=int, default=6000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--without", default="", help="on-conflict, indexes, foreign-keys (comma-separated)")
    args = parser.parse_args()
    bench.setup_django()
    from endpoints.models import Endpoint

    bench.seed({"mock": "http://127.0.0.1:9"})  # never called: the rows need an endpoint and a key
    try:
        from django.apps import apps

        endpoint = Endpoint.objects.get(organization__slug="bench-gateway", name="mock")
        api_key = apps.get_model("controlplane", "ApiKey").objects.filter(organization_id=endpoint.organization_id).first()
        caller = (endpoint.organization_id, api_key.id, str(endpoint.id))
        if args.without:
            variants = ["", *args.without.split(",")]
            figures: dict[str, list[float]] = {name: [] for name in variants}
            for round_index in range(args.rounds):
                for name in variants if round_index % 2 == 0 else reversed(variants):
                    figures[name].append(asyncio.run(variant_us(name, args.rows, caller)))
            for name, values in figures.items():
                print(f"{'as it is' if not name else 'without ' + name}: PostgreSQL µs a row, median "
                      f"{statistics.median(values):.1f} {[round(v, 1) for v in values]}", flush=True)
            return 0
        for batch in [int(b) for b in args.batches.split(",")]:
            runs = [asyncio.run(per_row_us(batch, max(args.rows, batch * 20), caller)) for _ in range(args.rounds)]
            print(f"batches of {batch}: PostgreSQL µs a row {[round(r[0], 1) for r in runs]}, "
                  f"the writer's {[round(r[1], 1) for r in runs]}", flush=True)
        return 0
    finally:
        bench.unseed()


if __name__ == "__main__":
    sys.exit(main())
