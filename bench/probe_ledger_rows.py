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

`--writer` measures the gateway's side of a row whole, as a call pays it (round 24): the report built
(`UsageReport`), handed to the usage writer (`usage_writer.UsageWriter.write`, its batch window, statement, outcomes
and futures) and awaited, `--batches` callers at a time, the process's CPU µs a row with its garbage collection set
as the gateway sets it (`_freeze_startup_objects`). With `--compare-with DIR`, the same measure runs in two long-lived
processes, one importing this tree's code and one DIR's (a `git archive` of another commit), taking turns round by
round (which goes first alternates), and prints the paired differences (`--tree DIR`: DIR's code as "this"):

    .venv/bin/python bench/probe_ledger_rows.py --writer --batches 15 --rounds 16 --compare-with $D/head
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WRITER_CHILD = "--writer-child"
if WRITER_CHILD in sys.argv:  # NOTE: the child measures the code of the tree its PYTHONPATH names, not this one's
    sys.path.insert(0, os.environ["PROBE_TREE"])
else:
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


def writer_child(batch: int, num_rows: int, caller: tuple) -> None:
    """The child of `--writer --compare-with`: one measure (`writer_per_row_us`) per line read, printed, on uvloop as
    the gateway runs."""
    import django
    import uvloop

    django.setup()
    for _ in sys.stdin:
        print(uvloop.run(writer_per_row_us(batch, num_rows, caller)), flush=True)


async def writer_per_row_us(batch: int, num_rows: int, caller: tuple) -> float:
    """This process's CPU µs a row through the usage writer, each row's report built and awaited as a call does."""
    from billing import usage_writer
    from billing.ledger import UsageReport
    from endpoints.gateway.app import _freeze_startup_objects

    organization_id, api_key_id, endpoint_id = caller
    cost, price_input, price_cached, price_output = (Decimal("0.001"), Decimal("0.1"), Decimal("0.05"),
                                                     Decimal("0.2"))

    def report(request_id: str) -> UsageReport:
        now = datetime.now(UTC)
        return UsageReport(request_id=request_id, organization_id=organization_id, api_key_id=api_key_id,
                           endpoint_id=endpoint_id, replica_id="probe", prompt_tokens=12, cached_tokens=0,
                           completion_tokens=16, started_at=now - timedelta(milliseconds=5), first_token_at=now,
                           finished_at=now, status="ok", cold_start_s=0.0, max_cost=cost, batch_id="",
                           cold_start_ms=None, cold_start_phases=None, adapter="", price_input_per_million=price_input,
                           price_cached_input_per_million=price_cached, price_output_per_million=price_output,
                           price_fraction=None, billing_mode="postpaid")

    async def call(request_id: str) -> None:
        await usage_writer.arecord_usage(report(request_id))

    writer = usage_writer.writer_for_this_loop()
    try:
        for _ in range(5):  # connected, prepared, warm
            await asyncio.gather(*(call(f"req_{random.getrandbits(128):032x}") for _ in range(batch)))
        ids = [[f"req_{random.getrandbits(128):032x}" for _ in range(batch)] for _ in range(num_rows // batch)]
        _freeze_startup_objects()
        started = time.process_time()
        for batch_ids in ids:
            await asyncio.gather(*(call(request_id) for request_id in batch_ids))
        return (time.process_time() - started) / (len(ids) * batch) * 1e6
    finally:
        await writer.close()


def compare_writers(this_tree: str, other_tree: str, batch: int, num_rows: int, num_rounds: int, caller: tuple,
                    ) -> None:
    """`writer_per_row_us` in `this_tree` and `other_tree`, a process each, taking turns; the paired differences."""
    children = {}
    for name, tree in (("this", str(Path(this_tree).resolve())), ("other", str(Path(other_tree).resolve()))):
        children[name] = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), WRITER_CHILD, str(batch), str(num_rows),
             *map(str, caller)], cwd=tree, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env={**os.environ, "PROBE_TREE": tree, "PYTHONPATH": tree})
    figures: dict[str, list[float]] = {"this": [], "other": []}
    try:
        for round_index in range(num_rounds):
            for name in ("this", "other") if round_index % 2 == 0 else ("other", "this"):
                children[name].stdin.write("go\n")
                children[name].stdin.flush()
                figures[name].append(float(children[name].stdout.readline()))
            print(f"round {round_index + 1}: this {figures['this'][-1]:.1f}, other {figures['other'][-1]:.1f} "
                  "µs a row", flush=True)
    finally:
        for child in children.values():
            child.stdin.close()
            child.wait(timeout=60)
    differences = [this - other for this, other in zip(figures["this"], figures["other"], strict=True)]
    print(f"batches of {batch}, {num_rounds} rounds of {num_rows} rows: this {statistics.median(figures['this']):.1f}, "
          f"other {statistics.median(figures['other']):.1f} µs a row (medians); this − other: median "
          f"{statistics.median(differences):+.1f} ({min(differences):+.1f} … {max(differences):+.1f}), "
          f"lower in {sum(d < 0 for d in differences)} of {num_rounds}", flush=True)


def main() -> int:
    if sys.argv[1:2] == [WRITER_CHILD]:
        batch, num_rows, organization_id, api_key_id = map(int, sys.argv[2:6])
        writer_child(batch, num_rows, (organization_id, api_key_id, sys.argv[6]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="5,15,50,150")
    parser.add_argument("--rows", type=int, default=6000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--without", default="", help="on-conflict, indexes, foreign-keys (comma-separated)")
    parser.add_argument("--writer", action="store_true", help="the gateway's CPU a row through the usage writer")
    parser.add_argument("--compare-with", default=None, help="with --writer: another tree, measured in turns")
    parser.add_argument("--tree", default=str(REPO), help="with --compare-with: the tree measured as this one")
    args = parser.parse_args()
    bench.setup_django()
    from endpoints.models import Endpoint

    bench.seed({"mock": "http://127.0.0.1:9"})  # never called: the rows need an endpoint and a key
    try:
        from django.apps import apps

        endpoint = Endpoint.objects.get(organization__slug="bench-gateway", name="mock")
        api_key = apps.get_model("controlplane", "ApiKey").objects.filter(organization_id=endpoint.organization_id).first()
        caller = (endpoint.organization_id, api_key.id, str(endpoint.id))
        if args.writer:
            import uvloop

            for batch in [int(b) for b in args.batches.split(",")]:
                if args.compare_with:
                    compare_writers(args.tree, args.compare_with, batch, args.rows, args.rounds, caller)
                    continue
                runs = [uvloop.run(writer_per_row_us(batch, args.rows, caller)) for _ in range(args.rounds)]
                print(f"batches of {batch}: the writer's path, µs a row {[round(r, 1) for r in runs]}", flush=True)
            return 0
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
