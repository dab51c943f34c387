"""One card's month is shared (`billing.standing.card_spend`), its history is not (`billing.standing.trusted_history`):
each organisation's ceiling comes from its own paid history and that of the organisations of its card one of its
owners owns too, and it may spend of it what every other organisation that held the card this month has not spent.

Before the card was kept, a thief with one stolen card signed up N organisations, attached the card to each, and had
N x $100 a month. The first redesign (a hostile review's findings, each a test here) summed every paid history on the
card: a thief adding a customer's card number inherited its ceiling; switching card freed the old card's room; a
tenant read another's month spend; two payments on one card deadlocked. Reserved as the gateway does, in its
admission script, as `tests/billing/test_spend_ceiling.py` does."""

import base64
import threading
from decimal import Decimal

import pytest
from django.core import mail
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from billing import services, standing, stripe_sync, tasks
from billing.models import BillingAccount, BillingMode
from controlplane.accounts.models import Role
from controlplane.accounts.services import SYSTEM
from tests.billing.test_payment_standing import _refusal, _spend, _webhook
from tests.billing.test_spend_ceiling import DEFAULT, _ceilings, _usage
from tests.factories import MembershipFactory, OrganizationFactory, UserFactory

# NOTE: admission rebuilds counters in a worker thread, which sees only committed rows.
pytestmark = pytest.mark.django_db(transaction=True)


class _Org:
    def __init__(self, fake_stripe, name: str, *, owner=None):
        self.stripe = fake_stripe
        self.org = OrganizationFactory(name=name)
        self.owner = owner or UserFactory()
        MembershipFactory(organization=self.org, user=self.owner, role=Role.OWNER)
        self.customer = stripe_sync.ensure_customer(self.org.pk)

    def add_card(self, fingerprint: str) -> None:
        """The card added in the Customer Portal, and its webhook."""
        method = self.stripe.add_card(fingerprint=fingerprint)
        _webhook("customer.updated", self.stripe.set_default_payment_method(self.customer, method))

    def pay(self, invoice_id: str, cents: int) -> None:
        _webhook("invoice.paid", {"id": invoice_id, "object": "invoice", "customer": self.customer, "status": "paid",
                                  "currency": "usd", "amount_due": cents, "amount_paid": cents,
                                  "lines": {"object": "list", "data": []}})

    def ceiling(self) -> standing.SpendCeiling:
        return standing.spend_ceiling(BillingAccount.objects.get(organization=self.org))


@pytest.fixture
def ceilings(settings, monkeypatch):
    settings.SPEND_CEILINGS = _ceilings(DEFAULT, monkeypatch)


@pytest.fixture
def one_card(ceilings, fake_stripe):
    """The documented default ceilings, and two postpaid organisations with the same card (one fingerprint)."""
    first, second = _Org(fake_stripe, "First Sign-up Ltd"), _Org(fake_stripe, "Second Sign-up Ltd")
    first.add_card("fp_stolen")
    second.add_card("fp_stolen")
    return first, second


def test_two_organisations_on_one_card_share_one_ceiling_and_another_card_keeps_its_own(one_card, fake_stripe):
    first, second = one_card
    other = _Org(fake_stripe, "Other Card Ltd")
    other.add_card("fp_other")
    _spend(second.org, "1.00")  # its counter exists, with the ceiling as it was
    _usage(first.org, "100")  # the first spent the card's $100
    assert tasks.refresh_card_ceilings() == 2  # the beat task writes the shared limits again (not the other card)
    refused = _refusal(second.org, "1.00")
    assert refused.reason == "spend_ceiling"  # before the card was kept: the second had $100 of its own
    assert "other organisations have the same card on file" in refused.message  # review: it blamed payment history
    shown = second.ceiling()
    assert (shown.amount, shown.room, shown.num_other_organizations_on_card) == (Decimal(100), Decimal(0), 1)
    _spend(other.org, "99.00")  # another card: its own $100
    assert other.ceiling().num_other_organizations_on_card == 0


