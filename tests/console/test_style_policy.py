"""The console's pages keep to a Content-Security-Policy with no `'unsafe-inline'` anywhere, styles included.

NOTE: the policy allowed inline styles (`style-src 'self' 'unsafe-inline'`) for the bars' widths (`style="width: 40%"`)
and a few layout rules written in the markup: what security scanners flag on every page (ZAP's "CSP: style-src
unsafe-inline", the Observatory's policy test), and what lets text that got into a page restyle it (hide a warning,
draw a fake form over the page). A bar's filled share is now SVG geometry (`{% bar_fill %}`), which no policy governs;
the layout rules are in `static/css/app.css`; htmx's own indicator `<style>` is switched off (`htmx-config`).
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.conf import settings
from django.utils import timezone

from billing.models import UsageRecord
from controlplane.accounts.models import Role
from controlplane.content_security import HEADER
from endpoints.models import Replica
from gpu_agent.protocol import ReplicaState
from tests.factories import EndpointFactory, MembershipFactory, OrganizationFactory, UserFactory

PASSWORD = "correct horse battery"


def test_the_policy_allows_no_inline_script_or_style(client, db):
    policy = client.get("/login/")[HEADER]
    assert policy == settings.CONTENT_SECURITY_POLICY
    directives = dict(part.strip().split(" ", 1) for part in policy.split(";"))
    assert directives["style-src"] == "'self'" and directives["script-src"] == "'self'"
    assert "unsafe-inline" not in policy


def _bar_share(page, locator) -> float:
    """The filled share of the bar `locator` (0–1), as the browser laid it out."""
    return page.evaluate("""bar => {
        const fill = bar.querySelector("rect").getBoundingClientRect().width;
        return fill / bar.getBoundingClientRect().width;
    }""", locator.element_handle())


@pytest.mark.browser
@pytest.mark.django_db(transaction=True)
def test_the_bars_are_drawn_to_their_share_with_no_inline_style(page):
    """Before, each bar's width was a `style` attribute: with the policy above the browser refused every one (the
    `page` fixture fails on the refusal it logs) and drew each bar empty."""
    from playwright.sync_api import expect

    organization = OrganizationFactory()
    user = UserFactory(username="grace@example.test", password=PASSWORD)
    MembershipFactory(organization=organization, user=user, role=Role.OWNER)
    endpoint = EndpointFactory(organization=organization, name="support-chat", min_replicas=1)
    Replica.objects.create(endpoint=endpoint, state=ReplicaState.STARTING, progress="Downloading weights",
                           progress_percent=40.0)
    started_at = timezone.now() - timedelta(minutes=5)
    UsageRecord.objects.create(
        request_id="cold-1", organization=organization, endpoint=endpoint, prompt_tokens=1, completion_tokens=1,
        cost=0, started_at=started_at, finished_at=started_at + timedelta(seconds=4), status="ok",
        cold_start_ms=4000, cold_start_phases={"queue": 1000, "download": 3000})

    page.goto("/login/")
    page.get_by_label("Email").fill("grace@example.test")
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Log in").click()
    expect(page.get_by_role("heading", name="Dashboard")).to_be_visible()

    page.goto(f"/console/endpoints/{endpoint.pk}/")
    progress = page.get_by_role("progressbar", name="Cold start of replica")
    expect(progress).to_be_visible()
    assert _bar_share(page, progress) == pytest.approx(0.40, abs=0.02)
    cold_start = page.locator(".cold-start-bar")
    queue, download = (page.evaluate("r => r.getBoundingClientRect().width", rect.element_handle())
                       for rect in (cold_start.locator("rect.phase-queue"), cold_start.locator("rect.phase-download")))
    whole = page.evaluate("e => e.getBoundingClientRect().width", cold_start.element_handle())
    assert (queue / whole, download / whole) == (pytest.approx(0.25, abs=0.02), pytest.approx(0.75, abs=0.02))

    page.goto("/console/endpoints/")
    expect(page.get_by_role("progressbar").first).to_be_visible()
