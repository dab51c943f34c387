"""The reservation sweeper reads only the organisations with something due (`billing.quota.sweep_index`): its cost
follows the work due, not the number of organisations; no lapsed hold or registration is missed, a lost index
included."""

import asyncio
import re
from decimal import Decimal

import pytest
from django.conf import settings
from django.db import OperationalError

from billing.quota import reads, replayed, sweep_index, sweeper
from controlplane import redis_keys
from controlplane.accounts.models import Organization
from controlplane.redis_client import get_redis, redis_time
from endpoints.gateway import presence
from tests.billing.conftest import usage_report
from tests.billing.test_quota import reserve
from tests.factories import EndpointFactory, OrganizationFactory
from tests.gateway.conftest import gateway_alone  # noqa: F401 - the gateway fixture, for the beat
from tests.gateway.test_gateway_heartbeat import commands_naming

pytestmark = pytest.mark.django_db(transaction=True)

TTL_S = 600


@pytest.fixture(autouse=True)
def _short_holds(settings):
    settings.BILLING_RESERVATION_TTL_S = TTL_S


@pytest.fixture
def no_audit(monkeypatch):
    """No rolling audit: an organisation is read only if its listing says it is due."""
    monkeypatch.setattr(sweep_index, "AUDIT_PER_RUN", 0)


def _organizations(num: int) -> list[int]:
    Organization.objects.bulk_create(
        [Organization(name=f"Idle {num}", slug=f"idle-{num}") for num in range(num)]
    )
    return list(Organization.objects.order_by("pk").values_list("pk", flat=True))


def _held(organization_id: int, request_id: str) -> None:
    """A call held as its admission holds it, its organisation listed as its gateway's beat lists it."""
    asyncio.run(
        reserve(
            organization_id=organization_id, api_key_id=None, amount=Decimal("0.01"), request_id=request_id
        )
    )
    sweep_index.list_due(
        get_redis(), {organization_id: redis_time() + settings.BILLING_RESERVATION_TTL_S - 1}
    )


def _organisations_read(commands: list[str]) -> set[int]:
    return {
        int(organization_id)
        for command in commands
        for organization_id in re.findall(r"\{org:(\d+)\}", command)
    }


def test_a_sweep_reads_only_the_organisations_with_something_due_not_every_organisation(
    monkeypatch, settings
):
    """Before, each sweep (every 30 s) read the deadlines and registrations of every organisation in the database:
    500 organisations, 500 of each a run, whatever was due. Now the due ones, and `AUDIT_PER_RUN` more in turn."""
    monkeypatch.setattr(sweep_index, "AUDIT_PER_RUN", 10)
    organization_ids = _organizations(500)
    lapsing, later = organization_ids[100], organization_ids[200]
    _held(lapsing, "lapsing")
    assert (
        sweeper.sweep_expired_reservations() == 0
    )  # the first builds the index: every organisation read once
    settings.BILLING_RESERVATION_TTL_S = 10 * TTL_S
    _held(later, "later")  # held ten times as long

    with (
        commands_naming(":reservation_deadlines") as deadlines,
        commands_naming(":replaying") as registrations,
    ):
        assert (
            sweeper.sweep_expired_reservations(now=redis_time() + TTL_S + 2) == 1
        )  # its gateway died: lapsed

    read = _organisations_read(deadlines) | _organisations_read(registrations)
    assert lapsing in read and later not in read
    assert len(read) <= 1 + sweep_index.AUDIT_PER_RUN, f"{len(read)} organisations read"
    assert reads.reserved_now(lapsing) == 0 and reads.reserved_now(later) == Decimal("0.01")
    assert sweeper.sweep_expired_reservations(now=redis_time() + 10 * TTL_S + 2) == 1  # "later", once due


def test_a_lost_index_is_rebuilt_by_the_next_sweep_and_no_lapsed_hold_is_missed():
    """Redis lost the index (its node's memory, a flush of it): the next sweep reads every organisation, lists each by
    its first deadline, and releases every hold that lapsed."""
    organization_ids = [OrganizationFactory().pk for _ in range(3)]
    for num, organization_id in enumerate(organization_ids):
        _held(organization_id, f"call-{num}")
    assert sweeper.sweep_expired_reservations() == 0
    get_redis().delete(redis_keys.SWEEP_DUE_KEY, redis_keys.SWEEP_DUE_BUILT_KEY)

    assert sweeper.sweep_expired_reservations(now=redis_time() + TTL_S + 2) == 3
    assert all(reads.reserved_now(organization_id) == 0 for organization_id in organization_ids)
    assert get_redis().exists(redis_keys.SWEEP_DUE_BUILT_KEY)