def test_a_thief_adding_a_customers_card_inherits_none_of_its_history_and_the_customers_own_second_org_does(
        ceilings, fake_stripe, member_client_factory):
    """Review finding 1: the paid history of every organisation of the card was summed: a new sign-up adding a
    customer's card number (the customer had paid $5,000) had no ceiling at all, and its API showed the customer's
    paid total."""
    customer = _Org(fake_stripe, "Customer Ltd")
    customer.add_card("fp_customer")
    customer.pay("in_customer", 500_000)
    assert customer.ceiling().amount is None
    thief = _Org(fake_stripe, "Thief Ltd")
    thief.add_card("fp_customer")
    assert (thief.ceiling().amount, thief.ceiling().paid) == (Decimal(100), Decimal(0))  # before: None, $5,000
    assert _refusal(thief.org, "4000.00").reason == "spend_ceiling"  # before: admitted
    body = member_client_factory(thief.org, Role.ADMIN).get("/api/v1/billing/").json()["standing"]["spend_ceiling"]
    assert body["net_paid"] == "0.00"  # before: "5000.00"

    second = _Org(fake_stripe, "Customer Labs", owner=customer.owner)  # the customer's own: same owner, same card
    second.add_card("fp_customer")
    assert second.ceiling().amount is None  # its owner's paid history counts for it
    assert thief.ceiling().amount == Decimal(100)
    _spend(second.org, "200.00")  # no ceiling in the gateway either

    # Second review, F: a change of owner wrote no limits: the gateway kept "none" until the beat task.
    from controlplane.accounts.models import Membership
    membership = Membership.objects.get(organization=second.org, user=customer.owner)
    membership.role = Role.ADMIN
    membership.save(update_fields=["role"])  # as `controlplane.accounts.members` changes a role
    _run_queued_card_refreshes()
    assert _refusal(second.org, "0.01").reason == "spend_ceiling"  # before: admitted, Redis still had none


def _run_queued_card_refreshes() -> list[str]:
    """Run the card refreshes queued for a worker (`services.CARD_REFRESH_TASK`), as one would; their cards."""
    import json

    from controlplane.redis_client import get_redis

    redis, cards = get_redis(), []
    for raw in redis.lrange("celery", 0, -1):
        message = json.loads(raw)
        if message["headers"]["task"] == services.CARD_REFRESH_TASK:
            redis.lrem("celery", 1, raw)
            cards += json.loads(base64.b64decode(message["body"]))[0]
    for fingerprint in cards:
        services.refresh_card(fingerprint)
    return cards


def test_member_changes_queue_one_refresh_of_their_card_for_a_worker_and_hold_no_request(ceilings, fake_stripe):
    """Third review, 2: each save or delete of a membership rewrote every organisation of its card in the request:
    a no-op role change through the members API, repeated, cost ~10 queries an organisation each time (and with Redis
    away ~5-10 s an organisation), a user's removal from K organisations of one card K × K."""
    customer = _Org(fake_stripe, "Customer Ltd")
    customer.add_card("fp_queued")
    others = [_Org(fake_stripe, f"Sign-up {number}") for number in range(3)]
    for other in others:
        other.add_card("fp_queued")
    _run_queued_card_refreshes()
    from controlplane.accounts.models import Membership
    membership = Membership.objects.get(organization=customer.org, user=customer.owner)

    with CaptureQueriesContext(connection) as queries:
        for _ in range(5):
            membership.save(update_fields=["role"])  # unchanged, as a repeated no-op PATCH saves it
    # before: ~10 a save for each of the card's four organisations; one of the 5 a save reads whether the organisation
    # was handed on (`organizations.note_handed_on`)
    assert len(queries) <= 5 * 5
    assert _run_queued_card_refreshes() == ["fp_queued"]  # one queued, run by a worker


