import smtplib
import threading
import time

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.hashers import MD5PasswordHasher
from django.core import mail
from django.core.mail import EmailMessage
from django.core.mail.backends import locmem
from django.core.mail.backends.base import BaseEmailBackend
from django.test import override_settings

from controlplane.accounts.models import Membership
from controlplane.accounts.signup import mark_email_verified

pytestmark = pytest.mark.django_db


def test_home_links_to_sign_up_and_log_in(client):
    page = client.get("/").content.decode()
    assert 'href="/signup/"' in page and 'href="/login/"' in page


def test_login_page_renders_a_labelled_form(client):
    page = client.get("/login/").content.decode()
    assert '<label for="id_username">' in page and '<label for="id_password">' in page
    assert "csrfmiddlewaretoken" in page


def test_sign_up_creates_the_user_and_an_organisation_they_own(client):
    response = client.post(
        "/signup/", {"email": "Ada@Example.test", "password": "a long passphrase", "organization_name": "Analytical Engines"}
    )
    assert response.status_code == 302 and response["Location"] == "/signup/done/"
    user = get_user_model().objects.get(email="ada@example.test")
    membership = Membership.objects.get(user=user)
    assert membership.role == "owner" and membership.organization.slug == "analytical-engines"
    mark_email_verified(user)
    assert client.login(username="ada@example.test", password="a long passphrase")
    assert "Analytical Engines" in client.get("/console/").content.decode()


def test_sign_up_answers_the_same_whether_the_email_has_an_account_and_mails_its_owner(client):
    """A review's finding: "An account with this email exists" told a stranger who had an account."""
    get_user_model().objects.create_user(username="ceo@victim.test", email="ceo@victim.test", password="x" * 12)
    answers = [client.post("/signup/", {"email": email, "password": "a long passphrase 1", "organization_name": "Probe"})
               for email in ("CEO@victim.test", "nobody@victim.test")]
    assert [(answer.status_code, answer["Location"]) for answer in answers] == [(302, "/signup/done/")] * 2
    assert not any(answer.cookies.get("sessionid") for answer in answers)  # nobody is signed in by signing up
    assert "Check your email" in client.get("/signup/done/").content.decode()
    assert [(message.to, message.subject) for message in mail.outbox] == [
        (["ceo@victim.test"], "You already have an Inferplane account"),
        (["nobody@victim.test"], "Verify your email for Inferplane")]
    assert "/password-reset/" in mail.outbox[0].body and not Membership.objects.filter(user__email="ceo@victim.test")


class CountingHasher(MD5PasswordHasher):
    """The tests' hasher, counting the passwords it hashes."""

    algorithm = "counting_md5"
    num_hashed = 0

    def encode(self, password, salt):
        CountingHasher.num_hashed += 1
        return super().encode(password, salt)


def test_sign_up_hashes_the_password_whether_the_email_has_an_account_or_not(client, settings):
    """Its time must not tell either: before, a new address's sign-up hashed the password (most of its time, with
    production's hasher) and an address with an account was answered without hashing anything."""
    settings.PASSWORD_HASHERS = ["tests.test_accounts.CountingHasher"]
    get_user_model().objects.create_user(username="ceo@victim.test", email="ceo@victim.test", password="x" * 12)
    num_hashed = []
    for email in ("nobody@victim.test", "CEO@victim.test"):
        CountingHasher.num_hashed = 0
        client.post("/signup/", {"email": email, "password": "a long passphrase 1", "organization_name": "Probe"})
        num_hashed.append(CountingHasher.num_hashed)
    assert num_hashed == [1, 1] and len(mail.outbox) == 2


def test_sign_up_shows_field_errors_and_creates_nothing(client):
    response = client.post("/signup/", {"email": "not-an-email", "password": "123", "organization_name": ""})
    assert response.status_code == 200
    page = response.content.decode()
    assert page.count('class="error"') >= 3
    assert not get_user_model().objects.exists()


def test_sign_up_refuses_an_address_holding_an_escape_sequence_and_creates_nothing(client):
    response = client.post("/signup/", {"email": '"a\x1b[2Jb"@example.test', "password": "a long passphrase 1",
                                        "organization_name": "Probe"})
    assert "control characters" in response.content.decode()
    assert not get_user_model().objects.exists() and mail.outbox == []


def test_log_in_and_out(client):
    from controlplane.accounts.signup import sign_up_user

    user = sign_up_user(email="bob@example.test", password="a long passphrase", organization_name="Bob's")
    mark_email_verified(user)
    response = client.post("/login/", {"username": "bob@example.test", "password": "a long passphrase"})
    assert response.status_code == 302
    assert client.get("/console/").status_code == 200
    client.post("/logout/")
    assert client.get("/console/").status_code == 302


