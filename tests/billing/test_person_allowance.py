"""The allowance without a payment method is a person's, not an organisation's
(`billing.standing.limit_without_payment_method`, shared): what the other organisations of an organisation's people
(its creator while they own it, its owners once handed on: `controlplane.accounts.organizations.
organizations_of_its_people`, closed ones too) spent this month while they had no card counts against it, in the
gateway's limits too, refused with the limit's own 402 (`payment_method`).

Before, each organisation had its own: one verified mailbox made `MAX_OWNED_ORGANIZATIONS` organisations and spent
the limit in each, 5 x the allowance a month. Reserved as the gateway does, in its admission script, as
`tests/billing/test_payment_standing.py` does."""

import base64
import json
from datetime import datetime, timedelta
from decimal import Decimal

import pytest
from django.contrib.auth import get_user_model
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from billing import periods, services, stripe_sync, tasks
from billing.models import BillingAccount
from billing.periods import current_period, period_containing
from billing.quota.counters import refresh_limits, to_units
from billing.quota.rebuild import _read_rebuild
from controlplane import redis_keys
from controlplane.accounts import organizations
from controlplane.accounts.models import AuditEvent, Invitation, Membership, Organization, Role
from controlplane.accounts.services import SYSTEM, Actor, create_organization
from controlplane.accounts.signup import mark_email_verified
from controlplane.redis_client import get_redis
from endpoints.closing import close_organization, end_account
from endpoints.models import Endpoint
from tests.billing.test_payment_standing import _refusal, _spend, _webhook
from tests.billing.test_spend_ceiling import _usage
from tests.factories import MembershipFactory, UserFactory, signed_in_api_client

# NOTE: admission rebuilds counters in a worker thread, which sees only committed rows.
pytestmark = pytest.mark.django_db(transaction=True)

LIMIT = Decimal("1.00")


@pytest.fixture
def person(settings, fake_stripe):
    """Stripe configured (the fake), a limit of $1 without a payment method, and a verified person."""
    settings.SPEND_LIMIT_WITHOUT_PAYMENT_METHOD = LIMIT
    user = UserFactory()
    mark_email_verified(user)
    return user


def _own_organization(user, name: str):
    """An organisation `user` creates by the one path sign-up and "New organisation" take (past their throttle), with
    its Stripe customer (no card)."""
    organization = create_organization(Actor(user=user), name=name, owner=user)
    stripe_sync.ensure_customer(organization.pk)
    return organization


def _add_card(fake_stripe, organization) -> None:
    customer = BillingAccount.objects.get(organization=organization).stripe_customer_id
    _webhook("customer.updated", fake_stripe.set_default_payment_method(customer, "pm_card_visa"))


def _run_queued_allowance_refreshes() -> list[list[int]]:
    """Run the allowance refreshes queued for a worker (`services.ALLOWANCE_REFRESH_TASK`), as one would; their
    arguments (organisation, person)."""
    redis, queued = get_redis(), []
    for raw in redis.lrange("celery", 0, -1):
        message = json.loads(raw)
        if message["headers"]["task"] == services.ALLOWANCE_REFRESH_TASK:
            redis.lrem("celery", 1, raw)
            queued.append(json.loads(base64.b64decode(message["body"]))[0])
    for args in queued:
        tasks.refresh_allowances(*args)
    return queued


def test_a_persons_second_organisation_spends_only_what_the_first_left_of_the_allowance(person):
    first, second = _own_organization(person, "First Ltd"), _own_organization(person, "Second Ltd")
    _usage(first, "0.90")

    refused = _refusal(second, "0.20")

    assert refused.reason == "payment_method" and "$1.00" in refused.message  # before: admitted, its own $1
    assert "other organisations of its owners" in refused.message
    _spend(second, "0.09")  # what is left of the person's allowance


def test_five_organisations_of_one_mailbox_share_one_allowance(person):
    made = [_own_organization(person, f"Sign-up {number}") for number in range(5)]
    for organization in made[:4]:
        _usage(organization, "0.25")

    assert _refusal(made[4], "0.01").reason == "payment_method"  # before: $1 more, $5 in all


