"""The Content-Security-Policy the control plane's pages are served with (`controlplane/content_security.py`).

Every browser test in this folder fails on a script error, and a page that broke the policy logs one: the
console's own pages keep to it. Here: that it is sent, and that a real browser enforces it (a script that got
into a page, as injected text would, does not run), and that text people choose is escaped before it gets there."""

from __future__ import annotations

import pytest
from django.test import Client

from controlplane.accounts import invitations
from controlplane.accounts.models import Organization, Role
from controlplane.accounts.services import Actor
from controlplane.content_security import HEADER, PERMISSIONS_HEADER
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("path", ["/login/", "/api/docs/", "/admin/login/"])
def test_pages_are_served_with_the_policy(client, path):
    policy = client.get(path)[HEADER]
    assert "script-src 'self'" in policy and "frame-ancestors 'none'" in policy and "object-src 'none'" in policy
    assert "unsafe-eval" not in policy and "script-src 'self' 'unsafe-inline'" not in policy


@pytest.mark.parametrize("path", ["/login/", "/api/docs/", "/api/schema/"])
def test_pages_refuse_the_browser_features_none_uses(client, path):
    """Before, no Permissions-Policy was sent (scanners flag its absence): a script that got into a page could ask for
    the camera, the microphone or the location in our origin's name."""
    features = dict(part.strip().split("=") for part in client.get(path)[PERMISSIONS_HEADER].split(","))
    assert {features[name] for name in ("camera", "microphone", "geolocation", "payment", "usb")} == {"()"}


@pytest.mark.browser
@pytest.mark.django_db(transaction=True)
def test_an_inline_script_in_a_page_does_not_run_and_the_pages_own_scripts_do(browser, live_server_url):
    context = browser.new_context(base_url=live_server_url)
    page = context.new_page()
    violations = []
    page.on("console", lambda message: "Content Security Policy" in message.text and violations.append(message.text))
    page.goto("/login/")
    page.wait_for_function("() => window.htmx !== undefined")  # our own script, from our own origin, ran
    ran = page.evaluate("""() => {
        window.injected = false;
        const script = document.createElement("script");
        script.textContent = "window.injected = true";
        document.body.appendChild(script);
        const img = document.createElement("img");
        img.setAttribute("onerror", "window.injected = true");
        img.src = "data:,not-an-image";
        document.body.appendChild(img);
        return new Promise(resolve => setTimeout(() => resolve(window.injected), 300));
    }""")
    context.close()
    assert ran is False
    assert violations, "the browser reported no refused script"


MARKUP = '"><img src=x onerror=alert(1)><script>alert(1)</script>'


def test_names_people_choose_are_shown_as_text_on_the_accounts_pages(org, console_client_factory):
    """A guard (it held before): an organisation's, a key's or an invitee's name with markup in it is escaped on
    every page that shows it, the policy above being the second line."""
    Organization.objects.filter(pk=org.pk).update(name=f"Acme{MARKUP}")
    owner = console_client_factory(org, Role.OWNER)
    created = owner.post("/console/keys/", {"name": f"k{MARKUP}"[:100], "scopes": ["inference"]})
    invitee = UserFactory()
    invitation = invitations.invite_member(Actor(user=owner.user), org, email=invitee.email, role=Role.MEMBER)
    invited = Client()
    invited.force_login(invitee)
    pages = {
        "key created": created,
        "dashboard": owner.get("/console/"),
        "keys": owner.get("/console/keys/"),
        "members": owner.get("/console/members/"),
        "invitation": invited.get(f"/invitations/{invitations.invitation_token(invitation)}/"),
    }

    assert created.status_code == 201
    for name, page in pages.items():
        html = page.content.decode()
        assert "<img src=x" not in html and "<script>alert" not in html, name
        assert "&lt;img src=x onerror=alert(1)&gt;" in html, name


@pytest.mark.browser
@pytest.mark.django_db(transaction=True)
def test_the_api_reference_every_page_links_shows_the_operations_in_a_browser(browser, live_server_url):
    """`/api/docs/` (the footer's "API reference"): Swagger UI drawing the schema's operations, under the policy.

    NOTE: drf-spectacular's `SpectacularSwaggerView` starts Swagger UI with an inline script, which the policy
    refuses: the page was blank in every browser (a white page and one refused inline script in the console)."""
    context = browser.new_context(base_url=live_server_url)
    page = context.new_page()
    refused = []
    page.on("console", lambda message: "Content Security Policy" in message.text and refused.append(message.text))
    page.goto("/")
    page.get_by_role("link", name="API reference").click()
    try:
        page.locator(".opblock-summary-path", has_text="/api/v1/endpoints/").first.wait_for(timeout=15_000)
    finally:
        context.close()
    assert not refused, refused