def test_console_requires_login(client):
    assert client.get("/console/")["Location"].startswith("/login/")


def test_a_password_reset_mails_the_address_whether_it_has_an_account_or_not(client):
    """Its time must not tell who has an account: the reset mail went out within the request (SMTP's round trips,
    hundreds of milliseconds) for an address with an account, and nothing for one without, which was answered at
    once; a stranger timing the form learned what sign-up hides. Now each is mailed, once, within the request."""
    get_user_model().objects.create_user(username="ceo@victim.test", email="ceo@victim.test", password="x" * 12)
    num_mailed = []
    for email in ("ceo@victim.test", "nobody@victim.test"):
        mail.outbox.clear()
        response = client.post("/password-reset/", {"email": email})
        assert (response.status_code, response["Location"]) == (302, "/password-reset/done/")
        num_mailed.append(len(mail.outbox))

    assert num_mailed == [1, 1]
    no_account = mail.outbox[-1]
    assert no_account.to == ["nobody@victim.test"] and "/signup/" in no_account.body and "/reset/" not in no_account.body


class _SlowRelay(locmem.EmailBackend):
    """A relay's round trips: 50 ms a message."""

    def send_messages(self, messages):
        time.sleep(0.05)
        return super().send_messages(messages)


@pytest.fixture
def mail_off_request(settings):
    """The reset's mails sent off the request, as in production (`accounts.mail_sender`); every mail handed over is
    sent (or has failed) before the test's settings go."""
    from controlplane.accounts import mail_sender

    settings.SEND_MAIL_IN_REQUEST = False
    yield mail_sender
    assert mail_sender.wait_until_sent(10)


def test_a_password_reset_makes_the_same_redis_calls_in_the_request_whether_or_not_an_account_has_the_address(
        client, mail_off_request, monkeypatch):
    """An address without an account spent its no-account budget (`throttle.take`, a Redis round trip) within the
    request, one with an account nothing of the kind: the answer's time told them apart by a round trip, the mails
    sent off the request. The budget is now taken by the sender, off the request, as the mail is sent."""
    import threading

    from controlplane.accounts import throttle

    get_user_model().objects.create_user(username="ceo@victim.test", email="ceo@victim.test", password="x" * 12)
    real_take, in_request = throttle.take, []
    request_thread = threading.current_thread()

    def take(limits, subjects, **options):
        if threading.current_thread() is request_thread:
            in_request.append(limits)
        return real_take(limits, subjects, **options)

    monkeypatch.setattr(throttle, "take", take)
    taken = {}
    for kind, email in (("account", "ceo@victim.test"), ("none", "nobody@victim.test")):
        in_request.clear()
        response = client.post("/password-reset/", {"email": email}, REMOTE_ADDR=f"10.6.0.{len(kind)}")
        assert (response.status_code, response["Location"]) == (302, "/password-reset/done/")
        taken[kind] = list(in_request)

    assert taken["account"] == taken["none"], taken
    assert mail_off_request.wait_until_sent(5)
    assert sorted(m.to[0] for m in mail.outbox) == ["ceo@victim.test", "nobody@victim.test"]