def test_an_organisation_whose_counter_was_built_sees_the_others_spend_at_the_beat_tasks_next_run(person):
    first, second = _own_organization(person, "First Ltd"), _own_organization(person, "Second Ltd")
    _spend(second, "0.01")  # its counter exists, with the whole allowance
    _usage(first, "0.95")

    assert tasks.refresh_shared_allowances() >= 1

    assert _refusal(second, "0.10").reason == "payment_method"  # before: $0.99 left to it


def test_the_beat_task_reads_nothing_more_for_an_organisation_whose_person_has_no_other(person):
    # Before: five queries for each organisation that spent without a card this month, most of them a person's only
    # one, every minute, to write nothing: ~6 ms each, and past ~6,000 of them a run outlasted its budget and left a
    # random part of those that share one to the next.
    first = _own_organization(person, "First Ltd")
    _own_organization(person, "Second Ltd")
    _usage(first, "0.10")

    def queries_of_a_run() -> int:
        with CaptureQueriesContext(connection) as queries:
            assert tasks.refresh_shared_allowances() == 1  # the second
        return len(queries)

    alone = [_own_organization(UserFactory(), f"Alone {number}") for number in range(4)]
    for organization in alone[:2]:
        _usage(organization, "0.10")
    with_two_alone = queries_of_a_run()
    for organization in alone[2:]:
        _usage(organization, "0.10")

    assert queries_of_a_run() == with_two_alone


@pytest.mark.parametrize(("address", "other_spelling"), [("ada@example.test", "ada+second@example.test"),
                                                          ("ada@gmail.com", "a.da@gmail.com")])
def test_the_beat_task_writes_the_limits_of_an_organisation_of_another_spelling_of_the_mailbox_that_spent(
        settings, fake_stripe, address, other_spelling):
    settings.SPEND_LIMIT_WITHOUT_PAYMENT_METHOD = LIMIT
    ada, tagged = UserFactory(username=address), UserFactory(username=other_spelling)
    mine, tagged_ones = _own_organization(ada, "Mine Ltd"), _own_organization(tagged, "Tagged Ltd")
    _spend(tagged_ones, "0.01")  # its counter exists, with the whole allowance
    _usage(mine, "0.95")

    assert tasks.refresh_shared_allowances() == 1

    assert _refusal(tagged_ones, "0.10").reason == "payment_method"


def test_a_closed_organisation_still_counts(person):
    closed = _own_organization(person, "Closed Ltd")
    _usage(closed, "0.80")
    close_organization(Actor(user=person), closed, confirm_name=closed.name)
    third = _own_organization(person, "Third Ltd")

    assert _refusal(third, "0.30").reason == "payment_method"
    _spend(third, "0.15")


def test_an_organisation_with_a_card_spends_its_own_way_and_takes_nothing_of_the_allowance(person, fake_stripe):
    carded, second = _own_organization(person, "Carded Ltd"), _own_organization(person, "Second Ltd")
    _spend(second, "0.01")  # its counter exists
    _usage(carded, "0.90")
    tasks.refresh_shared_allowances()
    assert _refusal(second, "0.50").reason == "payment_method"

    _add_card(fake_stripe, carded)  # its spend is a card's now: the others' limits are written again at once

    _spend(second, "0.50")


def test_an_organisation_staff_mark_invoiced_without_card_takes_nothing_of_the_allowance_from_then_on(person):
    vouched, second = _own_organization(person, "Vouched Ltd"), _own_organization(person, "Second Ltd")
    _usage(vouched, "0.90")
    assert _refusal(second, "0.50").reason == "payment_method"

    services.set_invoiced_without_card(SYSTEM, vouched, allowed=True)  # the others' limits are written again at once

    _spend(second, "0.50")


