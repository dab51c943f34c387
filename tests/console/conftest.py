"""Console fixtures: Django test clients signed in with a role; a headless chromium for browser tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from django.test import Client

from controlplane.accounts.models import Role
from controlplane.accounts.tenancy import SESSION_KEY
from tests.conftest import ARTIFACTS_DIR
from tests.factories import (
    EndpointFactory,
    MembershipFactory,
    OrganizationFactory,
    UserFactory,
    sign_in_staff,
)


@pytest.fixture
def console_client_factory(db):
    """A Django test client logged in as a new user holding `role` in `organization` (staff: with their code)."""

    def make(organization, role=Role.OWNER, *, is_staff=False):
        user = UserFactory(is_staff=is_staff)
        MembershipFactory(organization=organization, user=user, role=role)
        client = Client()
        if is_staff:
            sign_in_staff(client, user)
        else:
            client.force_login(user)
        session = client.session
        session[SESSION_KEY] = organization.pk
        session.save()
        client.user, client.organization = user, organization
        return client

    return make


@pytest.fixture
def owner(org, console_client_factory):
    return console_client_factory(org, Role.OWNER)


@pytest.fixture
def viewer(org, console_client_factory):
    return console_client_factory(org, Role.VIEWER)


@pytest.fixture
def other_endpoint(db):
    """An endpoint of another organisation: every console URL for it must be a 404."""
    return EndpointFactory(organization=OrganizationFactory(), name="theirs")


# --- browser ------------------------------------------------------------------------------------

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-background-networking", "--disable-gpu",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
SCREENSHOTS_DIR = ARTIFACTS_DIR / "screenshots"
# NOTE: how long an action or an `expect` waits. Playwright's `expect` waits 5 s by default, which a server's
# answer or a page's deferred scripts can take on CI's loaded machine; a wait that passes returns at once.
BROWSER_TIMEOUT_MS = 15_000


@pytest.fixture(scope="module")
def browser():
    """One headless Debian chromium per browser-test module, driven by Playwright.

    NOTE: module scope, not session: Playwright's sync API keeps an event loop running in
    this thread until it stops, and later tests calling async views through Django's test
    client would find that loop and fail.
    """
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing (tests/run.sh installs Debian's chromium package)")
    sync_api.expect.set_options(timeout=BROWSER_TIMEOUT_MS)
    # NOTE: Playwright's sync API runs an event loop in this thread; the test's own ORM calls
    # (fixtures, assertions) are still plain synchronous code, so Django may allow them.
    previous = os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    try:
        with sync_api.sync_playwright() as playwright:
            chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
            yield chromium
            chromium.close()
    finally:
        if previous is None:
            os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
        else:
            os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = previous


@pytest.fixture
def page(browser, live_server_url):
    context = browser.new_context(base_url=live_server_url, viewport={"width": 1280, "height": 900},
                                  permissions=["clipboard-read", "clipboard-write"])
    context.set_default_timeout(BROWSER_TIMEOUT_MS)
    page = context.new_page()
    script_errors = []
    page.on("pageerror", lambda error: script_errors.append(str(error)))
    # A 4xx answer (a form with errors) is logged as a failed resource load: that is no script error.
    page.on("console", lambda message: message.type == "error" and not message.text.startswith("Failed to load resource")
            and script_errors.append(message.text))
    yield page
    context.close()
    assert not script_errors, f"the page logged script errors: {script_errors}"


def screenshot(page, name: str) -> Path:
    SCREENSHOTS_DIR.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS_DIR / f"{name}.png"
    page.evaluate("window.scrollTo(0, 0)")  # a sticky header would otherwise be drawn mid-page
    page.screenshot(path=str(path), full_page=True)
    return path