def test_a_password_reset_makes_as_many_queries_whether_or_not_an_account_has_the_address(client, mail_off_request):
    """The form looked the address's users up to choose the mail, and Django's `save` looked them up again for a link:
    a reset with an account made one more query (a database round trip) than one without, the mails off the request:
    the answer's time told who has an account. They are looked up once."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    get_user_model().objects.create_user(username="ceo@victim.test", email="ceo@victim.test", password="x" * 12)
    client.get("/password-reset/")
    queries = {}
    for kind, email in (("account", "ceo@victim.test"), ("none", "nobody@victim.test")):
        with CaptureQueriesContext(connection) as captured:
            response = client.post("/password-reset/", {"email": email}, REMOTE_ADDR=f"10.5.0.{len(kind)}")
        assert (response.status_code, response["Location"]) == (302, "/password-reset/done/")
        queries[kind] = [q["sql"] for q in captured.captured_queries]

    assert len(queries["account"]) == len(queries["none"]), queries
    assert mail_off_request.wait_until_sent(5)
    assert sorted(m.to[0] for m in mail.outbox) == ["ceo@victim.test", "nobody@victim.test"]


def test_a_password_reset_is_answered_at_once_whatever_the_relay_takes_and_mails_once(client, mail_off_request,
                                                                                      settings):
    """A web process that had mailed no reset yet (just deployed) answered every reset after `EMAIL_TIMEOUT` (10 s in
    production), mailing or not, to hide whether it mailed; one that had, after one of its recent resets' times (the
    relay's): an attacker timing the form (medians ~50 ms apart past the no-account budget) told who has an account.
    The mails now go off the request: every reset, the process's first too, is answered while the relay has answered
    nothing yet, alike with an account, without one, and past the no-account budget; each mail is sent once. (That the
    request does the same Redis calls and queries either way is the two tests below: no timing here, which a loaded
    machine would make flaky.)"""
    from controlplane.accounts import throttle

    _BlockedRelay.opened = threading.Event()
    settings.EMAIL_BACKEND = "tests.test_accounts._BlockedRelay"
    get_user_model().objects.create_user(username="ceo@victim.test", email="ceo@victim.test", password="x" * 12)
    for _ in range(next(iter(throttle.NO_ACCOUNT_MAILS)).num_attempts):
        throttle.take(throttle.NO_ACCOUNT_MAILS, {"email": "spent@victim.test"})
    try:
        for kind, email in (("account", "ceo@victim.test"), ("none", "nobody@victim.test"),
                            ("spent", "spent@victim.test")):
            response = client.post("/password-reset/", {"email": email}, REMOTE_ADDR=f"10.7.0.{len(kind)}")
            assert (response.status_code, response["Location"]) == (302, "/password-reset/done/")
        assert mail.outbox == []  # every reset answered, and the relay has sent nothing
    finally:
        _BlockedRelay.opened.set()

    assert mail_off_request.wait_until_sent(5)
    assert sorted(m.to[0] for m in mail.outbox) == ["ceo@victim.test", "nobody@victim.test"]
    assert "/reset/" in next(m.body for m in mail.outbox if m.to == ["ceo@victim.test"])
    assert mail_off_request.wait_until_sent(1) and len(mail.outbox) == 2  # once each


class _RelayRefusingOneHost(_SlowRelay):
    """The relay at once refuses mail to one host (`@refused.test`), and takes 50 ms for the others."""

    def send_messages(self, messages):
        if any(to.endswith("@refused.test") for message in messages for to in message.to):
            raise smtplib.SMTPRecipientsRefused({})
        return super().send_messages(messages)


@override_settings(EMAIL_BACKEND="tests.test_accounts._RelayRefusingOneHost")
def test_a_reset_mail_the_relay_refuses_is_logged_and_the_others_still_go(client, mail_off_request, caplog):
    """A mail sent off the request that fails is logged at ERROR with whom it was for (never its link), not raised
    anywhere, not tried again; the next mails go."""
    user = get_user_model().objects.create_user(username="me@refused.test", email="me@refused.test", password="x" * 12)
    get_user_model().objects.create_user(username="ceo@victim.test", email="ceo@victim.test", password="x" * 12)
    for email in ("me@refused.test", "nobody@refused.test", "ceo@victim.test"):
        assert client.post("/password-reset/", {"email": email}).status_code == 302

    assert mail_off_request.wait_until_sent(5)
    assert [m.to for m in mail.outbox] == [["ceo@victim.test"]]
    failures = [r for r in caplog.records if r.levelname == "ERROR" and r.name == "controlplane.accounts.mail_sender"]
    assert sorted(r.getMessage() for r in failures) == sorted([
        f"Failed to send a password reset email to user {user.pk}", "Failed to send a password reset's no-account email"])
    assert all("/reset/" not in r.getMessage() for r in failures)


class _BlockedRelay(locmem.EmailBackend):
    """A relay that answers nothing until the test lets it."""

    opened = None

    def send_messages(self, messages):
        assert self.opened.wait(10)
        return super().send_messages(messages)


def test_the_sender_holds_a_bounded_backlog_and_logs_what_it_drops(settings, mail_off_request, monkeypatch, caplog):
    """With the relay stuck, a flood of resets holds at most `MAX_BACKLOG` mails (each dropped past it is logged at
    ERROR), and `NUM_SENDERS` threads: the process's memory and threads are bounded, and the answers never wait."""
    import threading

    from django.core.mail import EmailMessage

    _BlockedRelay.opened = threading.Event()
    settings.EMAIL_BACKEND = "tests.test_accounts._BlockedRelay"
    monkeypatch.setattr(mail_off_request, "MAX_BACKLOG", 3)
    monkeypatch.setattr(mail_off_request, "_backlog", None)  # a fresh process, its backlog as bounded
    try:
        taken = [mail_off_request.send_later(EmailMessage("s", "b", None, [f"u{n}@x.test"]), what=f"mail {n}")
                 for n in range(10)]
        assert not mail_off_request.wait_until_sent(0.1)
    finally:
        _BlockedRelay.opened.set()
    assert mail_off_request.wait_until_sent(5)

    # the senders each hold one, the backlog three more
    num_held = mail_off_request.NUM_SENDERS + 3
    assert taken.count(True) in range(3, num_held + 1) and len(mail.outbox) == taken.count(True)
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [
        f"dropped mail {n}: 3 mails already wait for the relay" for n, ok in enumerate(taken) if not ok]