def test_another_persons_spend_leaves_the_allowance_whole(person):
    stranger = UserFactory()
    mark_email_verified(stranger)
    theirs, mine = _own_organization(stranger, "Theirs Ltd"), _own_organization(person, "Mine Ltd")
    _usage(theirs, "0.95")
    tasks.refresh_shared_allowances()

    _spend(mine, "0.90")


def test_an_organisation_handed_on_brings_its_share_from_then_to_its_new_owner(person):
    stranger = UserFactory()
    mark_email_verified(stranger)
    theirs, mine = _own_organization(stranger, "Theirs Ltd"), _own_organization(person, "Mine Ltd")
    _spend(mine, "0.01")  # its counter exists, with the whole allowance
    _usage(theirs, "0.90")
    MembershipFactory(organization=theirs, user=person, role=Role.OWNER)  # as an accepted invitation makes it
    assert _run_queued_allowance_refreshes() == [[theirs.pk, person.pk]]
    _spend(mine, "0.50")  # joining shares nothing while its creator owns it

    Membership.objects.filter(organization=theirs, user=stranger).delete()  # its creator leaves: it is handed on
    assert _run_queued_allowance_refreshes() == [[theirs.pk, stranger.pk]]
    _usage(theirs, "0.40")
    tasks.refresh_shared_allowances()

    assert _refusal(mine, "0.20").reason == "payment_method"  # its own $0.51 and the $0.40 spent since


def test_without_stripe_nothing_is_limited_and_no_refresh_is_queued(settings):
    settings.SPEND_LIMIT_WITHOUT_PAYMENT_METHOD = LIMIT
    user = UserFactory()
    mark_email_verified(user)
    first = create_organization(Actor(user=user), name="First Ltd", owner=user)
    second = create_organization(Actor(user=user), name="Second Ltd", owner=user)
    _usage(first, "5.00")

    _spend(second, "5.00")
    assert _run_queued_allowance_refreshes() == [] and tasks.refresh_shared_allowances() == 0


@pytest.mark.parametrize("address", ["ada+second@example.test", "ada@example.test"])
def test_accounts_at_one_mailbox_with_a_sub_address_share_one_allowance(settings, fake_stripe, address):
    settings.SPEND_LIMIT_WITHOUT_PAYMENT_METHOD = LIMIT
    first_account = UserFactory(username="ada+first@example.test")
    second_account = UserFactory(username=address)
    for account in (first_account, second_account):
        mark_email_verified(account)
    first, second = _own_organization(first_account, "First Ltd"), _own_organization(second_account, "Second Ltd")
    _usage(first, "0.90")

    assert _refusal(second, "0.20").reason == "payment_method"  # before: each sub-address had its own $1


@pytest.mark.parametrize(("first_address", "second_address"), [
    ("ada@gmail.com", "a.da@gmail.com"), ("a.da@gmail.com", "ada@gmail.com"), ("a.d.a@gmail.com", "ad.a+x@googlemail.com"),
    ("ada+x@googlemail.com", "a.da@gmail.com")])
def test_accounts_at_one_gmail_mailbox_spelt_with_dots_share_one_allowance(settings, fake_stripe, first_address,
                                                                            second_address):
    # Before: Gmail delivers `a.da@gmail.com` and `ada@googlemail.com` to `ada@gmail.com`'s inbox, and each was an
    # account of its own with its own allowance: 2^(n-1) of them for an n-letter Gmail mailbox, the most common one.
    settings.SPEND_LIMIT_WITHOUT_PAYMENT_METHOD = LIMIT
    first_account, second_account = UserFactory(username=first_address), UserFactory(username=second_address)
    first, second = _own_organization(first_account, "First Ltd"), _own_organization(second_account, "Second Ltd")
    _usage(first, "0.90")

    assert _refusal(second, "0.20").reason == "payment_method"


def test_the_accounts_of_a_gmail_mailbox_are_read_through_the_index_of_their_dotless_local_part():
    # NOTE: the expression `organizations.dotless_local` writes must be the index's (accounts' migration 0021) to the
    # letter: another one finds nothing by it, and each write of a Gmail person's limits read every account.
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
        plan = organizations.at_gmail({"ada"}).explain()

    assert "auth_user_dotless_local" in plan


