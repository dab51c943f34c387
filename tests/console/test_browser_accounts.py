"""Sign-up verification and invitations in a real browser; screenshots land in tests/artifacts/screenshots/."""

from __future__ import annotations

import pytest

from controlplane.accounts.invitations import invitation_token
from controlplane.accounts.models import Invitation, Membership, Role
from tests.console.conftest import BROWSER_TIMEOUT_MS, screenshot
from tests.console.test_browser_pages import (
    PASSWORD,
    expect,
    log_in,
    log_in_unverified,
    nav,
    verification_path,
)
from tests.factories import MembershipFactory, UserFactory

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def _new_page(browser, live_server_url):
    context = browser.new_context(base_url=live_server_url, viewport={"width": 1280, "height": 900})
    context.set_default_timeout(BROWSER_TIMEOUT_MS)
    return context, context.new_page()


def test_a_new_account_verifies_its_email_then_invites_a_colleague_who_accepts(page, browser, live_server_url):
    page.goto("/signup/")
    page.get_by_label("Work email").fill("ada@example.test")
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_label("Organisation name").fill("Analytical Engines")
    page.get_by_role("button", name="Create account").click()
    expect(page.get_by_role("heading", name="Check your email")).to_be_visible()
    log_in_unverified(page, "ada@example.test")
    expect(page.get_by_role("heading", name="Verify your email")).to_be_visible()
    expect(page.get_by_test_id("verify-email")).to_contain_text("ada@example.test")
    screenshot(page, "accounts-01-verify-email")
    # The console stays closed until the link is followed.
    page.goto("/console/keys/")
    expect(page.get_by_role("heading", name="Verify your email")).to_be_visible()
    page.get_by_role("button", name="Send a new link").click()
    expect(page.get_by_text("We sent a new link to ada@example.test.")).to_be_visible()

    page.goto(verification_path("ada@example.test"))
    expect(page.get_by_text("Thank you: ada@example.test is verified.")).to_be_visible()
    nav(page, "Members")
    page.get_by_label("Email").fill("Grace@Example.test")
    page.get_by_label("Role").last.select_option("admin")
    page.get_by_role("button", name="Send invitation").click()
    expect(page.get_by_text("We emailed an invitation to grace@example.test")).to_be_visible()
    expect(page.get_by_test_id("invitation-table")).to_contain_text("grace@example.test")
    expect(page.get_by_test_id("invitation-table")).to_contain_text("Admin")
    screenshot(page, "accounts-02-members-pending-invitation")

    invitation = Invitation.objects.get(email="grace@example.test")
    link = f"/invitations/{invitation_token(invitation)}/"

    # Someone else signed in cannot use the link.
    MembershipFactory(user=UserFactory(username="mallory@example.test"), role=Role.OWNER)
    context, intruder = _new_page(browser, live_server_url)
    log_in(intruder, "mallory@example.test")
    intruder.goto(link)
    expect(intruder.get_by_role("alert")).to_contain_text("sent to another email address")
    screenshot(intruder, "accounts-03-invitation-wrong-user")
    context.close()

    grace = UserFactory(username="grace@example.test")
    MembershipFactory(user=grace, role=Role.OWNER)
    context, invitee = _new_page(browser, live_server_url)
    log_in(invitee, "grace@example.test")
    invitee.goto(link)
    expect(invitee.get_by_role("heading", name="Join Analytical Engines")).to_be_visible()
    expect(invitee.get_by_test_id("invitation")).to_contain_text("as admin")
    screenshot(invitee, "accounts-04-invitation-accept")
    invitee.get_by_role("button", name="Accept and join").click()
    expect(invitee.get_by_text("You joined Analytical Engines as admin.")).to_be_visible()
    context.close()
    assert Membership.objects.get(user=grace, organization__name="Analytical Engines").role == Role.ADMIN

    page.reload()
    expect(page.get_by_test_id("member-table")).to_contain_text("grace@example.test")
    expect(page.get_by_test_id("invitation-table")).to_have_count(0)