@pytest.mark.parametrize("role", [Role.VIEWER, Role.ADMIN])
def test_a_member_who_is_not_an_owner_of_both_brings_no_history(ceilings, fake_stripe, role):
    """Second review, A: any shared member was trusted: a contractor invited to a customer (paid $5,000) as a viewer
    made an organisation of their own, added the company card, and had no ceiling at all ($20,000 admitted)."""
    customer = _Org(fake_stripe, "Customer Ltd")
    customer.add_card("fp_corp")
    customer.pay("in_customer", 500_000)
    contractor = UserFactory()
    MembershipFactory(organization=customer.org, user=contractor, role=role)
    side = _Org(fake_stripe, "Contractor's Own", owner=contractor)
    side.add_card("fp_corp")
    assert side.ceiling().amount == Decimal(100)  # before: None
    assert _refusal(side.org, "20000.00").reason == "spend_ceiling"  # before: admitted
    customer.owner.is_active = False  # an owner of both who is no longer active brings none either
    customer.owner.save(update_fields=["is_active"])
    MembershipFactory(organization=side.org, user=customer.owner, role=Role.OWNER)
    assert standing.trusted_history(side.org.pk, [customer.org.pk]) == []


def test_leaving_a_card_for_another_or_for_a_method_that_is_not_a_card_leaves_the_month_counted_on_it(
        ceilings, fake_stripe):
    """Review finding 2: the card an organisation left took its month's spend with it: four sign-ups each spent $99
    on card X and moved to card Y, all four admitted ($396 on X), and a move to a bank debit freed X the same way."""
    first = _Org(fake_stripe, "Sign-up 0")
    first.add_card("fp_X")
    _spend(first.org, "99.00")
    _usage(first.org, "99")
    first.add_card("fp_Y")  # its $99 stays counted on X, this month
    second = _Org(fake_stripe, "Sign-up 1")
    second.add_card("fp_X")
    assert second.ceiling().room == Decimal(0)  # before: $100, the first's $99 gone with it to Y (counted as $100)
    assert _refusal(second.org, "2.00").reason == "spend_ceiling"

    fake_stripe.payment_methods["pm_sepa"] = {"id": "pm_sepa", "object": "payment_method", "type": "sepa_debit",
                                              "sepa_debit": {"fingerprint": "sx"}}
    _webhook("customer.updated", fake_stripe.set_default_payment_method(second.customer, "pm_sepa"))
    assert BillingAccount.objects.get(organization=second.org).card_fingerprint == "sepa_debit:sx"  # not X's
    third = _Org(fake_stripe, "Sign-up 2")
    third.add_card("fp_X")
    assert third.ceiling().num_other_organizations_on_card == 2  # before: 0, X had no holder left
    assert third.ceiling().room == Decimal(0)  # $99 counted in whole $5 steps
    fourth = _Org(fake_stripe, "Sign-up 3")  # the same bank account as the second: shared as a card is
    fake_stripe.payment_methods["pm_sepa4"] = {**fake_stripe.payment_methods["pm_sepa"], "id": "pm_sepa4"}
    _webhook("customer.updated", fake_stripe.set_default_payment_method(fourth.customer, "pm_sepa4"))
    assert fourth.ceiling().num_other_organizations_on_card == 1  # review D, before: 0


def test_sign_ups_on_a_customers_card_eat_its_room_each_up_to_its_own_ceiling_as_the_readme_says(ceilings, fake_stripe):
    """Second review, B: the README said a customer's room could be eaten only by one thief's $100; five sign-ups each
    spent $100 of a customer's $500. Each is held to its own ceiling, whatever room the others leave: N x $100."""
    customer = _Org(fake_stripe, "Customer Ltd")
    customer.add_card("fp_customer")
    customer.pay("in_customer", 10_000)  # $500 a month
    thieves = [_Org(fake_stripe, f"Sign-up {i}") for i in range(2)]
    for thief in thieves:
        thief.add_card("fp_customer")
    for thief in thieves:
        _spend(thief.org, "100.00")  # each its own $100: the other's reservation is not in the ledger
        assert _refusal(thief.org, "0.01").reason == "spend_ceiling"  # never past its own ceiling
    for thief in thieves:
        _usage(thief.org, "100")
    tasks.refresh_card_ceilings()
    assert customer.ceiling().room == Decimal(300)  # $500 less 2 x $100
    assert _refusal(customer.org, "300.01").reason == "spend_ceiling"


