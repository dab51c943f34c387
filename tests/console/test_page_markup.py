"""What an HTML validator and an accessibility checker read on every console page: ids used once, every field a
label, every form that posts a CSRF token.

The pages are rendered as an owner sees them, with an endpoint, a key, a credential and a member, so that each
page's tables and forms are there; the anonymous pages as anyone sees them.
"""

from __future__ import annotations

from collections import Counter
from html.parser import HTMLParser

import pytest
from django.test import Client

from controlplane.accounts.keys import create_api_key
from controlplane.accounts.models import Role, Scope
from controlplane.accounts.services import Actor
from endpoints import credentials
from tests.factories import EndpointFactory, MembershipFactory, UserFactory

pytestmark = pytest.mark.django_db

LABELLED_ELSEWHERE = {"hidden", "submit", "button", "reset", "image"}


class _Page(HTMLParser):
    """The ids, fields, labels and forms of one page."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.ids: Counter[str] = Counter()
        self.label_targets: set[str] = set()
        self.unlabelled_candidates: list[dict] = []
        self.open_labels = 0
        self.forms: list[dict] = []

    def handle_starttag(self, tag, attrs):
        attributes = dict(attrs)
        if "id" in attributes:
            self.ids[attributes["id"]] += 1
        if tag == "label":
            self.open_labels += 1
            if attributes.get("for"):
                self.label_targets.add(attributes["for"])
        elif tag == "form":
            self.forms.append({"method": (attributes.get("method") or "get").lower(), "csrf": False,
                               "action": attributes.get("action")})
        elif tag in {"input", "select", "textarea"}:
            if tag == "input" and attributes.get("name") == "csrfmiddlewaretoken" and self.forms:
                self.forms[-1]["csrf"] = True
            if (tag != "input" or attributes.get("type", "text") not in LABELLED_ELSEWHERE) and not self.open_labels \
                    and not attributes.get("aria-label") and not attributes.get("aria-labelledby") \
                    and not attributes.get("title"):
                self.unlabelled_candidates.append(attributes)

    def handle_endtag(self, tag):
        if tag == "label":
            self.open_labels = max(0, self.open_labels - 1)

    def problems(self) -> list[str]:
        found = [f"id {name!r} used {count} times" for name, count in self.ids.items() if count > 1]
        found += [f"no label for field {field.get('name') or field.get('id')!r}" for field in self.unlabelled_candidates
                  if field.get("id") not in self.label_targets]
        found += [f"a POST form without a CSRF token (action {form['action']!r})" for form in self.forms
                  if form["method"] == "post" and not form["csrf"]]
        return found


def _problems(html: str) -> list[str]:
    page = _Page()
    page.feed(html)
    page.close()
    return page.problems()


def test_the_checker_finds_what_it_looks_for():
    assert _problems('<p id="a"></p><p id="a"></p>') == ["id 'a' used 2 times"]
    assert _problems('<input name="q">') == ["no label for field 'q'"]
    assert _problems('<label for="q">Q</label><input id="q" name="q"><label>R <input name="r"></label>') == []
    assert _problems('<form method="post"><button>Go</button></form>') == ["a POST form without a CSRF token (action None)"]


ANONYMOUS_PAGES = ["/", "/login/", "/signup/", "/password-reset/"]
OWNER_PAGES = ["/console/", "/console/endpoints/", "/console/endpoints/new/", "/console/endpoints/{endpoint}/",
               "/console/endpoints/{endpoint}/edit/", "/console/endpoints/{endpoint}/delete/", "/console/credentials/",
               "/console/credentials/{credential}/", "/console/batches/", "/console/keys/", "/console/members/",
               "/console/usage/", "/console/billing/", "/console/organization/close/", "/account/delete/",
               "/password-change/", "/org/new/"]


@pytest.mark.parametrize("path", ANONYMOUS_PAGES)
def test_anonymous_pages_are_valid_and_labelled(client, path):
    answer = client.get(path)
    assert answer.status_code == 200
    assert _problems(answer.content.decode()) == []


@pytest.fixture
def owner_pages(org):
    owner = UserFactory()
    MembershipFactory(organization=org, user=owner, role=Role.OWNER)
    MembershipFactory(organization=org, role=Role.MEMBER)
    create_api_key(Actor(user=owner), org, name="ci", scopes=[Scope.INFERENCE])
    credential = credentials.create_credential(Actor(user=owner), org, kind="hf", name="hub", hf_token="hf_x")
    endpoint = EndpointFactory(organization=org, name="support-chat")
    client = Client()
    client.force_login(owner)
    return client, {"endpoint": endpoint.pk, "credential": credential.pk}


@pytest.mark.parametrize("path", OWNER_PAGES)
def test_console_pages_are_valid_and_labelled(owner_pages, path):
    client, ids = owner_pages
    answer = client.get(path.format(**ids))
    assert answer.status_code == 200
    assert _problems(answer.content.decode()) == []
