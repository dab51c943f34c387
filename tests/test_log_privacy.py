"""No log line names a person (`controlplane.log_privacy`): logs are shipped and kept where account erasure never
reaches, so the web server's, the worker's and this process's lines carry ids and keyed digests, never an address or
a name, whatever the flow and whatever fails in it (a relay refusing a recipient, a link opened by the wrong account)."""

from __future__ import annotations

import base64
import logging
import re
import socketserver
import threading
import time

import httpx
import pytest
from django.contrib.auth import get_user_model
from hypothesis import assume, given, strategies
from hypothesis import settings as hypothesis_settings

from billing import stripe_sync
from billing.models import Dispute
from billing.tasks import review_payment_standing
from controlplane.access_log import log_answer
from controlplane.accounts import departures, invitations, members
from controlplane.accounts.models import Membership, Role
from controlplane.accounts.services import Actor
from controlplane.accounts.signup import email_verification_token
from controlplane.log_privacy import (
    ADDRESS,
    MAX_ADDRESSES_A_LINE,
    address_digest,
    hide_addresses,
    shown_address,
)
from tests.conftest import start_celery_worker, start_web_server
from tests.factories import MembershipFactory, OrganizationFactory, UserFactory
from tests.fakes.stripe_server import FakeStripe

PASSWORD = "correct horse battery"  # UserFactory's
SIGNING_UP = "grace.hopper@example.test"
BOUNCING = "ada.bounce@example.test"  # the relay refuses every address with "bounce" in it
UNKNOWN = "nobody.bounce@example.test"
INVITED = "katherine.johnson@example.test"
NAMES = ("Lovelace", "Augusta", "Hopperton")
_CSRF = re.compile(r'name="csrfmiddlewaretoken" value="([^"]+)"')


class _Relay(socketserver.StreamRequestHandler):
    """Just enough SMTP: a relay that takes mail for every recipient but those with "bounce" in the address, which it
    refuses as a real one does, naming the address (`550 5.1.1 <…>: user unknown`)."""

    def handle(self):
        self.wfile.write(b"220 relay.test ESMTP\r\n")
        while line := self.rfile.readline():
            command = line.decode(errors="replace").strip()
            verb = command[:4].upper()
            if verb == "DATA":
                self.wfile.write(b"354 go on\r\n")
                while (data := self.rfile.readline()) and data != b".\r\n":
                    pass
                answer = "250 queued"
            elif verb == "RCPT" and "bounce" in command.lower():
                answer = f"550 5.1.1 {command.split(':', 1)[1].strip()}: user unknown"
            elif verb == "QUIT":
                self.wfile.write(b"221 bye\r\n")
                return
            else:
                answer = "250 relay.test"
            self.wfile.write(answer.encode() + b"\r\n")


@pytest.fixture
def relay():
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Relay)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield {"EMAIL_HOST": "127.0.0.1", "EMAIL_PORT": str(server.server_address[1]), "EMAIL_USE_TLS": "0"}
    server.shutdown()
    server.server_close()


def _post_form(client: httpx.Client, path: str, data: dict) -> httpx.Response:
    form = client.get(path)
    token = _CSRF.search(form.text)
    return client.post(path, data={**data, "csrfmiddlewaretoken": token.group(1) if token else ""})


def _what_names_a_person(text: str, secrets: tuple[str, ...]) -> list[str]:
    """Each address, name or secret found in `text`, the base64 of an address included (a signed token's payload)."""
    found = [word for word in (SIGNING_UP, BOUNCING, UNKNOWN, INVITED, *NAMES, *secrets) if word.lower() in text.lower()]
    for chunk in re.findall(r"[A-Za-z0-9_-]{16,}", text):
        try:
            decoded = base64.urlsafe_b64decode(chunk + "=" * (-len(chunk) % 4)).decode(errors="ignore")
        except ValueError:
            continue
        found += [f"{address} (base64)" for address in (SIGNING_UP, BOUNCING) if address in decoded]
    return found