def test_where_a_tenant_on_a_shared_card_is_refused_tells_the_others_spend_to_a_step_not_the_cent(one_card):
    """Second review, C: the gateway refused at the ceiling less the others' spend: a thief's probes (refused ones
    cost nothing) read a customer's $23.45 to the cent (76.56 refused, 76.55 admitted)."""
    customer, thief = one_card
    _usage(customer.org, "23.45")
    tasks.refresh_card_ceilings()
    assert _refusal(thief.org, "75.01").reason == "spend_ceiling"
    _spend(thief.org, "75.00")  # $23.45 counted as $25: 5 % of the $100 ceiling a step (before: 76.55 admitted)
    _usage(customer.org, "1.55")  # $25.00: the same step, the same room
    assert thief.ceiling().room == Decimal(75)
    assert standing.SpendCeiling(Decimal(10), standing.PAID_HISTORY, Decimal(0), num_other_organizations_on_card=1,
                                 spent_by_others=Decimal("0.01")).room == Decimal(9)  # at least a $1 step


def test_removing_the_card_keeps_the_organisation_on_it(one_card):
    first, second = one_card
    _webhook("customer.updated", first.stripe.set_default_payment_method(first.customer, None))
    account = BillingAccount.objects.get(organization=first.org)
    assert (account.payment_method_on_file, account.card_fingerprint) == (False, "fp_stolen")
    _usage(first.org, "60")
    services.refresh_shared_card_ceilings()
    assert second.ceiling().room == Decimal(40)
    assert _refusal(second.org, "41.00").reason == "spend_ceiling"


def test_a_tenant_is_shown_its_own_figures_and_that_the_ceiling_is_shared_never_the_others(
        ceilings, fake_stripe, member_client_factory):
    """Review finding 3: a tenant read another's month spend, live, to the cent (effective_spend_cap = ceiling less
    the others' spend: 376.55 for a victim's 123.45 of $500), their paid total and their number (a card-testing
    oracle); its alerts mailed the others' spend ("Spend this month: $99.01" to an organisation that spent $0.01)."""
    victim = _Org(fake_stripe, "Victim Ltd")
    victim.add_card("fp_victim")
    thief = _Org(fake_stripe, "Thief Ltd")
    thief.add_card("fp_victim")
    client = member_client_factory(thief.org, Role.ADMIN)
    _usage(victim.org, "99")
    _usage(thief.org, "0.01")
    response = client.get("/api/v1/billing/")
    shown = response.json()["standing"]
    assert shown["effective_spend_cap"] == "100.00"  # before: "1.00", the victim's $99 to the cent
    assert shown["spend_ceiling"]["shared_with_other_organizations"] is True
    assert "num_other_organizations_on_card" not in shown["spend_ceiling"]
    mail.outbox.clear()
    from billing.alerts import check_spend_alerts
    assert check_spend_alerts(thief.org.pk) == []  # before: [50, 80], "Spend this month: $99.01"
    assert check_spend_alerts(victim.org.pk) == [50, 80]
    assert "Spend this month: $99.00 of a $100.00 ceiling" in mail.outbox[-1].body
    assert "shared with other organisations using the same card" in mail.outbox[-1].body

    from django.test import Client

    from controlplane.accounts.tenancy import SESSION_KEY
    console = Client()
    console.force_login(client.user)
    session = console.session
    session[SESSION_KEY] = thief.org.pk
    session.save()
    page = console.get("/console/billing/").content.decode()
    assert "It is shared with other organisations using the same card" in page
    for text in (response.content.decode(), page):
        for name in (victim.org.name, victim.org.slug, victim.customer, "99.00"):
            assert name not in text

    # Staff see the full figures in the Django admin, and find a card's organisations by its fingerprint.
    from django.contrib.auth import get_user_model

    from tests.factories import sign_in_staff
    staff = get_user_model().objects.create_superuser("ops@example.test", "ops@example.test", "a long passphrase")
    admin = Client()
    sign_in_staff(admin, staff)
    account = BillingAccount.objects.get(organization=thief.org)
    shown = admin.get(f"/django-admin/billing/billingaccount/{account.pk}/change/").content.decode()
    assert "fp_victim" in shown and "held this month by 1 other organisation(s), which spent $99.00" in shown
    found = admin.get("/django-admin/billing/billingaccount/", {"q": "fp_victim"}).content.decode()
    assert victim.org.slug in found and thief.org.slug in found


