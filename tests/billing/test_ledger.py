"""The usage ledger: one row per request id, priced at write time, never lost, never doubled."""

import asyncio
import dataclasses
import random
import re
from datetime import datetime, timedelta, timezone
from decimal import Decimal

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from django.db import DataError, transaction

from billing import ledger
from billing.ledger import (
    CostCeiling,
    UnknownEndpointError,
    UsageReport,
    cost_of,
    record_usage,
    record_usage_batch,
)
from billing.models import UsageRecord
from billing.usage_writer import Recorded, arecord_usage, writer_for_this_loop
from tests.billing.conftest import usage_report
from tests.factories import EndpointFactory, OrganizationFactory

pytestmark = pytest.mark.django_db


def test_the_same_request_id_twice_writes_one_row():
    endpoint = EndpointFactory()
    report = usage_report(endpoint, request_id="chatcmpl-once")

    assert record_usage(report) is True
    assert record_usage(report) is False
    assert UsageRecord.objects.filter(request_id="chatcmpl-once").count() == 1


def test_a_batch_with_repeated_and_already_written_ids_writes_each_request_once():
    endpoint = EndpointFactory()
    first = usage_report(endpoint, request_id="a")
    record_usage(first)

    written = record_usage_batch([first, usage_report(endpoint, request_id="b"), usage_report(endpoint, request_id="b")])

    assert written == {"b"}
    assert sorted(UsageRecord.objects.values_list("request_id", flat=True)) == ["a", "b"]


def test_cost_is_computed_at_write_time_from_the_endpoint_prices_in_decimal():
    endpoint = EndpointFactory(price_input_per_million=Decimal("0.30"), price_cached_input_per_million=Decimal("0.15"),
                               price_output_per_million=Decimal("1.20"))
    record_usage(usage_report(endpoint, request_id="priced", prompt_tokens=1000, cached_tokens=400, completion_tokens=333))
    endpoint.price_output_per_million = Decimal("99")
    endpoint.save()

    row = UsageRecord.objects.get(request_id="priced")
    # 600 × 0.30 + 400 × 0.15 + 333 × 1.20 per million
    assert row.cost == Decimal("0.000639600")
    assert cost_of(EndpointFactory.build(price_input_per_million=Decimal("0.30"), price_cached_input_per_million=Decimal("0.15"),
                                         price_output_per_million=Decimal("1.20")), 1000, 400, 333) == row.cost


def test_database_and_python_prices_agree_to_the_nano_dollar_on_awkward_numbers():
    endpoint = EndpointFactory(price_input_per_million=Decimal("0.123457"), price_cached_input_per_million=Decimal("0.000001"),
                               price_output_per_million=Decimal("3.333333"))
    for prompt, cached, completion in [(1, 1, 1), (7, 3, 11), (123457, 99, 987), (5, 0, 0), (0, 0, 1)]:
        report = usage_report(endpoint, prompt_tokens=prompt, cached_tokens=cached, completion_tokens=completion)
        record_usage(report)
        assert UsageRecord.objects.get(request_id=report.request_id).cost == cost_of(endpoint, prompt, cached, completion)


def test_a_batch_keeps_every_value_exactly_as_reported():
    """The batch travels as one JSON document (`billing.ledger._rows`): money, times with their
    offset, a request id with quotes and backslashes, nulls and the cold start's phases arrive intact."""
    endpoint = EndpointFactory(price_input_per_million=Decimal("1000"), price_output_per_million=Decimal("1000"))
    india = timezone(timedelta(hours=5, minutes=30))
    started_at = datetime(2026, 3, 4, 10, 0, 0, 123456, tzinfo=india)
    odd = dataclasses.replace(usage_report(endpoint, request_id='req "quoted" \\ back\'slash é'),
                              started_at=started_at, first_token_at=None,
                              finished_at=started_at + timedelta(seconds=1, microseconds=1), replica_id=None,
                              max_cost=Decimal("0.000000001"), cold_start_s=1.25, cold_start_ms=1250,
                              cold_start_phases={"scheduling": 250, "engine": 1000}, batch_id="")
    plain = usage_report(endpoint)

    assert record_usage_batch([odd, plain]) == {odd.request_id, plain.request_id}

    row = UsageRecord.objects.get(request_id=odd.request_id)
    assert (row.started_at, row.finished_at, row.first_token_at) == (odd.started_at, odd.finished_at, None)
    assert row.cost == Decimal("0.000000001")  # capped at the reservation, to the nano-dollar
    assert (row.replica_id, row.cold_start_s, row.cold_start_ms) == ("", 1.25, 1250)
    assert row.cold_start_phases == {"scheduling": 250, "engine": 1000}
    assert UsageRecord.objects.get(request_id=plain.request_id).cost == cost_of(endpoint, 100, 0, 50)


