"""A console form acts in the organisation its page was shown for, or not at all.

Two tabs: tab 1 shows organisation A's page; in tab 2 the user switches to organisation B (the top bar's switcher
writes the session's organisation); back in tab 1, whose page still says A, they post its form. Before, the form
carried no trace of A, and acted in B without a word: a $0 cap, a key, an invitation, an endpoint. Every such form now
carries the organisation it was shown for (`_page_organization.html`), and `member_required` refuses it in another:
nothing changes, and the page says why.
"""

from __future__ import annotations

import re
from decimal import Decimal
from pathlib import Path

import pytest
from django.conf import settings
from django.contrib.messages import get_messages
from django.urls import reverse

from billing.models import BillingAccount
from controlplane.accounts.console import PAGE_ORGANIZATION_FIELD
from controlplane.accounts.models import ApiKey, Invitation, Role
from endpoints.models import Endpoint
from tests.console.test_endpoint_pages import VALID_SPEC
from tests.factories import EndpointFactory, MembershipFactory, OrganizationFactory

pytestmark = pytest.mark.django_db

REFUSAL = "This page was for {shown}; you have since switched to {now}. Nothing was changed."


def shown_for(page) -> dict[str, str]:
    """The organisation field a page's forms carry, as a browser posts it."""
    found = set(re.findall(rf'name="{PAGE_ORGANIZATION_FIELD}" value="([^"]*)"', page.content.decode()))
    assert len(found) == 1, f"the page's forms carry {found or 'no organisation'}"
    return {PAGE_ORGANIZATION_FIELD: found.pop()}


@pytest.fixture
def other(owner):
    """Organisation B, which the owner of A (`org`) belongs to as well."""
    other = OrganizationFactory(name="Other")
    MembershipFactory(organization=other, user=owner.user, role=Role.OWNER)
    return other


def switch(client, organization) -> None:
    """Tab 2: the top bar's switcher."""
    assert client.post(reverse("switch-organization"), {"organization": organization.pk}).status_code == 302


def assert_refused(response, *, shown: str, now: str) -> None:
    """Sent back, told why (the last message: those of earlier refusals stay queued until a page shows them)."""
    assert response.status_code == 302
    assert [str(m) for m in get_messages(response.wsgi_request)][-1:] == [REFUSAL.format(shown=shown, now=now)]


def test_a_cap_saved_on_a_page_of_one_organisation_is_not_applied_to_the_one_switched_to_meanwhile(owner, org, other):
    tab_1 = owner.get(reverse("console:billing"))
    assert org.name in tab_1.content.decode()
    switch(owner, other)

    response = owner.post(reverse("console:billing-cap"), {"spend_cap": "0"} | shown_for(tab_1),
                          HTTP_REFERER="http://testserver" + reverse("console:billing"))

    assert_refused(response, shown=org.name, now=other.name)
    assert response["Location"] == "http://testserver" + reverse("console:billing")  # back to the page, saying why
    assert REFUSAL.format(shown=org.name, now=other.name) in owner.get(response["Location"]).content.decode()
    assert not BillingAccount.objects.filter(spend_cap=Decimal("0")).exists()


def test_the_same_form_saved_in_the_organisation_it_was_shown_for_acts(owner, org):
    tab_1 = owner.get(reverse("console:billing"))
    assert owner.post(reverse("console:billing-cap"), {"spend_cap": "0"} | shown_for(tab_1)).status_code == 302
    assert BillingAccount.objects.get(organization=org).spend_cap == Decimal("0")


def test_a_form_that_names_no_organisation_acts_as_before(owner, org, other):
    """An API client, or a page cached from before forms carried the field (a rolling deploy)."""
    switch(owner, other)
    assert owner.post(reverse("console:billing-cap"), {"spend_cap": "0"}).status_code == 302
    assert BillingAccount.objects.get(organization=other).spend_cap == Decimal("0")


def test_a_key_created_on_a_page_of_one_organisation_is_not_created_in_the_other(owner, org, other):
    tab_1 = owner.get(reverse("console:keys"))
    switch(owner, other)
    response = owner.post(reverse("console:keys"), {"name": "ci", "scopes": ["inference"], "expires_in_days": "30"}
                          | shown_for(tab_1))
    assert_refused(response, shown=org.name, now=other.name)
    assert response["Location"] == reverse("console:dashboard")  # no page to go back to named
    assert not ApiKey.objects.filter(name="ci").exists()


