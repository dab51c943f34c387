"""Log-in, sign-up, password reset and change, and resending a verification are throttled per address and per
account, in the shared Redis; an attempt over the limit is a 429 page that says how long to wait."""

from __future__ import annotations

import asyncio
import time
from unittest import mock

import pytest
import redis
from django.core import mail
from django.test import Client
from django.urls import reverse

from controlplane import clock, redis_scripts
from controlplane.accounts import throttle
from controlplane.accounts.models import Membership, Role
from controlplane.redis_client import get_async_redis, get_redis, redis_time
from tests.conftest import wait_until
from tests.factories import MembershipFactory, UserFactory

pytestmark = pytest.mark.django_db

PASSWORD = "correct horse battery"


def _limit(limits, per) -> throttle.Limit:
    return next(limit for limit in limits if limit.per == per)


def _assert_throttled(response) -> None:
    assert response.status_code == 429
    assert "Too many attempts" in response.content.decode()
    assert int(response["Retry-After"]) >= 1


@pytest.fixture
def victim():
    user = UserFactory(username="victim@example.test")
    MembershipFactory(user=user, role=Role.OWNER)
    return user


def test_guessing_one_accounts_password_is_throttled_even_from_many_addresses(client, victim):
    for attempt in range(_limit(throttle.LOGIN, "username").num_attempts):
        response = client.post(reverse("login"), {"username": victim.email, "password": f"guess {attempt}"},
                               REMOTE_ADDR=f"10.0.0.{attempt}")
        assert response.status_code == 200  # the form again, with its error
    response = client.post(reverse("login"), {"username": victim.email, "password": PASSWORD}, REMOTE_ADDR="10.0.1.1")
    _assert_throttled(response)
    assert "_auth_user_id" not in client.session  # even the right password waits


def test_guessing_from_one_address_stops_after_its_failures_even_with_the_right_password(client, victim):
    for attempt in range(_limit(throttle.LOGIN, "username+ip").num_attempts):
        response = client.post(reverse("login"), {"username": victim.email, "password": f"guess {attempt}"},
                               REMOTE_ADDR="10.0.5.1")
        assert response.status_code == 200
    _assert_throttled(client.post(reverse("login"), {"username": victim.email, "password": PASSWORD},
                                  REMOTE_ADDR="10.0.5.1"))
    assert "_auth_user_id" not in client.session


def test_an_attacker_elsewhere_cannot_lock_the_owner_out(victim):
    """Before, 11 posts naming the owner's account from anywhere (right password or not) answered the owner 429 for
    10 minutes, on the console and the Django admin alike."""
    attacker = Client()
    for attempt in range(_limit(throttle.LOGIN, "username+ip").num_attempts + 1):
        attacker.post(reverse("login"), {"username": victim.email, "password": f"x{attempt}"}, REMOTE_ADDR="10.0.6.1")
    _assert_throttled(attacker.post(reverse("login"), {"username": victim.email, "password": "x"}, REMOTE_ADDR="10.0.6.1"))
    owner = Client()
    response = owner.post(reverse("login"), {"username": victim.email, "password": PASSWORD}, REMOTE_ADDR="10.0.7.1")
    assert response.status_code == 302
    assert owner.session["_auth_user_id"] == str(victim.pk)
    assert Client().post("/django-admin/login/", {"username": victim.email, "password": PASSWORD},
                         REMOTE_ADDR="10.0.7.2").status_code != 429


def test_wrong_passwords_sent_at_once_never_pass_an_accounts_limit_from_one_address(victim):
    """Before, failures were counted after the view: attempts sent together all read the failures before any of them,
    and 30 wrong passwords posted at once from one address (its own limit: 30) passed the account's limit of 10."""
    subjects = {"username": victim.email, "ip": "10.0.9.1"}
    attempts = [throttle.take(throttle.LOGIN, subjects) for _ in range(30)]  # all taken before any view answered
    passed = [getattr(attempt, "retry_after_s", attempt) is None for attempt in attempts]
    assert sum(passed) == _limit(throttle.LOGIN, "username+ip").num_attempts