def test_who_created_an_organisation_and_what_a_person_created_are_read_through_the_creations_own_indexes(fake_stripe):
    # NOTE: by `organization, -created_at` alone, a card's first sighting (a Stripe webhook), a billing mode's change
    # and the beat read every event of a large organisation to find its one creation (accounts' migration 0024).
    ada = UserFactory(username="ada@example.test")
    organization = _own_organization(ada, "Mine Ltd")
    AuditEvent.objects.bulk_create([AuditEvent(organization=organization, actor=ada, action="key.create")
                                    for _ in range(3000)])  # a busy organisation's log: its creation is one event
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("ANALYZE controlplane_auditevent")
        cursor.execute("SET LOCAL enable_seqscan = off")
        with CaptureQueriesContext(connection) as queries:
            organizations.people_of(organization.pk)
            list(organizations.held_by_any([ada.pk]))
        reads = [query["sql"] for query in queries.captured_queries if "controlplane_auditevent" in query["sql"]]
        plans = []
        for sql in reads:
            cursor.execute(f"EXPLAIN {sql}")
            plans.append("\n".join(row[0] for row in cursor.fetchall()))

    assert len(plans) == 2
    assert "audit_org_creation_by_org" in plans[0]
    assert "audit_org_creation_by_actor" in plans[1]


@pytest.mark.parametrize("address", ["adam@example.test", "ada+second@example.org", "xada+second@example.test",
                                     "a.da@example.test", "ada@gmail.com.example.test"])
def test_another_mailbox_that_only_looks_alike_keeps_its_own_allowance(settings, fake_stripe, address):
    settings.SPEND_LIMIT_WITHOUT_PAYMENT_METHOD = LIMIT
    ada, other = UserFactory(username="ada@example.test"), UserFactory(username=address)
    theirs, mine = _own_organization(other, "Theirs Ltd"), _own_organization(ada, "Mine Ltd")
    _usage(theirs, "0.90")

    _spend(mine, "0.90")


def test_a_counter_rebuilt_for_the_new_month_leaves_the_whole_allowance_whatever_postgresqls_clock_says(person):
    # Before: a counter the gateway rebuilt for the month Redis's clock is in took the room of the allowance from what
    # the other organisations spent in the month PostgreSQL's clock is in: at a month's start, a database a moment
    # behind Redis gave the new month's counter what the old month left, here $0.10, and nothing wrote it again (the
    # beat task writes the others of an organisation that spends, never that one), so it kept it for the month.
    first, second = _own_organization(person, "First Ltd"), _own_organization(person, "Second Ltd")
    _usage(first, "0.90")
    next_month = period_containing(current_period().end)

    assert _read_rebuild("org", second.pk, None, next_month, ()).fields["cap"] == str(to_units(LIMIT))
    assert _read_rebuild("org", second.pk, None, current_period(), ()).fields["cap"] == str(to_units(Decimal("0.10")))