def test_an_aborted_stream_is_recorded_with_the_tokens_delivered():
    endpoint = EndpointFactory()
    record_usage(usage_report(endpoint, request_id="aborted", completion_tokens=7, status="client_aborted"))

    row = UsageRecord.objects.get(request_id="aborted")
    assert (row.status, row.completion_tokens) == ("client_aborted", 7)


def test_usage_for_an_endpoint_of_another_organisation_is_refused_not_lost_silently():
    endpoint = EndpointFactory()
    report = usage_report(endpoint)
    report.organization_id = OrganizationFactory().pk

    with pytest.raises(UnknownEndpointError):
        record_usage(report)
    assert not UsageRecord.objects.exists()


def test_a_report_with_impossible_numbers_is_rejected_before_the_database():
    endpoint = EndpointFactory()
    with pytest.raises(ValueError):
        usage_report(endpoint, prompt_tokens=5, cached_tokens=6)
    with pytest.raises(ValueError):
        usage_report(endpoint, status="fine")


@pytest.mark.parametrize("name", ["started_at", "first_token_at", "finished_at"])
def test_a_report_with_a_naive_time_is_rejected_naming_that_time(name):
    report = usage_report(EndpointFactory())
    naive = getattr(report, name).replace(tzinfo=None)

    with pytest.raises(ValueError, match=f"{name} must be timezone-aware"):
        dataclasses.replace(report, **{name: naive})


@pytest.mark.django_db(transaction=True)
def test_the_async_variant_writes_exactly_once_too():
    endpoint = EndpointFactory()
    report = usage_report(endpoint, request_id="async-once")

    assert async_to_sync(arecord_usage)(report) is Recorded.WRITTEN
    assert async_to_sync(arecord_usage)(report) is Recorded.DUPLICATE
    assert UsageRecord.objects.filter(request_id="async-once").count() == 1


@pytest.mark.django_db(transaction=True)
def test_concurrent_async_writes_share_statements_and_still_write_each_request_once():
    endpoint = EndpointFactory()
    foreign = usage_report(endpoint, request_id="foreign")
    foreign.organization_id = OrganizationFactory().pk
    reports = [usage_report(endpoint, request_id=f"c{n % 150}") for n in range(300)] + [foreign]

    async def storm():
        return await asyncio.gather(*(arecord_usage(report) for report in reports), return_exceptions=True)

    outcomes = asyncio.run(storm())

    assert sum(outcome is Recorded.WRITTEN for outcome in outcomes) == 150
    assert isinstance(outcomes[-1], UnknownEndpointError)
    assert UsageRecord.objects.count() == 150


@pytest.mark.django_db(transaction=True)
def test_the_async_writer_survives_its_connection_being_dropped():
    from django.db import connection

    endpoint = EndpointFactory()

    async def scenario():
        assert await arecord_usage(usage_report(endpoint, request_id="before-drop"))
        writer_pid = writer_for_this_loop()._connection.info.backend_pid
        await sync_to_async(_terminate)(writer_pid)
        return await arecord_usage(usage_report(endpoint, request_id="after-drop"))

    def _terminate(pid):
        # NOTE: never this thread's own backend: a writer connection closed meanwhile (a journal replay that
        # set a batch aside) leaves its pid free for the next backend, which may be this one (a suite run on
        # two workers once terminated the test's own connection). An earlier test that cut every session may
        # have left this thread's connection dead: it is replaced first.
        if connection.connection is not None and not connection.is_usable():
            connection.close()
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE pid = %s AND pid <> pg_backend_pid()",
                           [pid])

    assert asyncio.run(scenario()) is Recorded.WRITTEN
    assert set(UsageRecord.objects.values_list("request_id", flat=True)) == {"before-drop", "after-drop"}