def test_attempts_refused_by_the_throttle_add_nothing_to_the_accounts_failures(victim):
    """Counted before the view, an attempt the throttle refuses is taken out again: an attacker past their own limits
    cannot go on adding to the count that, at 100, locks the account from every address."""
    attacker = Client()
    for attempt in range(40):
        attacker.post(reverse("login"), {"username": victim.email, "password": f"x{attempt}"}, REMOTE_ADDR="10.0.9.2")
    account = _limit(throttle.LOGIN, "username")
    key = throttle._redis_key(account, victim.email, int(time.time() // account.window_s))
    assert int(get_redis().get(key)) == _limit(throttle.LOGIN, "username+ip").num_attempts


def test_logging_in_successfully_uses_up_no_accounts_budget(victim):
    for _ in range(_limit(throttle.LOGIN, "username+ip").num_attempts + 1):
        assert Client().post(reverse("login"), {"username": victim.email, "password": PASSWORD},
                             REMOTE_ADDR="10.0.8.1").status_code == 302


def test_spellings_that_log_into_the_same_account_share_its_throttle(client, victim):
    """Before, "ｖictim@…" (fullwidth, which Django's form folds to "v") or "vıctim@…" (dotless ı, which
    PostgreSQL's case-insensitive match takes for "i") each had a throttle of their own."""
    local, domain = victim.email.split("@")
    spellings = [victim.email, victim.email.upper(), "\uff56" + victim.email[1:], local.replace("i", "\u0131") + "@" + domain]
    num_attempts = _limit(throttle.LOGIN, "username").num_attempts
    for attempt in range(num_attempts):
        client.post(reverse("login"), {"username": spellings[attempt % len(spellings)], "password": f"guess {attempt}"},
                    REMOTE_ADDR=f"10.0.2.{attempt}")
    for spelling in spellings:
        _assert_throttled(client.post(reverse("login"), {"username": spelling, "password": PASSWORD},
                                      REMOTE_ADDR="10.0.3.1"))


def test_one_address_trying_many_accounts_is_throttled(client):
    for attempt in range(_limit(throttle.LOGIN, "ip").num_attempts):
        client.post(reverse("login"), {"username": f"user{attempt}@example.test", "password": "guess"}, REMOTE_ADDR="10.9.9.9")
    _assert_throttled(client.post(reverse("login"), {"username": "fresh@example.test", "password": "guess"},
                                  REMOTE_ADDR="10.9.9.9"))
    # Another address is not held up by it.
    assert client.post(reverse("login"), {"username": "fresh@example.test", "password": "guess"},
                       REMOTE_ADDR="10.9.9.10").status_code == 200


def test_the_django_admin_login_shares_the_log_in_throttle(client, victim):
    for attempt in range(_limit(throttle.LOGIN, "username").num_attempts):
        client.post(reverse("login"), {"username": victim.email, "password": "guess"}, REMOTE_ADDR=f"10.0.2.{attempt}")
    _assert_throttled(client.post("/django-admin/login/", {"username": victim.email, "password": PASSWORD},
                                  REMOTE_ADDR="10.0.3.1"))


def test_a_login_page_get_is_never_throttled(client, victim):
    for attempt in range(_limit(throttle.LOGIN, "username").num_attempts + 1):
        client.post(reverse("login"), {"username": victim.email, "password": "guess"}, REMOTE_ADDR=f"10.0.4.{attempt}")
    assert client.get(reverse("login")).status_code == 200


def _change_password(client, old_password, **extra):
    new_password = "Another-passphrase-123!"
    return client.post(reverse("password_change"), {"old_password": old_password, "new_password1": new_password,
                                                     "new_password2": new_password}, **extra)


def test_guessing_the_current_password_on_the_change_form_stops_after_its_failures(client, victim):
    """Before, a borrowed or stolen session guessed the current password here without end, then set its own."""
    client.force_login(victim)
    for attempt in range(_limit(throttle.PASSWORD_CHANGE, "user").num_attempts):
        response = _change_password(client, f"guess {attempt}", REMOTE_ADDR=f"10.6.0.{attempt}")
        assert response.status_code == 200  # the form again, with its error
    _assert_throttled(_change_password(client, PASSWORD, REMOTE_ADDR="10.6.1.1"))  # even the right one waits
    victim.refresh_from_db()
    assert victim.check_password(PASSWORD)


def test_changing_the_password_successfully_uses_up_no_budget(client, victim):
    client.force_login(victim)
    allowed = _limit(throttle.PASSWORD_CHANGE, "user").num_attempts
    for _ in range(allowed - 1):
        assert _change_password(client, "a wrong guess").status_code == 200
    response = _change_password(client, PASSWORD)
    assert response.status_code == 302 and response.url == reverse("password_change_done")
    # The right password counted as no failure: one more mistake is still the form, not a 429.
    assert _change_password(client, "a wrong guess").status_code == 200


def test_sign_up_is_throttled_per_address(client):
    for attempt in range(_limit(throttle.SIGNUP, "ip").num_attempts):
        Client().post(reverse("signup"), {"email": f"bot{attempt}@example.test", "password": "a long passphrase",
                                          "organization_name": f"Bot {attempt}"}, REMOTE_ADDR="10.1.1.1")
    response = client.post(reverse("signup"), {"email": "one-more@example.test", "password": "a long passphrase",
                                               "organization_name": "One more"}, REMOTE_ADDR="10.1.1.1")
    _assert_throttled(response)
    assert not Membership.objects.filter(user__email="one-more@example.test").exists()


def test_password_reset_mails_one_address_a_few_times_only(client, victim):
    allowed = _limit(throttle.PASSWORD_RESET, "email").num_attempts
    for attempt in range(allowed):
        client.post(reverse("password_reset"), {"email": victim.email}, REMOTE_ADDR=f"10.2.0.{attempt}")
    _assert_throttled(client.post(reverse("password_reset"), {"email": victim.email.upper()}, REMOTE_ADDR="10.2.1.1"))
    assert len(mail.outbox) == allowed


def test_resending_the_verification_is_throttled(client):
    client.post(reverse("signup"), {"email": "new@example.test", "password": "a long passphrase", "organization_name": "N"})
    assert client.login(username="new@example.test", password="a long passphrase")
    allowed = _limit(throttle.RESEND_VERIFICATION, "user").num_attempts
    for attempt in range(allowed):
        assert client.post(reverse("verify-email-resend"), REMOTE_ADDR=f"10.3.0.{attempt}").status_code == 302
    _assert_throttled(client.post(reverse("verify-email-resend"), REMOTE_ADDR="10.3.1.1"))
    assert len(mail.outbox) == 1 + allowed


def test_an_address_gets_a_few_account_mails_a_day_whoever_asks(client):
    """Before, sign-up (5 an hour per address) and resends (3 per 10 minutes per user) mailed one address hundreds of
    times a day: verification links and "you already have an account" mails each have a daily bound per address."""
    from controlplane.accounts import signup

    client.post(reverse("signup"), {"email": "new@example.test", "password": "a long passphrase", "organization_name": "N"})
    user = signup.User.objects.get(email="new@example.test")
    num_links = _limit(throttle.VERIFICATION_MAILS, "email").num_attempts
    num_exists = _limit(throttle.ACCOUNT_EXISTS_MAILS, "email").num_attempts
    for _ in range(num_links - 1):
        assert signup.send_verification_email(user) is signup.LinkMailed.SENT
    for _ in range(num_exists):
        assert signup.send_account_exists_email("New@Example.test")
    assert not signup.send_account_exists_email("new@example.test")
    assert client.login(username="new@example.test", password="a long passphrase")
    page = client.post(reverse("verify-email-resend"), follow=True).content.decode()
    assert "as many links as we send an address in a day" in page and len(mail.outbox) == num_links + num_exists


def test_a_stranger_gets_a_few_password_reset_mails_a_day_from_one_client_whatever_the_sub_address(client):
    """The reset form mails an address without an account that it has none: before, only the form's limit (3 an hour
    per address) bounded it, 72 mails a day to a stranger from one client address, and each `+tag` a fresh 72."""
    base = clock.redis_now()
    for hour in range(24):
        with mock.patch.object(clock, "redis_now", return_value=base + hour * 3600 + 1):
            for tag in ("", "+1", "+2"):
                client.post(reverse("password_reset"), {"email": f"stranger{tag}@elsewhere.test"})

    allowed = _limit(throttle.NO_ACCOUNT_MAILS, "email").num_attempts
    assert allowed < 24 * 3 and len(mail.outbox) <= 2 * allowed  # a day's window may begin within these 24 hours


def test_a_stranger_cannot_keep_an_owner_from_their_reset_link():
    """The link and the no-account mail shared one daily budget per mailbox (so that an address past it was answered
    alike): 5 posts for `victim+0@`... `victim+4@` (no account: 5 "no account" mails) spent it, and the owner's own
    reset mailed no link, with no sign of it, for as many days as the stranger kept it up."""
    owner = UserFactory(username="victim@example.test")
    MembershipFactory(user=owner, role=Role.OWNER)
    attacker = Client()
    for n in range(5):  # within reset-ip (10 an hour) and reset-email (3 an hour, per typed address)
        assert attacker.post(reverse("password_reset"), {"email": f"victim+{n}@example.test"},
                             REMOTE_ADDR="203.0.113.9").status_code == 302
    assert len(mail.outbox) == 5 and not any("/reset/" in m.body for m in mail.outbox)

    before = len(mail.outbox)
    answer = Client().post(reverse("password_reset"), {"email": "victim@example.test"}, REMOTE_ADDR="198.51.100.1")
    assert answer.status_code == 302
    assert [m.to for m in mail.outbox[before:] if "/reset/" in m.body] == [["victim@example.test"]]


def test_the_reset_form_answers_the_same_past_the_no_account_budget_with_an_account_or_without(client, victim):
    """Past an address's no-account mails it is mailed nothing; an owner still gets their link; both are answered
    alike."""
    allowed = _limit(throttle.NO_ACCOUNT_MAILS, "email").num_attempts
    for email in (victim.email, "nobody@elsewhere.test"):
        for _ in range(allowed):
            assert throttle.take(throttle.NO_ACCOUNT_MAILS, {"email": email}).retry_after_s is None
    before = len(mail.outbox)
    answers = [client.post(reverse("password_reset"), {"email": email}, REMOTE_ADDR=f"10.4.0.{n}")
               for n, email in enumerate((victim.email, "nobody+tag@elsewhere.test"))]
    assert [(r.status_code, r["Location"]) for r in answers] == [(302, reverse("password_reset_done"))] * 2
    assert [m.to for m in mail.outbox[before:]] == [[victim.email]] and "/reset/" in mail.outbox[-1].body


def test_sign_ups_with_an_owners_address_leave_them_their_verification_links(client):
    """A stranger signing up again and again with an owner's address (5 an hour) sends "you already have an account": before,
    those shared the address's 10 a day with verification links, and 10 of them left the owner none that day."""
    from controlplane.accounts import signup

    client.post(reverse("signup"), {"email": "owner@example.test", "password": "a long passphrase", "organization_name": "O"})
    for _ in range(10):
        signup.sign_up_user(email="owner@example.test", password="the stranger's", organization_name="Probe")
    assert client.login(username="owner@example.test", password="a long passphrase")
    page = client.post(reverse("verify-email-resend"), follow=True).content.decode()
    assert "We sent a new link to owner@example.test" in page and "Verify your email" in mail.outbox[-1].subject
    assert sum("already have" in message.subject for message in mail.outbox) == 3


def test_counters_hold_no_email_addresses(client, victim):
    from controlplane.redis_client import get_redis

    client.post(reverse("login"), {"username": victim.email, "password": "guess"})
    keys = get_redis().keys("throttle:*")
    assert keys and not any("victim" in key for key in keys)


def test_attempts_pass_when_redis_is_unreachable(client, victim, monkeypatch):
    from controlplane.redis_client import connection_options
    from tests.conftest import free_port

    # As production's client (one retry, no backoff), at an address where nothing listens.
    retry = redis.retry.Retry(redis.backoff.NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,))
    unreachable = redis.Redis(port=free_port(), retry=retry, **connection_options())
    monkeypatch.setattr(redis_scripts, "get_redis", lambda: unreachable)  # the counting (and refunding) scripts' client
    for _ in range(_limit(throttle.LOGIN, "username").num_attempts + 1):
        response = client.post(reverse("login"), {"username": victim.email, "password": "guess"})
        assert response.status_code == 200


def test_while_redis_is_unreachable_strangers_get_no_mails_from_the_reset_and_sign_up_forms(client, victim, monkeypatch):
    """Before, the mails' daily budgets per address let every mail through while Redis could not be read, as the forms'
    own limits do: anyone could have any address mailed "no account has this address" (or an owner "you already have
    an account") without bound for as long as the outage lasted."""
    from controlplane.redis_client import connection_options
    from tests.conftest import free_port

    retry = redis.retry.Retry(redis.backoff.NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,))
    unreachable = redis.Redis(port=free_port(), retry=retry, **connection_options())
    monkeypatch.setattr(redis_scripts, "get_redis", lambda: unreachable)
    budget = _limit(throttle.NO_ACCOUNT_MAILS, "email").num_attempts + _limit(throttle.ACCOUNT_EXISTS_MAILS,
                                                                             "email").num_attempts
    answers = [client.post(reverse("password_reset"), {"email": "stranger@elsewhere.test"}, REMOTE_ADDR=f"10.5.0.{n}")
               for n in range(budget + 2)]
    answers += [Client().post(reverse("signup"), {"email": victim.email, "password": "a long passphrase",
                                                  "organization_name": "N"}, REMOTE_ADDR=f"10.6.0.{n}")
                for n in range(budget + 2)]

    assert all(answer.status_code in (200, 302) for answer in answers)
    assert [m.to for m in mail.outbox] == []