def test_limits_written_just_before_a_month_ends_leave_the_new_months_counter_the_whole_allowance(person, monkeypatch):
    # Before: a write of the limits near a month's edge wrote this month's room to both months' counters: the new
    # month's, made by a gateway whose (Redis's) clock was past midnight already, kept $0.10 of the allowance for the
    # month, as nothing writes the limits of an organisation that spends alone again.
    first, second = _own_organization(person, "First Ltd"), _own_organization(person, "Second Ltd")
    _usage(first, "0.90")
    next_month = period_containing(current_period().end)
    counters = {period.key: redis_keys.org_period_key(second.pk, period.key) for period in (current_period(), next_month)}
    for period in (current_period(), next_month):  # both months' counters exist, as a gateway made them
        get_redis().hset(counters[period.key], mapping=_read_rebuild("org", second.pk, None, period, ()).fields)
    offset = next_month.start - timedelta(minutes=5) - datetime.now(next_month.start.tzinfo)

    class _NearTheEdge(datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime.now(tz) + offset

    monkeypatch.setattr(periods, "datetime", _NearTheEdge)  # this process five minutes before the month ends
    refresh_limits(BillingAccount.objects.get(organization=second))

    caps = {key: get_redis().hget(counter, "cap") for key, counter in counters.items()}
    assert caps == {current_period().key: str(to_units(Decimal("0.10"))), next_month.key: str(to_units(LIMIT))}


# `"ada+second"@` is `ada+second@` (RFC 5322: the quotes are no part of the address), `"\ada"@` is `ada@`, and
# `"ad\a"@`: every letter may be written as a quoted pair, 2^n spellings of an n-letter mailbox.
QUOTED_SPELLINGS = ['"ada+second"@example.test', '"\\ada"@example.test', '"ad\\a"@example.test',
                    '"ada"@example.test']


@pytest.mark.parametrize("address", QUOTED_SPELLINGS)
def test_sign_up_refuses_a_quoted_spelling_of_a_mailbox_with_a_form_error(client, address):
    # Before: each signed up, an account of its own with its own allowance without a card (and its own
    # `MAX_OWNED_ORGANIZATIONS`), delivered to ada@example.test's inbox: the sub-address rule reads the address as
    # written (`organizations.same_mailbox`), and Django's check passes a quoted local part.
    answer = client.post("/signup/", {"email": address, "password": "a long passphrase 1",
                                      "organization_name": "Acme"})

    assert answer.status_code == 200 and "without quotes" in answer.content.decode()
    assert not get_user_model().objects.exists()


def test_an_invitation_to_a_quoted_spelling_of_a_mailbox_is_a_field_error(org, member_client_factory):
    owner = signed_in_api_client(member_client_factory(org, Role.OWNER).user)

    refused = owner.post("/api/v1/invitations/", {"email": '"ada+second"@example.test', "role": "owner"},
                         format="json")

    assert refused.status_code == 400 and list(refused.json()) == ["email"]
    assert not Invitation.objects.exists()


@pytest.mark.parametrize("address", ["ada+first@example.test", "ada@example.test", "ada+second@example.test"])
def test_an_account_deleted_after_spending_leaves_the_next_account_at_its_mailbox_only_what_it_left(settings, fake_stripe,
                                                                                                     address):
    # Before: the deletion replaced the address by a tombstone, and with it every link to the mailbox: a sub-address
    # signed up, spent the allowance, was deleted (its organisation closed) and the next sub-address, or the same
    # address signed up again, had the whole allowance again, as often as sign-up's throttle allowed.
    settings.SPEND_LIMIT_WITHOUT_PAYMENT_METHOD = LIMIT
    departed = UserFactory(username="ada+first@example.test", email="ada+first@example.test")
    mark_email_verified(departed)
    theirs = _own_organization(departed, "Theirs Ltd")
    _usage(theirs, "0.90")
    Endpoint.objects.filter(organization=theirs).update(deleted_at=theirs.created_at)  # nothing live holds it open
    end_account(Actor(user=departed), departed)

    next_account = UserFactory(username=address, email=address)
    mark_email_verified(next_account)
    mine = _own_organization(next_account, "Mine Ltd")

    assert _refusal(mine, "0.20").reason == "payment_method"
    _spend(mine, "0.09")


def _verified(username: str):
    user = UserFactory(username=username, email=username)
    mark_email_verified(user)
    return user


def test_a_stranger_invited_as_owner_neither_drains_nor_is_drained_by_the_inviters_allowance(person):
    # Before: an owner who joined became one of the organisation's people both ways: a hostile inviter spent his
    # organisation's allowance and the stranger's own organisations were refused for it (and hers ate his).
    alice = _verified("alice@example.test")
    bobs, alices = _own_organization(person, "Bob Ltd"), _own_organization(alice, "Alice Ltd")
    _spend(alices, "0.01")  # its counter exists, with the whole allowance
    MembershipFactory(organization=bobs, user=alice, role=Role.OWNER)  # as an accepted invitation makes it
    _run_queued_allowance_refreshes()
    _usage(bobs, "0.95")
    tasks.refresh_shared_allowances()

    _spend(alices, "0.90")
    _usage(alices, "0.90")
    tasks.refresh_shared_allowances()
    assert organizations.organizations_of_its_people(bobs.pk) == []
    assert organizations.organizations_of_its_people(alices.pk) == []


def _hand_on(organization, *, to, by) -> None:
    """`to` made an owner of `by`'s organisation, and `by` leaving it, as an accepted invitation and leaving do."""
    MembershipFactory(organization=organization, user=to, role=Role.OWNER)
    Membership.objects.filter(organization=organization, user=by).delete()
    _run_queued_allowance_refreshes()


def test_what_an_organisation_spends_once_handed_on_counts_for_its_new_owner_and_still_its_creator(person):
    # Its creator stays refused for what its new owners spend there (a card lifts it): freed of it, he had a fresh
    # allowance for each one he made (`test_organisations_one_person_made_share_one_allowance_whoever_held_them_...`).
    heir = _verified("heir@example.test")
    handed, heirs = _own_organization(person, "Handed Ltd"), _own_organization(heir, "Heir Ltd")
    _spend(heirs, "0.01")  # its counter exists, with the whole allowance
    _hand_on(handed, to=heir, by=person)
    assert Organization.objects.get(pk=handed.pk).handed_on_at is not None

    _usage(handed, "0.90")
    tasks.refresh_shared_allowances()

    assert _refusal(_own_organization(person, "Next Ltd"), "0.20").reason == "payment_method"
    assert _refusal(heirs, "0.20").reason == "payment_method"  # handing it on gave nobody a fresh allowance


def test_what_an_organisation_spent_before_it_was_handed_on_stays_its_creators(person):
    # A hostile creator spends the allowance in his organisation, makes a stranger its owner and leaves: her own
    # organisations keep theirs, and his new ones get no fresh one.
    alice = _verified("alice@example.test")
    bobs, alices = _own_organization(person, "Bob Ltd"), _own_organization(alice, "Alice Ltd")
    _spend(alices, "0.01")  # its counter exists, with the whole allowance
    _usage(bobs, "0.90")
    _hand_on(bobs, to=alice, by=person)
    tasks.refresh_shared_allowances()

    _spend(alices, "0.90")
    assert _refusal(_own_organization(person, "Next Ltd"), "0.20").reason == "payment_method"


def test_an_organisation_whose_creator_owns_it_again_at_another_account_of_their_mailbox_is_theirs_again(person):
    heir, tagged = _verified("heir@example.test"), _verified(person.username.replace("@", "+second@"))
    kept = _own_organization(person, "Kept Ltd")
    _hand_on(kept, to=heir, by=person)
    MembershipFactory(organization=kept, user=tagged, role=Role.OWNER)

    assert Organization.objects.get(pk=kept.pk).handed_on_at is None
    _usage(kept, "0.90")
    assert _refusal(_own_organization(person, "Next Ltd"), "0.20").reason == "payment_method"


def test_organisations_one_person_made_share_one_allowance_whoever_held_them_as_they_spent(person):
    # Before: an organisation handed on was its creator's only until then, and its owners' now, not who held it: the
    # creator handed each of the five he may make to a second account of his, spent $0.90 in it there, and handed it
    # on again to a third that keeps it; the second account, no owner any more, had its whole allowance back, the
    # creator's was untouched, and the next one spent $0.90 more: five allowances a month for one mailbox.
    heir, keeper = _verified("heir@example.test"), _verified("keeper@example.test")
    laundered, next_one = _own_organization(person, "First Ltd"), _own_organization(person, "Next Ltd")
    _spend(next_one, "0.01")  # its counter exists, with the whole allowance
    _hand_on(laundered, to=heir, by=person)
    _usage(laundered, "0.90")
    _hand_on(laundered, to=keeper, by=heir)
    tasks.refresh_shared_allowances()

    assert _refusal(next_one, "0.20").reason == "payment_method"