@pytest.mark.django_db(transaction=True)
def test_no_log_line_of_any_process_names_an_address_or_a_name_whatever_the_flow(relay, tmp_path, web_zygote, caplog,
                                                                                settings):
    caplog.set_level(logging.INFO)
    caplog.set_level(logging.WARNING, logger="httpx")  # this test's own browser, which names the links it opens
    stripe = FakeStripe().start()
    billed = {"STRIPE_SECRET_KEY": "sk_test_inferplane", "STRIPE_API_BASE": stripe.base_url}
    settings.STRIPE_SECRET_KEY, settings.STRIPE_API_BASE = billed["STRIPE_SECRET_KEY"], stripe.base_url
    ada = UserFactory(username=BOUNCING, first_name=NAMES[1], last_name=NAMES[0])
    organization = OrganizationFactory(name="Analytical Engines")
    MembershipFactory(organization=organization, user=ada, role=Role.OWNER)
    ada_link = email_verification_token(ada)
    web, base_url = start_web_server(tmp_path, zygote=web_zygote, extra_env=relay)
    worker = start_celery_worker(tmp_path, extra_env=relay | billed)
    try:
        with httpx.Client(base_url=base_url, timeout=30) as browser:
            # sign-up (its verification mail taken by the relay), a sign-in refused for a known and an unknown
            # address, then one that passes
            signed_up = _post_form(browser, "/signup/", {"email": SIGNING_UP, "password": PASSWORD,
                                                         "organization_name": "Hopper Labs"})
            assert signed_up.status_code == 302, signed_up.text[-2000:]
            browser.post("/logout/", data={"csrfmiddlewaretoken": browser.cookies.get("csrftoken", "")})
            assert _post_form(browser, "/login/", {"username": BOUNCING, "password": "wrong"}).status_code == 200
            assert _post_form(browser, "/login/", {"username": UNKNOWN, "password": "wrong"}).status_code == 200
            assert _post_form(browser, "/login/", {"username": SIGNING_UP, "password": PASSWORD}).status_code == 302
            # another account's verification link, opened in this session: refused (Django logs the 400 and its path)
            assert browser.get(f"/verify-email/{ada_link}/").status_code == 400
            # password resets whose mail the relay refuses: an account's link and the no-account mail
            assert _post_form(browser, "/password-reset/", {"email": BOUNCING}).status_code == 302
            assert _post_form(browser, "/password-reset/", {"email": UNKNOWN}).status_code == 302
        # a Stripe customer for the organisation, then the worker: a disputed payment holds the organisation, and the hold's mail to its owner is refused
        stripe_sync.ensure_customer(organization.pk)
        Dispute.objects.create(organization=organization, stripe_dispute_id="dp_logaddr", status="needs_response",
                               amount=500)
        assert review_payment_standing.delay().get(timeout=60) == 1
        # this process: an invitation sent, revoked, sent again and accepted, a role changed, an account deleted
        actor = Actor(user=ada)
        invitations.revoke_invitation(actor, invitations.invite_member(actor, organization, email=INVITED,
                                                                       role=Role.MEMBER))
        invitation = invitations.invite_member(actor, organization, email=INVITED, role=Role.MEMBER)
        katherine = UserFactory(username=INVITED, first_name="Katherine", last_name=NAMES[2])
        membership = invitations.accept_invitation(Actor(user=katherine), invitation)
        members.change_member_role(actor, Membership.objects.get(pk=membership.pk), role=Role.ADMIN)
        departures.end_account(Actor(user=katherine), katherine)
        assert get_user_model().objects.get(pk=katherine.pk).email != INVITED
    finally:
        web.stop()
        worker.stop(timeout_s=0)
        stripe.stop()

    logs = {"web": web.log_text(), "worker": worker.log_text(), "caplog": caplog.text}
    found = {name: _what_names_a_person(text, (ada_link,)) for name, text in logs.items()}
    assert found == {"web": [], "worker": [], "caplog": []}
    # the flows ran and were logged: the refused mails by their digest, the refused link with its secret hidden
    assert f"<address {address_digest(BOUNCING)}>" in logs["web"]
    assert f"<address {address_digest(UNKNOWN)}>" in logs["web"]
    assert "Bad Request: /verify-email/<token>/" in logs["web"]
    assert f"could not email organisation {organization.pk} about its hold" in logs["worker"]
    assert f"<address {address_digest(BOUNCING)}>" in logs["worker"]


def test_an_address_becomes_the_same_keyed_digest_in_any_line_and_anything_else_stays():
    line = "refused {'Ada.Lovelace+x@Example.TEST': (550, b'5.1.1 <ada.lovelace+x@example.test>: user unknown')}"
    digest = address_digest("ada.lovelace+x@example.test")
    assert hide_addresses(line) == f"refused {{'<address {digest}>': (550, b'5.1.1 <<address {digest}>>: user unknown')}}"
    assert hide_addresses("redis://:secret@localhost:6379/0 and vllm@0.11.0") == (
        "redis://:secret@localhost:6379/0 and vllm@0.11.0")