async def _read_offset() -> None:
    await clock.read_offset(get_async_redis())  # as a web process's heartbeat does (`endpoints.gateway.presence`)


def test_two_web_processes_with_clocks_40_s_apart_count_in_one_window(monkeypatch):
    # Each web process took its windows from its own clock: two 40 s apart (NTP broken on one machine) counted the
    # same moment's attempts in two windows, a limit's attempts allowed by each. Their windows are Redis's now.
    limits = (throttle.Limit("clock-test", "ip", 1, 60),)
    wait_until(lambda: 5 <= redis_time() % 60 <= 45, 45, message="a moment 5 to 45 s into a minute")
    way = -1 if redis_time() % 60 < 30 else 1  # a clock 40 s that way is in another minute than Redis's
    ip = f"192.0.2.{int(time.time()) % 200}"
    monkeypatch.setattr(clock, "_offset", clock._Offset())
    asyncio.run(_read_offset())
    first = throttle.take(limits, {"ip": ip})
    with monkeypatch.context() as other_process:
        real = time.time
        other_process.setattr(time, "time", lambda: real() + 40 * way)
        other_process.setattr(clock, "_offset", clock._Offset())
        asyncio.run(_read_offset())  # its heartbeat's reading
        second = throttle.take(limits, {"ip": ip})
    assert first.retry_after_s is None and second.retry_after_s is not None