@pytest.mark.parametrize("seed", range(4))
def test_the_cost_ceiling_agrees_with_cost_of_to_the_nano_dollar(seed):
    """A stream's per-chunk check (`CostCeiling.exceeded`) says exactly what `cost_of(...) > ceiling` says,
    at the rounding edges too."""
    generator = random.Random(seed)
    for _ in range(2_000):
        prices = [Decimal(generator.randint(0, 5_000_000)).scaleb(-6) for _ in range(3)]
        endpoint = EndpointFactory.build(price_input_per_million=prices[0], price_cached_input_per_million=prices[1],
                                         price_output_per_million=prices[2])
        fraction = generator.choice([Decimal(1), Decimal("0.5"), Decimal("0.333333"), Decimal(0)])
        prompt = generator.randint(0, 200_000)
        cached, completion = generator.randint(0, prompt), generator.randint(0, 50_000)
        cost = cost_of(endpoint, prompt, cached, completion, fraction=fraction)
        nudge = Decimal(generator.choice([-2, -1, 0, 0, 1, 2])).scaleb(-9)
        ceiling = max(Decimal(0), cost + nudge) if generator.random() < 0.8 else Decimal(generator.randint(0, 10**6)).scaleb(-9)
        exceeded = CostCeiling.of(endpoint, ceiling, fraction=fraction).exceeded(prompt, cached, completion)
        assert exceeded == (cost > ceiling), (prices, fraction, prompt, cached, completion, ceiling, cost)


def test_a_cost_ceiling_is_the_same_for_prices_worked_out_once_and_for_equal_prices_written_otherwise():
    """An endpoint's price ratios are worked out once per set of prices (`_price_ratios`), not at each stream's start:
    prices equal in value (0.5 and 0.500000, an integer) give the same ceiling as when first seen."""
    first = EndpointFactory.build(price_input_per_million=Decimal("0.5"), price_cached_input_per_million=Decimal(2),
                                  price_output_per_million=Decimal("1.25"))
    written_otherwise = EndpointFactory.build(price_input_per_million=Decimal("0.500000"),
                                              price_cached_input_per_million=Decimal("2.00"),
                                              price_output_per_million=Decimal("1.250"))
    for ceiling in (Decimal(0), Decimal("0.000001234"), Decimal("0.5")):
        for fraction in (Decimal(1), Decimal("0.5")):
            assert (CostCeiling.of(first, ceiling, fraction=fraction)
                    == CostCeiling.of(written_otherwise, ceiling, fraction=fraction))
            for tokens in ((1000, 0, 10), (10**6, 10**5, 10**5), (0, 0, 1)):
                cost = cost_of(written_otherwise, *tokens, fraction=fraction)
                assert CostCeiling.of(written_otherwise, ceiling, fraction=fraction).exceeded(*tokens) == (cost > ceiling)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("pooler", ["none", "transaction"])
def test_the_usage_writer_prepares_its_insert_unless_behind_a_transaction_pooler(settings, pooler):
    # The INSERT (four joins over a JSON recordset) was parsed and planned by PostgreSQL for every batch. It is
    # prepared once per connection now, except behind PgBouncer in transaction mode, where the next batch may
    # run on a server connection that never saw it.
    settings.DATABASE_POOLER = pooler
    endpoint = EndpointFactory()

    async def write_and_look() -> list:
        writer = writer_for_this_loop()
        for number in range(8):
            assert await writer.write(usage_report(endpoint, request_id=f"prepared-{pooler}-{number}")) is Recorded.WRITTEN
        async with writer._connection.cursor() as cursor:
            await cursor.execute("SELECT statement FROM pg_prepared_statements")
            return [row[0] for row in await cursor.fetchall()]

    statements = asyncio.run(write_and_look())
    assert UsageRecord.objects.filter(request_id__startswith=f"prepared-{pooler}-").count() == 8
    if pooler == "none":
        assert len(statements) == 1 and "INSERT INTO billing_usagerecord" in statements[0]
    else:
        assert statements == []


