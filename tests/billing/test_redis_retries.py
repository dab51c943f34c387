"""A replay's scripts, sent again by redis-py's retry after their reply was lost, run once.

The shared sync client retries a command once after a connection error (`controlplane.redis_client`): Redis ran the
script, the connection dropped before its reply was read, and redis-py sent it again on a new connection. The scripts
that add a cost, or answer what a second run would answer otherwise, are made `once` (`controlplane.redis_scripts`).
Found by a review: a replayed row of $0.010015 was counted $0.020030.
"""

import asyncio
import dataclasses
from datetime import timedelta
from decimal import Decimal

import pytest
import redis.client
import redis.exceptions
from django.utils import timezone

from billing.ledger import record_usage
from billing.models import UsageRecord
from billing.quota import reads, replayed
from controlplane import redis_keys
from controlplane.redis_client import get_redis
from controlplane.redis_scripts import Script
from tests.billing.conftest import usage_report
from tests.billing.test_journaled_spend import _replay, journal_dir  # noqa: F401 - a fixture used here
from tests.billing.test_lost_row_superseded import (
    _killed_after_its_journal_append,
    _priced_endpoint,
    _sweep_after_the_hold_lapsed,
)
from tests.billing.test_quota import _cap, reserve, settle
from tests.factories import EndpointFactory

pytestmark = pytest.mark.django_db(transaction=True)


def _reply_lost_once(monkeypatch, script: Script) -> list[int]:
    """The first run of `script` on the shared sync client goes through; the connection then drops before its reply is
    read (redis-py sends it again). Returns a list that holds one item once that happened."""
    send_and_parse = redis.client.Redis._send_command_parse_response
    lost = []

    def reply_lost(self, connection, command_name, *args, **options):
        reply = send_and_parse(self, connection, command_name, *args, **options)
        if command_name in ("EVALSHA", "EVAL") and args[1] in (script.sha, script.source) and not lost:
            lost.append(1)
            raise redis.exceptions.ConnectionError("Connection reset by peer")
        return reply

    monkeypatch.setattr(redis.client.Redis, "_send_command_parse_response", reply_lost)
    return lost


def _counter_built(organization) -> None:
    """The organisation's period counter exists, $0 spent."""
    _cap(organization, "1.00")
    admitted = asyncio.run(reserve(organization_id=organization.pk, api_key_id=None, amount=Decimal("0.01"),
                                   request_id="first"))
    asyncio.run(settle(admitted, Decimal(0), fresh_id=True, recorded=False))
    assert reads.counted_spend(organization.pk) == 0


def _replayed_row(endpoint, request_id: str):
    report = dataclasses.replace(usage_report(endpoint, request_id=request_id, prompt_tokens=100_000),
                                 max_cost=Decimal("0.50"))
    replayed.register_replaying_sync([report])
    record_usage(report)  # the replay's INSERT
    return report, UsageRecord.objects.get(request_id=request_id).cost


def test_a_replayed_rows_count_whose_reply_is_lost_counts_it_once(monkeypatch):
    endpoint = EndpointFactory()
    _counter_built(endpoint.organization)
    report, cost = _replayed_row(endpoint, "replayed")

    lost = _reply_lost_once(monkeypatch, replayed._COUNT_REPLAYED)
    assert replayed.count_replayed(["replayed"], batch=[report]) == 1
    assert lost

    assert reads.counted_spend(endpoint.organization_id) == cost > 0


def test_a_killed_replays_row_is_owed_to_the_next_replay_whose_registration_reply_is_lost(monkeypatch):
    # The replay that wrote the row was killed before its count; the next one's registration finds the row registered
    # since before it was recorded, and counts it. A second run of that registration found its own registration and
    # answered it as the row's: recorded before it, not owed, counted by none.
    endpoint = EndpointFactory()
    organization_id = endpoint.organization_id
    _counter_built(endpoint.organization)
    report, cost = _replayed_row(endpoint, "killed")
    registered_at = get_redis().time()[0] - 20
    get_redis().hset(redis_keys.replaying_key(organization_id), "killed", registered_at + replayed.REGISTRATION_TTL_S)
    UsageRecord.objects.filter(request_id="killed").update(recorded_at=timezone.now() - timedelta(seconds=10))

    lost = _reply_lost_once(monkeypatch, replayed._REGISTER)
    registration = replayed.register_replaying_sync([report])
    assert lost
    monkeypatch.undo()
    assert registration.owed == {"killed": registered_at}
    assert replayed.count_replayed([], batch=[report], registration=registration) == 1

    assert reads.counted_spend(organization_id) == cost > 0


def test_a_superseded_rows_count_whose_reply_is_lost_counts_the_difference_once(monkeypatch, settings):
    settings.BILLING_RESERVATION_TTL_S = 600
    endpoint = _priced_endpoint()
    organization_id = endpoint.organization_id
    _killed_after_its_journal_append(endpoint, "streamed")
    _sweep_after_the_hold_lapsed()  # the lost row, $0.14
    assert reads.counted_spend(organization_id) == Decimal("0.14")

    lost = _reply_lost_once(monkeypatch, replayed._COUNT_SUPERSEDED)
    _replay()  # the whole row, $0.50, over it
    assert lost

    assert UsageRecord.objects.get().cost == Decimal("0.50")
    assert reads.counted_spend(organization_id) == Decimal("0.50")