def test_an_organisation_left_out_of_the_index_is_found_by_the_rolling_audit(monkeypatch):
    """A moment of the index lost (its node came back a moment in the past, a sweeper killed between its claim and its
    listing): the organisation is read again by the audit, `AUDIT_PER_RUN` organisations a sweep, in turn."""
    monkeypatch.setattr(sweep_index, "AUDIT_PER_RUN", 2)
    organization_ids = [OrganizationFactory().pk for _ in range(5)]
    assert sweeper.sweep_expired_reservations() == 0  # built, nothing held
    asyncio.run(
        reserve(
            organization_id=organization_ids[-1],
            api_key_id=None,
            amount=Decimal("0.01"),
            request_id="unlisted",
        )
    )  # its listing lost
    lapsed_at = redis_time() + TTL_S + 2
    released = [
        sweeper.sweep_expired_reservations(now=lapsed_at) for _ in range(3)
    ]  # 2 + 2 + 1 organisations read
    assert sum(released) == 1 and reads.reserved_now(organization_ids[-1]) == 0


def test_a_gateway_killed_before_its_beat_listed_its_calls_has_their_holds_lapse(no_audit):
    """A guard: a gateway's beat lists the organisations of the calls it began (`presence._list_due`); killed before
    that, its requests are released by the dead-gateway sweep, which lists their organisations."""
    organization_id = OrganizationFactory().pk
    assert sweeper.sweep_expired_reservations() == 0  # the index built before the call
    # admitted by this process's gateway, which never beat (no alive key): killed before its first beat
    asyncio.run(
        reserve(organization_id=organization_id, api_key_id=None, amount=Decimal("0.01"), request_id="cut")
    )

    assert presence.sweep_dead_gateways() == 1
    assert sweeper.sweep_expired_reservations() == 0  # not yet lapsed
    assert sweeper.sweep_expired_reservations(now=redis_time() + TTL_S + 2) == 1
    assert reads.reserved_now(organization_id) == 0


@pytest.mark.usefixtures("gateway_alone")
def test_a_beat_lists_the_organisations_of_the_calls_it_began_and_their_holds_lapse_once_it_stops(no_audit):
    """A guard: the calls a gateway tracks are listed by its next beat, read by the sweep once their deadline passed."""
    organization_id = OrganizationFactory().pk
    assert sweeper.sweep_expired_reservations() == 0
    admitted = asyncio.run(
        reserve(organization_id=organization_id, api_key_id=None, amount=Decimal("0.01"), request_id="long")
    )
    presence.track("long", organization_id, "e-long", None, admitted.reservation)
    asyncio.run(presence.beat())
    assert get_redis().zscore(redis_keys.SWEEP_DUE_KEY, str(organization_id)) <= redis_time() + TTL_S
    presence.untrack("long")  # its gateway froze: no push, no end

    assert sweeper.sweep_expired_reservations(now=redis_time() + TTL_S + 2) == 1


def test_a_lapsed_registration_is_read_when_it_lapses_and_not_at_every_sweep_after(monkeypatch):
    """A replay's registration (`replayed.register_replaying_sync`) lists its organisation by when it lapses; a sweep
    past that reads it once (`count_lapsed_supersedes`), not at every sweep for the day it is kept (before: every 30 s;
    now once more per pass of the rolling audit, which reads it again in turn)."""
    monkeypatch.setattr(sweep_index, "AUDIT_PER_RUN", 1)
    for _ in range(5):
        OrganizationFactory()  # read by the audit before the replay's organisation
    endpoint = EndpointFactory()
    organization_id = endpoint.organization_id
    replayed.register_replaying_sync([usage_report(endpoint, request_id="replayed")])
    assert sweeper.sweep_expired_reservations() == 0
    counted = []
    monkeypatch.setattr(
        replayed,
        "count_lapsed_supersedes",
        lambda organization, registrations, now: counted.append(organization) or 0,
    )
    lapsed_at = redis_time() + replayed.REGISTRATION_TTL_S + 1
    assert sweeper.sweep_expired_reservations(now=lapsed_at) == 0  # read as it lapsed
    assert counted == [organization_id]
    for later in range(1, 4):
        sweeper.sweep_expired_reservations(now=lapsed_at + 30 * later)
    assert counted == [organization_id]  # kept a day, not read again


def test_a_reservation_made_while_the_index_is_built_is_not_lost():
    """A guard: an organisation's listing only ever moves earlier (`ZADD LT`), and a sweep takes the organisations it
    reads out of the index before it reads them, so a deadline listed meanwhile is listed after."""
    organization_id = OrganizationFactory().pk
    _held(organization_id, "first")
    assert sweeper.sweep_expired_reservations() == 0
    sweep_index.list_due(
        get_redis(), {organization_id: redis_time() + 10 * TTL_S}
    )  # a later listing: no later
    assert get_redis().zscore(redis_keys.SWEEP_DUE_KEY, str(organization_id)) <= redis_time() + TTL_S
    assert sweeper.sweep_expired_reservations(now=redis_time() + TTL_S + 2) == 1