@pytest.mark.parametrize("how", ["invoiced_without_card", "prepaid"])
def test_staff_taking_one_of_two_off_the_ceiling_frees_the_others_room_at_once(one_card, how):
    """Review finding 5: staff's change of billing mode (or `invoiced_without_card`) wrote no other organisation's
    limits, and the one left alone on the card was refreshed by no beat task: refused for the rest of the month."""
    first, second = one_card
    _spend(second.org, "1.00")
    _usage(first.org, "100")
    tasks.refresh_card_ceilings()
    assert _refusal(second.org, "1.00").reason == "spend_ceiling"
    if how == "prepaid":
        services.set_billing_mode(SYSTEM, first.org, mode=BillingMode.PREPAID)
    else:
        services.set_invoiced_without_card(SYSTEM, first.org, allowed=True)
    _spend(second.org, "98.00")  # before: refused, Redis kept the room of 0


def test_two_payments_on_one_card_at_once_do_not_deadlock(one_card, monkeypatch):
    """Review finding 6: each payment's transaction locked its own account, then the card's others: two at once
    locked in opposite orders, and PostgreSQL killed one ("deadlock detected")."""
    barrier = threading.Barrier(2, timeout=10)
    original = services.card_ceiling_changed

    def both_own_rows_locked(*args, **kwargs):
        barrier.wait()
        return original(*args, **kwargs)

    monkeypatch.setattr(services, "card_ceiling_changed", both_own_rows_locked)
    errors = []

    def pay(organization):
        try:
            with transaction.atomic():
                services.paid_history_changed(organization.pk)
        except Exception as exc:
            errors.append(repr(exc))
        finally:
            connection.close()

    threads = [threading.Thread(target=pay, args=(sign_up.org,)) for sign_up in one_card]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []  # before: one DeadlockDetected


def test_a_cards_spend_is_read_once_for_its_organisations_and_the_billing_page_reads_none_of_the_others(
        ceilings, fake_stripe, member_client_factory):
    """Review finding 7: every account's refresh summed the month's ledger of all the others (K sums of K-1
    organisations each minute), and every billing GET summed the others' twice."""
    sign_ups = [_Org(fake_stripe, f"Sign-up {i}") for i in range(4)]
    for sign_up in sign_ups:
        sign_up.add_card("fp_X")
    client = member_client_factory(sign_ups[0].org, Role.ADMIN)

    def ledger_reads(queries):
        return [q["sql"] for q in queries if 'FROM "billing_usagerecord"' in q["sql"] and "SUM(" in q["sql"]]

    with CaptureQueriesContext(connection) as refresh:
        assert services.refresh_shared_card_ceilings() == 4
    assert len(ledger_reads(refresh.captured_queries)) == 1  # before: 4
    assert services.refresh_shared_card_ceilings(budget_s=0) == 0  # out of time: left to the next run, not past it
    with CaptureQueriesContext(connection) as page:
        client.get("/api/v1/billing/")
    others = [sql for sql in ledger_reads(page.captured_queries) if '"organization_id" IN (' in sql]
    assert others == []  # before: 2


