"""Rollups held for an operator show on the web's `/metrics` as `inferplane_usage_rollups_held{reason}`, counted by the
push task every minute (`billing.held_rollups`), not by each scrape."""

import re
from datetime import timedelta

import pytest
from django.utils import timezone

from billing import held_rollups, services, stripe_sync, tasks
from billing.ledger import record_usage
from billing.models import BillingAccount, UsageRollup
from billing.rollups import rollup_usage
from controlplane.redis_client import get_redis
from controlplane.redis_keys import CLOCK_SKEWS_KEY, HELD_ROLLUPS_KEY
from endpoints.gateway import metrics
from tests.billing.conftest import usage_report
from tests.factories import EndpointFactory

pytestmark = pytest.mark.django_db


def _closed_rollup() -> UsageRollup:
    endpoint = EndpointFactory()
    record_usage(usage_report(endpoint, finished_at=timezone.now().replace(minute=0, second=0, microsecond=0)
                              - timedelta(hours=3)))
    rollup_usage()
    return UsageRollup.objects.get(endpoint=endpoint, sequence=0)


def _scraped() -> dict[str, float]:
    metrics.refresh_fleet_gauges()
    return {reason: float(value) for reason, value in re.findall(
        r'^inferplane_usage_rollups_held\{reason="(\w+)"\} (\S+)$', metrics.render().decode(), re.MULTILINE)}


def test_held_rollups_are_counted_by_reason_for_the_scrape_by_the_push_task_not_by_each_scrape():
    # Before, a hold was told by a log line and an audit event alone: the test saw no such series in `/metrics`.
    get_redis().delete(HELD_ROLLUPS_KEY)
    first = _closed_rollup()
    first.push_first_tried_at = timezone.now() - stripe_sync.IDENTIFIER_TRUSTED_FOR
    stripe_sync.hold_for_review(first, stripe_sync.METERS[0])
    stripe_sync.hold_duplicate(_closed_rollup(), stripe_sync.METERS[0])
    stripe_sync.hold_duplicate(_closed_rollup(), stripe_sync.METERS[0])
    unknown = _closed_rollup()
    for _ in range(stripe_sync.UNKNOWN_LINES_HOLD_AFTER):
        stripe_sync._count_unknown_lines(unknown.pk, stripe_sync.UnknownInvoiceLines("a line of no known price"))
    deleted = _closed_rollup()
    services.hold_for_operator(BillingAccount.objects.for_organization(deleted.organization_id),
                               UsageRollup.objects.filter(pk=deleted.pk), customer_id="cus_gone", invoice="",
                               reason="a test")
    _closed_rollup()  # not held
    assert _scraped() == {}  # nothing counted yet: a scrape reads no rollup

    tasks.push_pending_rollups()  # Stripe not configured here: it pushes nothing, and counts all the same

    assert _scraped() == {"unanswered": 1, "duplicate": 2, "unknown_lines": 1, "customer_deleted": 1}
    assert 0 < get_redis().ttl(HELD_ROLLUPS_KEY) <= held_rollups.COUNTS_TTL_S

    stripe_sync.release_held(UsageRollup.objects.filter(pk=first.pk))
    assert _scraped()["unanswered"] == 1  # as last counted
    tasks.push_pending_rollups()
    assert _scraped()["unanswered"] == 0  # a reason with none is 0, not absent

    get_redis().delete(HELD_ROLLUPS_KEY)  # not counted for COUNTS_TTL_S: not reported, rather than stale
    assert _scraped() == {}


def test_the_held_rollups_are_counted_in_one_query(django_assert_num_queries):
    with django_assert_num_queries(1):
        assert held_rollups.count_held() == dict.fromkeys(held_rollups.REASONS, 0)


def test_a_count_in_redis_that_is_not_a_number_is_left_out_and_the_scrape_goes_on(caplog):
    # Before, int("x") raised out of the fleet gauges' refresh, and `/metrics` answered 500: every series lost. The same
    # for a clock skew that is not the JSON record a process writes.
    get_redis().delete(HELD_ROLLUPS_KEY)
    get_redis().hset(HELD_ROLLUPS_KEY, mapping={"duplicate": "x", "unanswered": "2"})
    get_redis().expire(HELD_ROLLUPS_KEY, held_rollups.COUNTS_TTL_S)
    get_redis().hset(CLOCK_SKEWS_KEY, "worker:hostile-1", "not json")
    try:
        scraped = _scraped()
    finally:
        get_redis().delete(HELD_ROLLUPS_KEY)
        get_redis().hdel(CLOCK_SKEWS_KEY, "worker:hostile-1")
    assert scraped == {"unanswered": 2.0, "duplicate": 0.0, "unknown_lines": 0.0, "customer_deleted": 0.0}
    warned = [record.getMessage() for record in caplog.records if record.levelname == "WARNING"]
    assert any("'duplicate'" in message and "not a count" in message for message in warned), warned
    assert any("worker:hostile-1" in message for message in warned), warned