def test_a_logged_exception_names_no_address_in_its_traceback(caplog):
    logger = logging.getLogger("inferplane.test")
    try:
        raise ValueError(f"Key (username)=({BOUNCING}) already exists.")
    except ValueError:
        logger.exception("sign-up of user %s failed for %s", 7, BOUNCING)
    assert BOUNCING not in caplog.text
    assert caplog.text.count(f"<address {address_digest(BOUNCING)}>") == 2
    assert "user 7" in caplog.text


def test_a_hostile_path_costs_the_scrubber_microseconds_a_kilobyte_not_milliseconds(caplog):
    # Every request's access line names its path (`access_log.log_answer`, the gateway's 401 included), a stranger's
    # up to the 8 KB a proxy lets through: local parts of 253 characters each followed by `@` and 126 labels that end
    # in no top label. `ADDRESS.sub` read each local part again from each of its characters, and the labels after it,
    # about 10 microseconds a character: 80 ms of the web process's CPU and GIL a request, 1 s for 12; found from each
    # `@`, a few milliseconds in all. And domains with no local part before their `@`, each passed over by the search.
    paths = [("/v1/" + ("a" * 253 + "@" + "b." * 126 + "1/") * 16)[:8192], ("/v1/" + ":@b.cd" * 1400)[:8192]]
    caplog.set_level(logging.INFO, logger="inferplane.access")
    # first the URL resolver built (`redacted_path`), not timed
    log_answer({"type": "http", "method": "GET", "path": "/v1/models", "client": None}, 200, time.monotonic())
    started = time.monotonic()
    for path in paths * 6:
        log_answer({"type": "http", "method": "GET", "path": path, "client": None}, 404, started)
    assert time.monotonic() - started < 0.1
    assert [paths[0] in record.getMessage() for record in caplog.records[-2:]] == [True, False]
    assert paths[1] in caplog.records[-1].getMessage()


def test_a_path_of_a_thousand_addresses_is_cut_after_sixteen_not_digested_whole(caplog):
    # Each address a keyed digest: 940 in the 8 KB path a proxy lets through were 5 ms of the GIL on every request's
    # access line (the gateway's 401 included), and a line 3 times longer than the path.
    path = "/v1/" + "/".join(f"{number:x}@b.cd" for number in range(940))
    caplog.set_level(logging.INFO, logger="inferplane.access")
    log_answer({"type": "http", "method": "GET", "path": path, "client": None}, 401, time.monotonic())
    line = caplog.records[-1].getMessage()
    assert line.count("<address ") == MAX_ADDRESSES_A_LINE == 16
    assert f"<address {address_digest('f@b.cd')}>" in line and "@b.cd" not in line
    assert '<8075 characters cut: more than 16 addresses>" 401 ' in line  # the line's status and time kept


_TEXT_PARTS = strategies.sampled_from([*"ab1.-@+_ x\u0663\u00e9", "xn--", "cd", "a" * 30, "a" * 254, "b." * 130])


@hypothesis_settings(max_examples=500, deadline=None)
@given(strategies.lists(_TEXT_PARTS, max_size=40).map("".join))
def test_the_scrubber_hides_exactly_what_the_address_pattern_matches(text):
    assume(len(ADDRESS.findall(text)) <= MAX_ADDRESSES_A_LINE)
    assert hide_addresses(text) == ADDRESS.sub(lambda match: shown_address(match.group()), text)


def test_a_long_line_an_outsider_wrote_is_scrubbed_in_time_linear_in_its_length(caplog):
    # A Host header, a path or an input an error names: a run of word characters and an `@` later. Unbounded, the
    # address's local part was tried from each character of the run to its end (quadratic: 32 KB took 2 s, 100 KB 20 s,
    # the logging thread and the GIL held throughout).
    run = "a" * 50_000
    started = time.monotonic()
    logging.getLogger("django.security.DisallowedHost").error("Invalid HTTP_HOST header: %r.", f"{run} @ {run}.")
    assert time.monotonic() - started < 2
    assert caplog.records[-1].getMessage() == f"Invalid HTTP_HOST header: '{run} @ {run}.'."
    # an address is hidden whole however long its parts may be (an address stored: 254 in all; a label: 63)
    local, label = "b" * 180, "c" * 63
    assert hide_addresses(f"to {local}@{label}.{label}.example.test.") == (
        f"to <address {address_digest(f'{local}@{label}.{label}.example.test')}>.")