class _RelayDown(BaseEmailBackend):
    def send_messages(self, messages):
        raise smtplib.SMTPServerDisconnected("relay down")


@override_settings(EMAIL_BACKEND="tests.test_accounts._RelayDown")
def test_a_password_reset_is_answered_the_same_whether_or_not_an_account_has_the_address_while_mail_fails(client):
    """Django's own reset mail logs a failure to send; the no-account mail raised it: with the relay down, an address
    without an account was a 500 and one with an account a redirect (who has one)."""
    client.raise_request_exception = False
    get_user_model().objects.create_user(username="ceo@victim.test", email="ceo@victim.test", password="x" * 12)

    answers = [client.post("/password-reset/", {"email": email}) for email in ("ceo@victim.test", "nobody@victim.test")]

    assert [(response.status_code, response.get("Location")) for response in answers] == [(302, "/password-reset/done/")] * 2


def test_a_password_reset_for_an_address_whose_host_cannot_be_encoded_is_not_a_500(client):
    """Django's `EmailValidator` takes a label of 60 non-ASCII letters, which IDNA cannot encode (past 63 bytes): the
    no-account mail's `UnicodeError` was a 500, no outage needed."""
    client.raise_request_exception = False

    response = client.post("/password-reset/", {"email": "a@" + "é" * 60 + ".test"})

    assert (response.status_code, response.get("Location")) == (302, "/password-reset/done/")


_STOPPING_PROCESS = """
import sys, time
import django
from django.conf import settings
from django.core.mail.backends.filebased import EmailBackend

class HalfSecondRelay(EmailBackend):
    def send_messages(self, messages):
        time.sleep(0.5)
        return super().send_messages(messages)

settings.configure(EMAIL_BACKEND="__main__.HalfSecondRelay", EMAIL_FILE_PATH=sys.argv[1], SEND_MAIL_IN_REQUEST=False,
                   EMAIL_TIMEOUT=5)
django.setup()
from django.core.mail import EmailMessage
from controlplane.accounts import mail_sender
for n in range(3):
    assert mail_sender.send_later(EmailMessage("s", "b", "a@x.test", [f"u{n}@x.test"]), what=f"mail {n}")
"""


def test_a_process_that_stops_sends_the_reset_mails_it_took_first(tmp_path):
    """The sender's threads are daemons: a process that stopped right after handing mails over lost them, unlogged.
    It waits for them as it exits (up to `EMAIL_TIMEOUT`), as a uvicorn worker does (its exit is `sys.exit`)."""
    import subprocess
    import sys

    script = tmp_path / "stopping.py"
    script.write_text(_STOPPING_PROCESS)
    outbox = tmp_path / "outbox"
    outbox.mkdir()
    subprocess.run([sys.executable, str(script), str(outbox)], check=True, timeout=30)

    # NOTE: the file backend may append two mails to one file (named by the second and the backend's id)
    written = "".join(path.read_text() for path in outbox.iterdir())
    assert sorted(line for line in written.splitlines() if line.startswith("To: ")) == [
        "To: u0@x.test", "To: u1@x.test", "To: u2@x.test"]


@pytest.mark.django_db(transaction=True)
@override_settings(EMAIL_BACKEND="tests.test_accounts._SlowRelay")
def test_a_web_process_stopped_by_sigterm_sends_the_reset_mails_it_took_before_its_lifespan_ends(mail_off_request):
    """A pod's stop: the worker's SIGTERM drains, uvicorn shuts down gracefully (the lifespan's shutdown last) and
    then raises the SIGTERM again with its default action (`uvicorn.Server.capture_signals`): the process is killed,
    `atexit` never runs, and the mails still waiting for the relay were lost, not even logged. The application's
    lifespan shutdown now waits for them (up to `EMAIL_TIMEOUT`)."""
    import asyncio

    from controlplane.asgi import application

    for n in range(4):
        assert mail_off_request.send_later(EmailMessage("s", "b", None, [f"u{n}@x.test"]), what=f"mail {n}")
    sent = []

    async def receive():
        return {"type": "lifespan.shutdown"}

    async def send(message):
        sent.append(message)

    asyncio.run(application({"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}}, receive, send))
    assert sent == [{"type": "lifespan.shutdown.complete"}]
    assert sorted(m.to[0] for m in mail.outbox) == [f"u{n}@x.test" for n in range(4)]  # before the process goes