def test_a_rows_prices_and_batch_fraction_are_the_ones_its_call_was_admitted_at():
    # The row took the endpoint's prices (and a batch line its batch fraction) when it was written, while the call was
    # reserved and settled at those it was admitted at: a change in between made the ledger and the counters differ.
    endpoint = EndpointFactory(price_input_per_million=Decimal("9"), price_cached_input_per_million=Decimal("9"),
                               price_output_per_million=Decimal("9"), batch_price_fraction=Decimal("0.9"))
    admitted = dataclasses.replace(
        usage_report(endpoint, request_id="line-1", prompt_tokens=1000, cached_tokens=0, completion_tokens=1000),
        batch_id="batch_1", price_input_per_million=Decimal("1"), price_cached_input_per_million=Decimal("0.5"),
        price_output_per_million=Decimal("2"), price_fraction=Decimal("0.5"), max_cost=None)
    record_usage(admitted)
    row = UsageRecord.objects.get(request_id="line-1")
    assert row.cost == (1000 * Decimal("1") + 1000 * Decimal("2")) / 10**6 * Decimal("0.5")


class _Text(str):
    """A str subclass (as Django's SafeString): msgspec refuses to encode it, the json module takes it."""


class _Price(Decimal):
    pass


def test_a_report_msgspec_cannot_encode_is_written_as_the_json_module_writes_it():
    # Before, msgspec's TypeError on a subclass of str or Decimal raised before PostgreSQL saw the batch: a row the
    # json module wrote before (found by the review of the ledger's msgspec rows).
    endpoint = EndpointFactory(price_input_per_million=Decimal("1"), price_output_per_million=Decimal("1"))
    report = dataclasses.replace(usage_report(endpoint, prompt_tokens=1000, completion_tokens=1000),
                                 replica_id=_Text("replica-7"), price_input_per_million=_Price("2"))

    assert record_usage_batch([report]) == {report.request_id}

    row = UsageRecord.objects.get(request_id=report.request_id)
    assert (row.replica_id, row.cost) == ("replica-7", Decimal("0.003"))  # 1000 at the call's 2 + 1000 at 1, per million


def test_a_report_with_a_lone_surrogate_is_refused_by_postgresql_for_what_it_holds():
    # Before, msgspec's UnicodeEncodeError raised in Python: not the DataError (SQLSTATE 22) that the journal's
    # replays and the sweeper set aside, so a journal replay failed on every try until the journal was full.
    endpoint = EndpointFactory()
    report = dataclasses.replace(usage_report(endpoint), replica_id="r\ud800")

    with pytest.raises(DataError), transaction.atomic():
        record_usage_batch([report])
    assert not UsageRecord.objects.exists()


def test_a_time_whose_offset_has_seconds_is_written_at_its_moment():
    # A zone's local mean time (Amsterdam's before 1937: +00:19:32); msgspec wrote it to the minute, and the row's times
    # moved 28 s.
    endpoint = EndpointFactory()
    local_mean_time = timezone(timedelta(minutes=19, seconds=32))
    started_at = datetime(2026, 3, 2, 12, 0, 0, tzinfo=local_mean_time)
    report = dataclasses.replace(usage_report(endpoint), started_at=started_at,
                                 first_token_at=started_at + timedelta(seconds=1),
                                 finished_at=started_at + timedelta(seconds=5))

    record_usage(report)

    row = UsageRecord.objects.get(request_id=report.request_id)
    assert (row.started_at, row.first_token_at, row.finished_at) == (
        started_at, started_at + timedelta(seconds=1), started_at + timedelta(seconds=5))


def test_every_column_the_ledger_reads_from_a_row_is_a_field_of_the_report():
    # `json_to_recordset` makes a column no row names NULL: a renamed price column would price every row at the
    # endpoint's price now (`coalesce`). The module checks its columns when imported, and refuses one not a field.
    declared = re.search(r"json_to_recordset\(%s::json\)\s+AS r\((.*?)\)\s+JOIN", ledger._PRICED_SQL, re.S).group(1)
    columns = [column.split()[0] for column in declared.split(",")]

    assert len(columns) == len(dataclasses.fields(UsageReport))
    assert set(columns) <= {field.name for field in dataclasses.fields(UsageReport)}
    with pytest.raises(TypeError, match="price_input"):
        ledger.check_recordset_columns([*columns, "price_input"])