def test_an_invitation_sent_from_a_page_of_one_organisation_is_not_sent_from_the_other(owner, org, other):
    tab_1 = owner.get(reverse("console:members"))
    switch(owner, other)
    response = owner.post(reverse("console:members"), {"email": "new@example.test", "role": Role.ADMIN}
                          | shown_for(tab_1))
    assert_refused(response, shown=org.name, now=other.name)
    assert not Invitation.objects.filter(email="new@example.test").exists()


def test_an_endpoint_deployed_from_a_page_of_one_organisation_is_not_deployed_in_the_other(owner, org, other):
    tab_1 = owner.get(reverse("console:endpoint-new"))
    switch(owner, other)
    response = owner.post(reverse("console:endpoint-new"), VALID_SPEC | shown_for(tab_1))
    assert_refused(response, shown=org.name, now=other.name)
    assert not Endpoint.objects.filter(name=VALID_SPEC["name"]).exists()


def test_an_endpoint_edited_or_deleted_from_a_page_of_one_organisation_is_refused_with_why(owner, org, other):
    """Before, A's endpoint was a bare 404 in B: the user was not told that nothing was saved, nor why."""
    endpoint = EndpointFactory(organization=org, name="chat-a", max_replicas=2)
    edit_page = owner.get(reverse("console:endpoint-edit", args=[endpoint.pk]))
    delete_page = owner.get(reverse("console:endpoint-delete", args=[endpoint.pk]))
    switch(owner, other)

    edited = owner.post(reverse("console:endpoint-edit", args=[endpoint.pk]),
                        VALID_SPEC | {"name": "chat-a", "max_replicas": "4"} | shown_for(edit_page))
    deleted = owner.post(reverse("console:endpoint-delete", args=[endpoint.pk]),
                         {"confirm_name": "chat-a"} | shown_for(delete_page))

    assert_refused(edited, shown=org.name, now=other.name)
    assert_refused(deleted, shown=org.name, now=other.name)
    endpoint.refresh_from_db()
    assert endpoint.max_replicas == 2 and endpoint.deleted_at is None


def test_a_forged_organisation_is_refused_without_naming_it(owner, org, other):
    stranger = OrganizationFactory(name="Not yours")
    switch(owner, other)
    for forged in (str(stranger.pk), "x", "9" * 40, "²"):
        response = owner.post(reverse("console:billing-cap"), {"spend_cap": "0", PAGE_ORGANIZATION_FIELD: forged})
        assert_refused(response, shown="another organisation", now=other.name)
    assert not BillingAccount.objects.filter(spend_cap=Decimal("0")).exists()


# Forms that act in no organisation's name, so carry none: the switcher and signing out (base.html), and pages of
# a signed-out visitor, of the user's own account, of staff (the fleet is the platform's) and of the admin site.
EXEMPT_ACTIONS = ("{% url 'switch-organization' %}", "{% url 'logout' %}")
EXEMPT_TEMPLATES = ("registration/", "controlplane/signup.html", "controlplane/invitation.html",
                    "controlplane/no_organization.html", "gpu_agent/", "billing/abandon_held_difference.html",
                    "billing/send_held_difference.html", "controlplane/account_delete.html", "admin/",
                    "controlplane/organization_new.html")
FORM = re.compile(r"<form\b[^>]*\bmethod=\"post\"[^>]*>.*?</form>", re.DOTALL | re.IGNORECASE)


def test_every_console_form_that_posts_carries_the_organisation_its_page_was_shown_for():
    """A new form cannot forget it: every POST form of every template, bar the exempt ones above."""
    root = Path(settings.BASE_DIR) / "templates"
    missing, num_checked = [], 0
    for template in sorted(root.rglob("*.html")):
        name = template.relative_to(root).as_posix()
        if name.startswith(EXEMPT_TEMPLATES):
            continue
        for form in FORM.findall(template.read_text()):
            if any(action in form.split(">", 1)[0] for action in EXEMPT_ACTIONS):
                continue
            num_checked += 1
            if '{% include "controlplane/_page_organization.html" %}' not in form:
                missing.append(f"{name}: {form[:80]}")
    assert num_checked >= 20 and missing == []
