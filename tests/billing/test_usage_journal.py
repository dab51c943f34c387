"""The usage journal keeps every field of a report exactly, money included."""

import dataclasses
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from billing.ledger import UsageReport
from billing.usage_journal import decode, encode


def test_a_journalled_report_comes_back_exactly_with_its_reserved_cost():
    started = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
    report = UsageReport(
        request_id="req-1", organization_id=7, api_key_id=3, endpoint_id="6f0c3f5e-0000-4000-8000-000000000001",
        replica_id=None, prompt_tokens=12, cached_tokens=4, completion_tokens=30, started_at=started,
        first_token_at=started + timedelta(seconds=1), finished_at=started + timedelta(seconds=2), status="ok",
        cold_start_s=0.5, max_cost=Decimal("0.000123456789"),
    )
    assert decode(encode(report)) == report
    unreserved = dataclasses.replace(report, max_cost=None)
    assert decode(encode(unreserved)) == unreserved
