"""A gateway lost mid-stream (SIGKILL, OOM kill): what its streams delivered is billed once, by the sweeper, from the
progress its beats recorded; a call that ended normally is billed by its own row only; a gateway that only froze past
its call's hold (SIGSTOP) and woke bills the whole call by its own row, once."""

import signal
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from billing.ledger import period_spend
from billing.models import UsageRecord
from billing.periods import period_containing
from billing.quota.counters import to_units
from billing.quota.sweeper import sweep_expired_reservations
from controlplane import redis_keys
from controlplane.redis_client import get_redis, redis_time
from tests.conftest import start_web_server, wait_until
from tests.gateway.conftest import serve_endpoint
from tests.gateway.load import MESSAGES

pytestmark = pytest.mark.django_db(transaction=True)

TOKEN_DELAY_MS = 50  # the mock's pace: a beat (1 s) is 20 tokens


def _stream(gateway: str, key: str, model: str, max_tokens: int):
    return httpx.stream("POST", f"{gateway}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                        json={"model": model, "messages": MESSAGES, "stream": True, "max_tokens": max_tokens},
                        timeout=30)


def _spent_counted(organization_id: int) -> int:
    return int(get_redis().hget(redis_keys.org_period_key(organization_id, period_containing().key), "spent") or 0)


def _holds(organization_id: int, api_key_id: int) -> tuple[int, int, int, int]:
    """The organisation's reservations, its and its key's reserved sums (units), and its calls' progress."""
    redis = get_redis()
    return (redis.hlen(redis_keys.reservations_key(organization_id)),
            int(redis.get(redis_keys.org_reserved_key(organization_id)) or 0),
            int(redis.get(redis_keys.key_reserved_key(organization_id, api_key_id)) or 0),
            redis.hlen(redis_keys.progress_key(organization_id)))


def _paced_endpoint_and_gateway(tenant, start_mock_upstream, tmp_path, web_zygote):
    """An endpoint whose engine streams at `TOKEN_DELAY_MS`, and a gateway process whose calls' holds last 3 s past
    its last beat."""
    endpoint = serve_endpoint(tenant.org, start_mock_upstream(token_delay_ms=TOKEN_DELAY_MS))
    child, gateway = start_web_server(tmp_path, name="gateway", extra_env={"INFERPLANE_RESERVATION_TTL_S": "3"},
                                      zygote=web_zygote)
    return endpoint, child, gateway


def test_a_gateway_killed_mid_stream_has_what_it_delivered_billed_once_by_the_sweeper(
        tenant, start_mock_upstream, tmp_path, web_zygote):
    # Before, a gateway killed mid-stream wrote no usage row: its call's hold lapsed at its deadline and the sweeper,
    # finding no row, released it. Every token the stream had delivered (up to 6 h of them) was never billed.
    endpoint, child, gateway = _paced_endpoint_and_gateway(tenant, start_mock_upstream, tmp_path, web_zygote)
    org, key = tenant.org.pk, tenant.api_key.pk
    received = 0
    sent_at = datetime.now(UTC)
    try:
        with _stream(gateway, tenant.key, endpoint.name, max_tokens=400) as response:  # ~20 s
            request_id = response.headers["x-request-id"]
            for line in response.iter_lines():
                received += line.startswith("data: {")
                # NOTE: 90 (120 before): some four beats recorded, and what it delivered less three beats' worth
                # (the lower bound below) is still 30 tokens billed that only the beats' progress can bill
                if received == 90:  # ~4.5 s in
                    child.kill()
                    killed_at = datetime.now(UTC)
                    break
    finally:
        child.stop()
    assert not UsageRecord.objects.exists()  # nobody wrote its row
    assert _spent_counted(org) == 0

    # Its hold lapses a reservation's time (3 s here) after the dead gateway's last push.
    wait_until(lambda: sweep_expired_reservations() == 1, 15, interval_s=0.1, message="the lapsed hold swept")
    row = UsageRecord.objects.get()
    assert (row.request_id, row.status, row.api_key_id) == (request_id, "gateway_lost", key)
    assert row.prompt_tokens == 7
    # What it delivered, less what came after its last beat (a beat's worth: 20 tokens, three allowed for a loaded
    # machine), and at most what was on its way to the client when it was killed.
    assert received - 3 * 1000 // TOKEN_DELAY_MS <= row.completion_tokens <= received + 10
    assert row.completion_tokens < 400
    assert row.billing_mode == "postpaid"  # the mode it was admitted under
    assert row.cost > 0
    # Its times: its start, and its last beat before the kill (a beat's worth of tokens, some three allowed, before it)
    assert sent_at <= row.started_at <= row.finished_at <= killed_at
    assert killed_at - row.finished_at <= timedelta(seconds=3)
    # Settled with its cost, once: its spend counted, its hold and its progress gone.
    assert _spent_counted(org) == to_units(period_spend(org, period_containing())) == to_units(row.cost)
    assert _holds(org, key) == (0, 0, 0, 0)

    assert sweep_expired_reservations(now=redis_time() + 86_400) == 0  # swept again: nothing more
    assert UsageRecord.objects.count() == 1
    assert _spent_counted(org) == to_units(row.cost)


# NOTE: the engine streams on while the gateway is frozen (its events wait in the socket's buffers, 20 a second): at
# 140 the woken gateway has ~1 s of tokens left to read; at 200 it read ~4 s more, which proved nothing more.
FROZEN_STREAM_TOKENS = 140


