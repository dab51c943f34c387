"""The console's "New organisation" (`/org/new/`, beside the top bar's switcher): a form with its CSRF token and no
inline script or style, whose organisation the console then acts in; its refusals on the form. Browser-free: the
pages as Django serves them. The service's bounds are `tests/test_new_organizations.py`."""

from __future__ import annotations

import re

import pytest
from django.conf import settings as django_settings
from django.test import Client
from django.urls import reverse

from controlplane.accounts.models import Membership, Organization, Role
from controlplane.accounts.tenancy import SESSION_KEY
from controlplane.content_security import HEADER
from tests.factories import MembershipFactory, OrganizationFactory, UserFactory

pytestmark = pytest.mark.django_db

NEW = "/org/new/"


def _csrf_token(client: Client, page) -> str:
    return re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.content.decode()).group(1)


@pytest.fixture
def browser(owner):
    """The owner's console, as a browser: every post needs the page's CSRF token."""
    owner.handler.enforce_csrf_checks = True
    return owner


def test_the_top_bar_links_to_the_new_organisation_page(owner):
    page = owner.get(reverse("console:dashboard")).content.decode()

    assert f'href="{NEW}"' in page and "New organisation" in page


def test_creating_one_makes_its_creator_the_owner_and_the_console_acts_in_it(browser):
    form = browser.get(NEW)
    assert form.status_code == 200

    answer = browser.post(NEW, {"name": "Acme Staging", "csrfmiddlewaretoken": _csrf_token(browser, form)})

    assert answer.status_code == 302 and answer.url == reverse("console:dashboard")
    organization = Organization.objects.get(name="Acme Staging")
    assert Membership.objects.get(organization=organization, user=browser.user).role == Role.OWNER
    assert browser.session[SESSION_KEY] == organization.pk
    dashboard = browser.get(answer.url).content.decode()
    assert "Acme Staging is created, with you as its owner" in dashboard
    assert f'<option value="{organization.pk}" selected>Acme Staging</option>' in dashboard


def test_a_post_without_its_csrf_token_is_refused_and_creates_nothing(browser):
    answer = browser.post(NEW, {"name": "Forged"})

    assert answer.status_code == 403
    assert not Organization.objects.filter(name="Forged").exists()


def test_a_bad_name_is_shown_next_to_its_field_with_a_400(browser):
    form = browser.get(NEW)

    answer = browser.post(NEW, {"name": "\u202eevil", "csrfmiddlewaretoken": _csrf_token(browser, form)})

    assert answer.status_code == 400
    assert 'class="error"' in answer.content.decode() and "U+202E" in answer.content.decode()
    assert browser.session[SESSION_KEY] == browser.organization.pk


def test_past_the_cap_the_form_says_so_with_a_400(browser, settings):
    settings.MAX_OWNED_ORGANIZATIONS = 1
    form = browser.get(NEW)

    answer = browser.post(NEW, {"name": "One too many", "csrfmiddlewaretoken": _csrf_token(browser, form)})

    assert answer.status_code == 400 and "the most one person may" in answer.content.decode()
    assert not Organization.objects.filter(name="One too many").exists()


def test_an_unverified_account_is_sent_to_verify_its_email(db):
    user = UserFactory(verified=False)
    MembershipFactory(organization=OrganizationFactory(), user=user, role=Role.OWNER)
    client = Client()
    client.force_login(user)

    assert client.get(NEW).url == reverse("verify-email")
    assert client.post(NEW, {"name": "Unverified"}).url == reverse("verify-email")
    assert not Organization.objects.filter(name="Unverified").exists()


def test_a_person_in_no_organisation_is_offered_one_of_their_own(db):
    user = UserFactory()
    client = Client()
    client.force_login(user)

    assert f'href="{NEW}"' in client.get(reverse("console:dashboard")).content.decode()
    assert client.post(NEW, {"name": "My own"}).status_code == 302
    assert Membership.objects.get(user=user).organization.name == "My own"


def test_the_page_has_no_inline_script_or_style_and_is_served_with_the_policy(owner):
    answer = owner.get(NEW)
    page = answer.content.decode()

    assert answer[HEADER] == django_settings.CONTENT_SECURITY_POLICY
    assert re.search(r"\sstyle=", page) is None and "<style" not in page
    assert re.findall(r"<script(?![^>]*\bsrc=)", page) == []
    assert 'name="csrfmiddlewaretoken"' in page and '<label for="id_name">' in page