def test_resets_refused_by_a_clients_own_limit_spend_no_accounts_budget(victim):
    """Before (the tenancy review): a client already past its own address's limit still counted each refused reset
    against the account's: three an hour locked the account's owner out of its own first reset, from anywhere, with no
    mail sent to anyone."""
    attacker = Client(REMOTE_ADDR="203.0.113.9")
    for n in range(10):  # the attacker's own address: 10 an hour
        attacker.post(reverse("password_reset"), {"email": f"x{n}@junk.example"})
    for _ in range(3):
        _assert_throttled(attacker.post(reverse("password_reset"), {"email": victim.email}))
    before = len(mail.outbox)
    owner = Client(REMOTE_ADDR="198.51.100.7")
    assert owner.post(reverse("password_reset"), {"email": victim.email}).status_code != 429
    assert len(mail.outbox) == before + 1
    _assert_throttled(attacker.post(reverse("password_reset"), {"email": victim.email}))  # its own limit still holds


def test_an_attempt_refused_never_counts_against_the_account_it_names_not_even_for_a_moment(monkeypatch):
    """Before (a review's probe), a refused attempt was counted in every counter and taken out again in a second round
    trip: between the two it counted, and an attacker past its own address's limit flooding resets that named an
    account kept its counter at the limit, refusing 88% of the owner's own first resets. Each reply Redis sends the
    throttle is watched here, and the account's counter read after it: the refused attempt must never show in it."""
    limits = (throttle.Limit("refused-ip", "ip", 10, 3600), throttle.Limit("refused-email", "email", 3, 3600))
    victim = f"victim-{time.time_ns()}@example.test"
    for n in range(10):  # the attacker's own address at its limit
        assert throttle.take(limits, {"ip": "203.0.113.9", "email": f"x{n}-{victim}"}).retry_after_s is None
    for n in range(2):  # the owner's first two of three
        assert throttle.take(limits, {"ip": f"198.51.100.{n + 1}", "email": victim}).retry_after_s is None
    victim_key = throttle._redis_key(limits[1], victim, int(clock.redis_now() // 3600))
    watcher = get_redis()
    seen, num_round_trips, watching = [], [], []
    read_response = redis.connection.AbstractConnection.read_response
    send_packed_command = redis.connection.AbstractConnection.send_packed_command

    def counted_send(self, *args, **kwargs):
        if not watching:
            num_round_trips.append(1)
        return send_packed_command(self, *args, **kwargs)

    def read_then_look(self, *args, **kwargs):
        reply = read_response(self, *args, **kwargs)
        if not watching:
            watching.append(1)
            try:
                seen.append(int(watcher.get(victim_key)))
            finally:
                watching.clear()
        return reply

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counted_send)
    monkeypatch.setattr(redis.connection.AbstractConnection, "read_response", read_then_look)
    attempt = throttle.take(limits, {"ip": "203.0.113.9", "email": victim})
    monkeypatch.undo()

    assert attempt.retry_after_s is not None
    assert seen and set(seen) == {2}, f"the account's counter after each of Redis's replies: {seen}"
    assert len(num_round_trips) == 1, "read and refused in one round trip"
    assert throttle.take(limits, {"ip": "198.51.100.3", "email": victim}).retry_after_s is None  # the owner's third


def test_an_attempt_whose_reply_is_lost_counts_once_and_is_not_refused_by_its_own_retry(monkeypatch):
    """redis-py sends a command again after a lost connection (`controlplane.redis_client`). Before (a review's probe),
    the counting script ran twice for one attempt: the owner's third reset of three was counted by the first run and
    refused by the second, a 429 for an attempt that had counted."""
    limits = (throttle.Limit("lost-reply-email", "email", 3, 3600),)
    subject = {"email": f"owner-{time.time_ns()}@example.test"}
    for _ in range(2):
        assert throttle.take(limits, subject).retry_after_s is None
    read_response = redis.connection.AbstractConnection.read_response
    lost = []

    def reply_lost_once(self, *args, **kwargs):
        if not lost:
            lost.append(1)
            time.sleep(0.2)  # the script ran on the server; its reply is lost with the connection
            raise redis.exceptions.ConnectionError("connection reset (the test's)")
        return read_response(self, *args, **kwargs)

    monkeypatch.setattr(redis.connection.AbstractConnection, "read_response", reply_lost_once)
    third = throttle.take(limits, subject)
    monkeypatch.undo()

    key = throttle._redis_key(limits[0], subject["email"], int(clock.redis_now() // 3600))
    assert lost, "the reply was not lost: the test saw no retry"
    assert third.retry_after_s is None
    assert get_redis().get(key) == "3"
    assert throttle.take(limits, subject).retry_after_s is not None  # the fourth


def test_a_refund_after_redis_lost_the_counter_leaves_no_counter_below_zero(monkeypatch):
    """Redis restarted without its data (or failed over to a replica that lagged) between the count and the refund.
    Before (a review's probe), the refund's DECR made the counter -1 with no expiry: one attempt more than the limit,
    in its window and in every window after it while the key lived on."""
    limits = (throttle.Limit("lost-counter", "username", 3, 600, failures_only=True),)
    subject = {"username": f"user-{time.time_ns()}@example.test"}
    attempt = throttle.take(limits, subject)
    assert attempt.retry_after_s is None and attempt.provisional
    [key] = attempt.provisional
    get_redis().delete(key)  # the counter is gone with the server's data

    attempt.refund()

    assert get_redis().get(key) is None
    passed = sum(throttle.take(limits, subject).retry_after_s is None for _ in range(6))
    assert passed == limits[0].num_attempts