@pytest.mark.usefixtures("gateway_alone")
def test_an_admission_whose_reply_was_lost_has_its_hold_lapse(no_audit):
    """The admission script ran and its reply was lost (a timeout): the call is never tracked, its end left to a later
    beat (`presence.end_later`), which lists its organisation, so the hold it may have made lapses at its deadline."""
    organization_id = OrganizationFactory().pk
    assert sweeper.sweep_expired_reservations() == 0  # the index built before the call
    asyncio.run(
        reserve(organization_id=organization_id, api_key_id=None, amount=Decimal("0.01"), request_id="lost")
    )
    presence.end_later(organization_id, "lost", call_token="lost-token")  # as `InferenceCall` does when the admission's reply is lost
    asyncio.run(presence.beat())

    assert sweeper.sweep_expired_reservations(now=redis_time() + TTL_S + 2) == 1
    assert reads.reserved_now(organization_id) == 0


class Killed(BaseException):
    """The process dies here (an OOM kill, a deploy)."""


def test_a_sweep_that_raises_part_way_lists_every_organisation_it_claimed_and_did_not_read(
    monkeypatch, no_audit
):
    """PostgreSQL restarting under the first of three organisations' reads: before, the two claimed after it were
    never listed again and held for good (found by the review of the sweeper's index)."""
    monkeypatch.setattr(sweep_index, "ORGS_PER_PIPELINE", 1)
    monkeypatch.setattr(sweeper, "ORGS_PER_PIPELINE", 1)
    organization_ids = _organizations(3)
    for organization_id in organization_ids:
        _held(organization_id, f"call-{organization_id}")
    assert sweeper.sweep_expired_reservations() == 0  # builds the index
    later = redis_time() + TTL_S + 5
    real_rows = sweeper._rows
    num_reads = []

    def rows_once_refused(organization_id, request_ids):
        num_reads.append(organization_id)
        if len(num_reads) == 1:
            raise OperationalError("server closed the connection unexpectedly")
        return real_rows(organization_id, request_ids)

    monkeypatch.setattr(sweeper, "_rows", rows_once_refused)
    with pytest.raises(OperationalError):
        sweeper.sweep_expired_reservations(later)
    assert sweeper.sweep_expired_reservations(later + 30) == 3
    assert [reads.reserved_now(organization_id) for organization_id in organization_ids] == [0, 0, 0]


def test_a_lapsed_registration_whose_count_failed_is_read_again_by_the_next_sweep(monkeypatch, no_audit):
    """Before, the sweep listed it again past its lapse only (`list_next`), as if counted: never read again."""
    (organization_id,) = _organizations(1)
    client = get_redis()
    assert sweeper.sweep_expired_reservations() == 0  # builds the index
    until = int(redis_time()) + 5
    client.hset(redis_keys.replaying_key(organization_id), "replayed", f"{until}.1")  # as a replay registers it
    sweep_index.list_due(client, {organization_id: until})
    counted = []

    def count_once_refused(organization, registrations, now):
        counted.append(organization)
        if len(counted) == 1:
            raise OperationalError("terminating connection due to administrator command")
        return 0

    monkeypatch.setattr(replayed, "count_lapsed_supersedes", count_once_refused)
    with pytest.raises(OperationalError):
        sweeper.sweep_expired_reservations(until + 10)
    sweeper.sweep_expired_reservations(until + 40)
    assert counted == [organization_id, organization_id]


def _killed_after(monkeypatch, script) -> None:
    """`script` runs, then the process dies (an OOM kill, a deploy) before its caller's next step."""
    real = script.run_sync

    def run_then_killed(*, keys, args):
        real(keys=keys, args=args)
        raise Killed()

    monkeypatch.setattr(script, "run_sync", run_then_killed)


def test_a_dead_gateway_sweep_killed_once_it_released_leaves_its_organisation_listed(monkeypatch, no_audit):
    """Before, it listed the organisation after releasing its requests: killed between the two, the hold its
    gateway's beat never listed was never read (the release had dropped what would list it again)."""
    organization_id = OrganizationFactory().pk
    assert sweeper.sweep_expired_reservations() == 0  # builds the index
    asyncio.run(
        reserve(organization_id=organization_id, api_key_id=None, amount=Decimal("0.01"), request_id="cut")
    )  # its gateway killed before its beat listed it
    _killed_after(monkeypatch, presence._RELEASE_REQUESTS)
    with pytest.raises(Killed):
        presence.sweep_dead_gateways()
    assert sweeper.sweep_expired_reservations(redis_time() + TTL_S + 2) == 1
    assert reads.reserved_now(organization_id) == 0


def test_a_replay_killed_once_it_registered_leaves_its_organisation_listed(monkeypatch, no_audit):
    """Before, it listed the organisation after registering its rows: killed between the two, the registration was
    never read once it lapsed."""
    endpoint = EndpointFactory()
    assert sweeper.sweep_expired_reservations() == 0  # builds the index
    _killed_after(monkeypatch, replayed._REGISTER)
    with pytest.raises(Killed):
        replayed.register_replaying_sync([usage_report(endpoint, request_id="replayed")])
    counted = []
    monkeypatch.setattr(
        replayed,
        "count_lapsed_supersedes",
        lambda organization, registrations, now: counted.append(organization) or 0,
    )
    sweeper.sweep_expired_reservations(redis_time() + replayed.REGISTRATION_TTL_S + 1)
    assert counted == [endpoint.organization_id]