def test_the_beat_checks_its_time_before_each_card_and_lets_celerys_soft_time_limit_through(ceilings, fake_stripe,
                                                                                             monkeypatch):
    """Second review, E: the time was checked only between batches of 50 cards (a batch of large cards outlasted the
    soft time limit), and `SoftTimeLimitExceeded` raised in a refresh was logged as a Redis failure and swallowed,
    the run going on to the hard kill."""
    from types import SimpleNamespace

    from celery.exceptions import SoftTimeLimitExceeded
    for fingerprint in ("fp_A", "fp_B"):
        for i in range(2):
            _Org(fake_stripe, f"{fingerprint} {i}").add_card(fingerprint)
    clock = [0.0]
    monkeypatch.setattr(services, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    written = []

    def slow_refresh(account, **kwargs):
        written.append(account.organization_id)
        clock[0] += 30  # one card's two organisations: past the budget of 40 s

    monkeypatch.setattr(services, "refresh_limits", slow_refresh)
    assert services.refresh_shared_card_ceilings(budget_s=40) == 2  # before: 4, both cards of the batch
    assert written and services.refresh_shared_card_ceilings(budget_s=0) == 0

    def soft_limit(account, **kwargs):
        raise SoftTimeLimitExceeded()

    monkeypatch.setattr(services, "refresh_limits", soft_limit)
    with pytest.raises(SoftTimeLimitExceeded):  # before: logged, and the run went on
        services.refresh_shared_card_ceilings()


def test_the_cards_fingerprint_is_read_from_a_payment_method_or_an_older_default_source():
    def customer(method=None, source=None):
        return {"object": "customer", "invoice_settings": {"default_payment_method": method}, "default_source": source}

    assert standing.card_fingerprint(customer({"type": "card", "card": {"fingerprint": "fp_pm"}})) == "fp_pm"
    assert standing.card_fingerprint(customer({"type": "card", "card": {"fingerprint": "x"}})) == "x"
    # Second review, D: a bank debit's fingerprint was dropped (""): N sign-ups on one account shared nothing.
    for kind in ("sepa_debit", "us_bank_account", "bacs_debit", "au_becs_debit"):
        assert standing.card_fingerprint(customer({"type": kind, kind: {"fingerprint": "x"}})) == f"{kind}:x"
    assert standing.card_fingerprint(customer({"type": "link", "link": {"email": "a@example.test"}})) == ""  # none
    assert standing.card_fingerprint(customer({"type": "sepa_debit", "sepa_debit": None})) == ""
    assert standing.card_fingerprint(customer(source={"object": "card", "fingerprint": "fp_card"})) == "fp_card"
    assert standing.card_fingerprint(customer(source={"object": "source", "type": "card",
                                                      "card": {"fingerprint": "fp_src"}})) == "fp_src"
    assert standing.card_fingerprint(customer(source={"object": "bank_account", "fingerprint": "fp_bank"})) == ""
    assert standing.card_fingerprint(customer()) == ""


def test_the_backfill_reads_the_cards_of_customers_read_before_fingerprints_were_kept_past_one_that_fails(one_card):
    """Before `billing/0034` no fingerprint was kept: without the backfill, those organisations shared nothing until
    their card was read again. Review: it read only the accounts with none, not one whose card an old pod changed."""
    from io import StringIO

    from django.core.management import CommandError, call_command

    first, second = one_card
    third = _Org(first.stripe, "Third Sign-up Ltd")
    third.add_card("fp_stolen")
    BillingAccount.objects.exclude(organization=second.org).update(card_fingerprint="")  # as the upgrade leaves them
    # A pod of the previous version recorded the second's change of card without its fingerprint: the old one stays.
    BillingAccount.objects.filter(organization=second.org).update(card_fingerprint="fp_before")
    first.stripe.fail_next("500", times=stripe_sync.MAX_ATTEMPTS, path=f"/v1/customers/{third.customer}", method="GET")
    with pytest.raises(CommandError, match=third.customer):
        call_command("backfill_card_fingerprints", stdout=StringIO())

    def fingerprints():
        return [BillingAccount.objects.get(organization=sign_up.org).card_fingerprint for sign_up in (first, second, third)]
    assert fingerprints() == ["fp_stolen", "fp_stolen", ""]  # before: the second's stayed "fp_before"
    call_command("backfill_card_fingerprints", stdout=StringIO())  # run again: the one that failed
    assert fingerprints() == ["fp_stolen"] * 3
    assert second.ceiling().num_other_organizations_on_card == 2


def test_a_tenant_refused_for_its_cards_shared_ceiling_is_not_told_its_own_cap_is_reached(one_card):
    """A call refused for the room the card's other organisations leave (`spend_ceiling`) while the limit the tenant is
    shown is its own cap, lower than the ceiling: before, past 80 % of that cap, every owner was mailed that "its
    monthly spend cap" was reached and calls refused "until the cap is raised", which lifts nothing."""
    customer, tenant = one_card
    _usage(customer.org, "85")
    tasks.refresh_card_ceilings()
    services.set_spend_cap(SYSTEM, tenant.org, spend_cap=Decimal("16"))
    _usage(tenant.org, "13")
    assert _refusal(tenant.org, "3.00").reason == "spend_ceiling"  # $16 past the $15 the customer leaves
    from billing.alerts import check_spend_alerts
    assert check_spend_alerts(tenant.org.pk) == [50, 80]  # of its own $16 cap: 81 %
    assert "reached" not in mail.outbox[-1].subject
    assert _refusal(tenant.org, "3.50").reason == "spend_ceiling"
    assert check_spend_alerts(tenant.org.pk) == []


def test_a_worker_whose_clock_is_in_last_month_still_counts_this_months_spend_of_the_cards_others(one_card, monkeypatch):
    # Before: the beat task read the month by the worker's clock: one minutes behind at a month's start counted the
    # others' spend of the month that ended, here none, and gave the second its whole $100 again on a spent card.
    from tests.billing.test_period_clock import _this_pod_clock_in_last_month

    first, second = one_card
    _spend(second.org, "1.00")
    _usage(first.org, "100")  # the first spent the card's $100 this month
    with monkeypatch.context() as worker:
        _this_pod_clock_in_last_month(worker)
        assert tasks.refresh_card_ceilings() == 2

    assert _refusal(second.org, "1.00").reason == "spend_ceiling"


def test_a_counter_rebuilt_for_the_new_month_leaves_its_card_the_new_months_room_whatever_postgresqls_clock_says(one_card):
    # Before: a counter the gateway rebuilt for the month Redis's clock is in took its spending ceiling's room from the
    # card's others' spend of the month PostgreSQL's clock is in (`card_spend` with no period): at a month's start, a
    # database a minute behind Redis gave the new month's counter the room the old month left, here none, and the
    # second organisation's first calls of the month were refused for its card's spend of the month before.
    from billing.periods import current_period, period_containing
    from billing.quota.counters import to_units
    from billing.quota.rebuild import _read_rebuild

    first, second = one_card
    _usage(first.org, "100")  # the first spent the card's $100 this month
    next_month = period_containing(current_period().end)

    rebuilt = _read_rebuild("org", second.org.pk, None, next_month, ())
    assert rebuilt.fields["cap"] == str(to_units(Decimal(100)))  # the new month: nothing spent on the card yet
    assert _read_rebuild("org", second.org.pk, None, current_period(), ()).fields["cap"] == "0"  # this month's: spent