def _frozen_past_its_hold(gateway: str, child, tenant, endpoint, while_frozen=lambda request_id: None):
    """A stream of `FROZEN_STREAM_TOKENS` (~7 s) whose gateway freezes ~3 s in (some three beats) until the sweeper has
    swept its call's lapsed hold (and `while_frozen` ran), then wakes and finishes it: its request id, the tokens
    received, and the sweeper's `gateway_lost` row as it was while the gateway was frozen."""
    received = 0
    with _stream(gateway, tenant.key, endpoint.name, max_tokens=FROZEN_STREAM_TOKENS) as response:
        request_id = response.headers["x-request-id"]
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            received += 1
            if received == 60:
                child.kill(signal.SIGSTOP)  # a stop-the-world pause, a VM paused: its beats stop
                try:
                    wait_until(lambda: sweep_expired_reservations() == 1, 15, interval_s=0.1,
                               message="the frozen gateway's lapsed hold swept")
                    lost = UsageRecord.objects.get()
                    while_frozen(request_id)
                finally:
                    child.kill(signal.SIGCONT)
        # It wakes and finishes the call: its row, then its settlement.
        wait_until(lambda: UsageRecord.objects.get().status == "ok", 15, message="the woken gateway's row")
    return request_id, received, lost


def test_a_gateway_frozen_past_its_calls_hold_bills_the_whole_call_by_its_own_row_once_it_wakes(
        tenant, start_mock_upstream, tmp_path, web_zygote):
    # Before, the woken gateway's row was refused as a duplicate of the sweeper's: the call stayed gateway_lost, billed
    # from its last beat, and the rest of what it streamed was never billed.
    endpoint, child, gateway = _paced_endpoint_and_gateway(tenant, start_mock_upstream, tmp_path, web_zygote)
    org, key = tenant.org.pk, tenant.api_key.pk

    def swept(request_id):
        assert _spent_counted(org) == to_units(UsageRecord.objects.get().cost)

    try:
        request_id, received, lost = _frozen_past_its_hold(gateway, child, tenant, endpoint, swept)
    finally:
        child.stop()
    assert (lost.status, lost.request_id) == ("gateway_lost", request_id)
    assert lost.completion_tokens < FROZEN_STREAM_TOKENS
    assert received >= FROZEN_STREAM_TOKENS
    row = UsageRecord.objects.get()
    assert (row.request_id, row.completion_tokens, row.api_key_id) == (request_id, FROZEN_STREAM_TOKENS, key)
    assert row.finished_at == lost.finished_at and row.cost > lost.cost
    # Counted once, its whole cost (not the lost row's and the whole row's); nothing held, nothing released twice.
    assert _spent_counted(org) == to_units(period_spend(org, period_containing())) == to_units(row.cost)
    assert _holds(org, key) == (0, 0, 0, 0)
    assert sweep_expired_reservations(now=redis_time() + 86_400) == 0
    assert _spent_counted(org) == to_units(row.cost)


def test_a_call_that_ended_normally_leaves_no_progress_and_a_later_sweep_writes_no_second_row(
        tenant, start_mock_upstream, tmp_path, web_zygote):
    endpoint, child, gateway = _paced_endpoint_and_gateway(tenant, start_mock_upstream, tmp_path, web_zygote)
    org, key = tenant.org.pk, tenant.api_key.pk
    received, progress_seen = 0, False
    try:
        with _stream(gateway, tenant.key, endpoint.name, max_tokens=60) as response:  # ~3 s
            for line in response.iter_lines():
                received += line.startswith("data: {")
                progress_seen = progress_seen or bool(get_redis().hlen(redis_keys.progress_key(org)))
    finally:
        child.stop()
    assert received >= 60
    assert progress_seen  # its beats recorded its progress while it streamed
    row = UsageRecord.objects.get()
    assert (row.status, row.completion_tokens) == ("ok", 60)
    assert _holds(org, key) == (0, 0, 0, 0)  # settled by its own end, its progress deleted with it

    assert sweep_expired_reservations(now=redis_time() + 86_400) == 0
    assert UsageRecord.objects.count() == 1
    assert _spent_counted(org) == to_units(row.cost)


def test_a_beat_builds_no_row_for_a_stream_whose_tokens_it_already_recorded():
    # A beat built and checked a whole usage row for every stream, changed or not, on the event loop (~110 µs each:
    # 0.1 s a second at 1,000 streams; the review of the beat): its tokens are compared first.
    from types import SimpleNamespace

    from endpoints.gateway.call import InferenceCall
    from endpoints.gateway.tally import UsageTally

    built = []
    usage = UsageTally()
    usage.take_totals({"prompt_tokens": 10, "completion_tokens": 5})
    call = SimpleNamespace(served=True, batch_id="", usage=usage,
                           usage_report=lambda **fields: built.append(fields) or "a row", _now=lambda: "now")
    assert InferenceCall.progress(call, "postpaid", None) == "a row"
    assert InferenceCall.progress(call, "postpaid", (10, 0, 5)) is None  # as the last beat recorded it
    usage.take_totals({"prompt_tokens": 10, "completion_tokens": 6})
    assert InferenceCall.progress(call, "postpaid", (10, 0, 5)) == "a row"
    assert len(built) == 2
