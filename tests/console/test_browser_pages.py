"""Every console page in a real browser (Debian's chromium through Playwright) against a live ASGI server.

No engine is needed: endpoints are deployed but stay asleep; usage rows and a node are written to the
database the way the gateway and an agent would. Each page's screenshot lands in tests/artifacts/screenshots/.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from datetime import timedelta

import pytest
from django.utils import timezone
from django_otp.plugins.otp_totp.models import TOTPDevice

from billing.ledger import cost_of
from billing.models import UsageRecord
from controlplane.accounts.models import ApiKey, Role
from endpoints.models import Endpoint, EndpointEvent, EventKind, Replica
from endpoints.nodes.models import Node
from gpu_agent.protocol import NodeState, ReplicaState
from tests.console.conftest import screenshot
from tests.factories import (
    EndpointFactory,
    MembershipFactory,
    OrganizationFactory,
    UserFactory,
    enrolment_code_for,
    totp_code,
)

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

PASSWORD = "correct horse battery"


def expect(page):
    from playwright.sync_api import expect as playwright_expect

    return playwright_expect(page)


def sign_up(page, email: str, organization: str) -> None:
    page.goto("/")
    screenshot(page, "01-home")
    page.get_by_role("link", name="Create an account").click()
    page.get_by_label("Work email").fill(email)
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_label("Organisation name").fill(organization)
    screenshot(page, "02-signup")
    page.get_by_role("button", name="Create account").click()
    # Signing up signs nobody in: the answer is the same for an address that has an account.
    expect(page.get_by_role("heading", name="Check your email")).to_be_visible()
    log_in_unverified(page, email)
    # A new account sees nothing but the verify-email page until it follows the mailed link.
    expect(page.get_by_role("heading", name="Verify your email")).to_be_visible()
    screenshot(page, "02-verify-email")
    page.goto(verification_path(email))
    expect(page.get_by_role("heading", name="Dashboard")).to_be_visible()


def verification_path(email: str) -> str:
    """The path of the link the sign-up mailed (the live server's outbox is in its own process)."""
    from django.contrib.auth import get_user_model
    from django.urls import reverse

    from controlplane.accounts.signup import email_verification_token

    return reverse("verify-email-confirm", args=[email_verification_token(get_user_model().objects.get(email=email))])


def nav(page, name: str) -> None:
    page.get_by_role("navigation", name="Main").get_by_role("link", name=name, exact=True).click()


def scripts_ran(page) -> None:
    """Wait until the page's deferred scripts (htmx, app.js, the page's own) have run.

    NOTE: what only a script makes work (`data-copy`, `data-confirm`, `hx-*`, the playground) does nothing
    when pressed before (CI saw a Copy pressed before app.js on a loaded machine). Call it once something of
    the new page was seen: until the new page arrives, this is the old page's load state.
    """
    page.wait_for_load_state("load")


def copy_new_secret(page) -> str:
    """Press the new key page's Copy button; return the secret once the clipboard holds it."""
    secret = page.get_by_test_id("new-secret").input_value()
    scripts_ran(page)
    page.get_by_role("button", name="Copy").click()
    expect(page.get_by_role("button", name="Copied")).to_be_visible()  # the clipboard's write is done
    assert page.evaluate("navigator.clipboard.readText()") == secret
    return secret


def press_and_confirm(page, button) -> list[str]:
    """Press a button whose form asks first (app.js's `data-confirm`), accept, and return what was asked."""
    questions = []

    def accept(dialog):
        questions.append(dialog.message)
        dialog.accept()

    scripts_ran(page)
    page.once("dialog", accept)
    button.click()
    return questions


@contextmanager
def late_responses(page, url: str, delay_ms: int):
    """The page's requests for `url` (a glob) made inside the block answered `delay_ms` late, as on a loaded
    machine."""
    held = []

    def hold(route):
        held.append(route)
        try:
            page.wait_for_timeout(delay_ms)  # NOTE: Playwright runs each route handler on its own greenlet
            route.continue_()
        finally:
            held.remove(route)

    page.route(url, hold)
    try:
        yield
    finally:
        # NOTE: unrouting during a hold fails its `continue_` ("Route is already handled") in whatever the test
        # does next: the block ends once every request it held was answered.
        while held:
            page.wait_for_timeout(50)
        page.unroute(url, hold)


def late_scripts(page, delay_ms: int):
    """This page's own scripts (app.js, htmx) answered `delay_ms` late."""
    return late_responses(page, "**/static/**/*.js", delay_ms)


def log_in_unverified(page, email: str) -> None:
    page.goto("/login/")
    page.get_by_label("Email").fill(email)
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Log in").click()


def log_in(page, email: str) -> None:
    page.goto("/login/")
    page.get_by_label("Email").fill(email)
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Log in").click()
    expect(page.get_by_role("heading", name="Dashboard")).to_be_visible()


def log_in_staff(page, email: str, device) -> None:
    """Staff sign in: the password, then a code from their authenticator (`device`) on the code page."""
    page.goto("/login/")
    page.get_by_label("Email").fill(email)
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Log in").click()
    expect(page.get_by_role("heading", name="Enter your code")).to_be_visible()
    page.get_by_label("Code").fill(totp_code(device))
    page.get_by_role("button", name="Verify").click()
    expect(page.get_by_role("heading", name="Dashboard")).to_be_visible()


def record_usage(endpoint: Endpoint, *, minutes_ago: float, prompt: int, completion: int, latency_ms: int) -> None:
    started_at = timezone.now() - timedelta(minutes=minutes_ago)
    UsageRecord.objects.create(
        request_id=f"browser-{endpoint.pk}-{minutes_ago}", organization=endpoint.organization, endpoint=endpoint,
        prompt_tokens=prompt, completion_tokens=completion, cost=cost_of(endpoint, prompt, 0, completion), started_at=started_at,
        first_token_at=started_at + timedelta(milliseconds=latency_ms // 4),
        finished_at=started_at + timedelta(milliseconds=latency_ms), status="ok",
    )


def test_a_customer_signs_up_creates_a_key_deploys_and_reads_every_page(page):
    sign_up(page, "ada@example.test", "Analytical Engines")
    expect(page.get_by_text("Deploy your first model")).to_be_visible()
    screenshot(page, "03-dashboard-empty")

    # An API key: the secret is shown once and the copy button puts it on the clipboard.
    nav(page, "API keys")
    page.get_by_label("Name").fill("staging chatbot")
    page.get_by_label("Expires").select_option("90")
    # The key page's scripts arrive late (a loaded machine): the copy still works.
    with late_scripts(page, delay_ms=1_500):
        page.get_by_role("button", name="Create key").click()
        secret = copy_new_secret(page)
    assert secret.startswith("ip_")
    screenshot(page, "04-key-created")
    page.get_by_role("link", name="Done, back to keys").click()
    expect(page.get_by_test_id("key-table")).to_contain_text("staging chatbot")
    expect(page.get_by_test_id("key-table")).not_to_contain_text(secret)
    assert ApiKey.objects.get(name="staging chatbot").expires_at is not None

    # The deploy wizard: an invalid spec shows the serializer's errors inline, then a valid one deploys.
    nav(page, "Endpoints")
    page.get_by_role("link", name="New endpoint").first.click()
    expect(page.get_by_role("heading", name="New endpoint")).to_be_visible()
    scripts_ran(page)  # htmx swaps in the quantizations of the GPU picked
    page.get_by_label("Endpoint name").fill("Support Chat")
    page.get_by_label("Model source", exact=True).fill("github.com/some/model")
    page.locator("label[for=gpu-cpu]").click()
    expect(page.locator("#gpu-cpu")).to_be_checked()
    # htmx swaps in the quantizations a CPU engine supports.
    expect(page.locator("#id_quantization option[value=fp8_per_channel]")).to_have_count(1)
    expect(page.locator("#id_quantization option[value=awq]")).to_have_count(0)
    page.get_by_label("Maximum replicas").fill("0")
    # The refused spec's page has its scripts late (a loaded machine): a GPU picked there still swaps in its
    # quantizations.
    with late_scripts(page, delay_ms=1_500):
        page.get_by_role("button", name="Deploy endpoint").click()
        expect(page.get_by_test_id("form-errors")).to_be_visible()
        scripts_ran(page)
        page.locator("label[for=gpu-l4]").click()
        expect(page.locator("#id_quantization option[value=awq]")).to_have_count(1)
    expect(page.get_by_text("Must start with hf:, s3:// or / (a local path).")).to_be_visible()
    expect(page.get_by_text("Ensure this value is greater than or equal to 1.")).to_be_visible()
    screenshot(page, "05-wizard-errors")
    assert not Endpoint.objects.exists()

    page.get_by_label("Endpoint name").fill("support-chat")
    page.get_by_label("Model source", exact=True).fill("hf:meta-llama/Llama-3.1-8B-Instruct")
    page.get_by_label("Quantization").select_option("fp8")
    page.get_by_label("Maximum replicas").fill("3")
    page.get_by_label("Idle timeout (seconds)").fill("600")
    screenshot(page, "06-wizard-filled")
    page.get_by_role("button", name="Deploy endpoint").click()
    expect(page.get_by_role("heading", name="support-chat")).to_be_visible()
    endpoint = Endpoint.objects.get(name="support-chat")
    assert (endpoint.gpu_type, endpoint.quantization, endpoint.max_replicas, endpoint.idle_timeout_s) == ("l4", "fp8", 3, 600)

    # What a running endpoint looks like: traffic, a READY replica and one cold-starting, events.
    node = Node.objects.create(name="gpu-l4-a", gpu_type="l4", num_gpus=1, gpu_memory_mb=24000,
                               secret_lookup="browser-a", secret_digest="x", last_heartbeat_at=timezone.now())
    Replica.objects.create(endpoint=endpoint, node=node, state=ReplicaState.READY, num_running=3, tokens_per_s=41.5,
                           created_at=timezone.now() - timedelta(minutes=50), ready_at=timezone.now() - timedelta(minutes=49))
    Replica.objects.create(endpoint=endpoint, node=node, state=ReplicaState.STARTING,
                           progress="downloading weights", progress_percent=64)
    EndpointEvent.objects.create(endpoint=endpoint, kind=EventKind.SCALE, message="Scaling 1 → 2 replicas: 19 in flight, target 8")
    EndpointEvent.objects.create(endpoint=endpoint, kind=EventKind.COLD_START, message="Replica 1a2b3c4d READY after 38.2 s")
    for minute in range(1, 45):
        for request in range(1 + minute % 4):
            record_usage(endpoint, minutes_ago=minute + request / 10, prompt=400 + 10 * minute, completion=600 + 40 * request,
                         latency_ms=700 + 300 * request + 5 * minute)
    # The charts' metrics answer late (a loaded machine): they are still drawn.
    with late_responses(page, "**/metrics.json?*", delay_ms=7_000):
        page.reload()
        expect(page.locator("#endpoint-status")).to_contain_text("Ready")
        expect(page.get_by_text("downloading weights").first).to_be_visible()
        expect(page.get_by_test_id("event-log")).to_contain_text("READY after 38.2 s")
        expect(page.locator("#snippet-python")).to_contain_text('model="support-chat"')
        expect(page.locator("[data-chart=latency] canvas")).to_have_count(1)
    screenshot(page, "07-endpoint")

    # The live part follows the database without a reload (htmx polling).
    Replica.objects.filter(state=ReplicaState.STARTING).update(state=ReplicaState.FAILED, failure_reason="CUDA out of memory")
    # NOTE: htmx polls every 3 s, and a loaded server takes seconds to answer each poll.
    expect(page.get_by_test_id("replica-table")).to_contain_text("Failed", timeout=30_000)

    page.get_by_role("link", name="Edit").click()
    expect(page.get_by_label("Maximum replicas")).to_have_value("3")
    page.get_by_role("link", name="Cancel").click()

    nav(page, "Dashboard")
    expect(page.get_by_test_id("endpoint-table")).to_contain_text("support-chat")
    expect(page.get_by_test_id("requests-today")).not_to_have_text("0")
    screenshot(page, "08-dashboard")

    nav(page, "Usage")
    expect(page.get_by_test_id("usage-table")).to_contain_text("support-chat")
    expect(page.locator("[data-usage-chart] canvas")).to_have_count(1)
    screenshot(page, "09-usage")

    nav(page, "Billing")
    page.get_by_label("Monthly cap (USD)").fill("abc")
    page.get_by_role("button", name="Save cap").click()
    expect(page.get_by_text("A valid number is required.")).to_be_visible()
    page.get_by_label("Monthly cap (USD)").fill("50")
    page.get_by_role("button", name="Save cap").click()
    expect(page.get_by_text("Monthly spend cap set to $50.00.")).to_be_visible()
    expect(page.get_by_test_id("period-spend")).to_contain_text("of $50.00 cap")
    screenshot(page, "10-billing")

    nav(page, "Members")
    expect(page.get_by_test_id("member-table")).to_contain_text("ada@example.test")
    screenshot(page, "11-members")

    page.set_viewport_size({"width": 390, "height": 844})
    nav(page, "Dashboard")
    screenshot(page, "12-dashboard-phone")
    page.goto(f"/console/endpoints/{endpoint.pk}/")
    screenshot(page, "13-endpoint-phone")


def test_staff_cordon_and_drain_a_node(page):
    organization = OrganizationFactory(name="Platform team")
    staff = UserFactory(username="ops@example.test", is_staff=True)
    MembershipFactory(organization=organization, user=staff, role=Role.OWNER)
    node = Node.objects.create(
        name="gpu-h100-07", gpu_type="h100-80gb", num_gpus=2, gpu_memory_mb=81559, num_cpus=64, memory_mb=512000,
        secret_lookup="browser-b", secret_digest="x", last_heartbeat_at=timezone.now(), engine_version="0.11.0",
        last_status={
            "gpus": [{"index": i, "name": "NVIDIA H100 80GB HBM3", "utilization_percent": u, "memory_used_mb": m,
                      "memory_total_mb": 81559, "temperature_c": 58 + i} for i, (u, m) in enumerate([(87, 61000), (12, 9000)])],
            "cpu_percent": 31.0, "memory_used_mb": 120000, "memory_mb": 512000,
            "weights": [{"source": "hf:meta-llama/Llama-3.1-70B-Instruct", "cache_key": "k1", "size_bytes": 141_000_000_000,
                         "downloaded_bytes": 141_000_000_000, "complete": True}],
        },
    )
    replica = Replica.objects.create(endpoint=EndpointFactory(organization=organization, name="big-model"), node=node,
                                     state=ReplicaState.READY)
    log_in_staff(page, "ops@example.test", TOTPDevice.objects.create(user=staff, name="phone", confirmed=True))
    nav(page, "Fleet")
    card = page.get_by_test_id("node-gpu-h100-07")
    expect(card).to_contain_text("NVIDIA H100 80GB HBM3")
    expect(card).to_contain_text("big-model")
    screenshot(page, "14-fleet")

    # The fleet page's scripts arrive late (a loaded machine): Drain still asks first.
    with late_scripts(page, delay_ms=1_500):
        card.get_by_role("button", name="Cordon").click()
        expect(page.get_by_text("Node gpu-h100-07 is cordoned")).to_be_visible()
        node.refresh_from_db()
        assert node.state == NodeState.CORDONED
        questions = press_and_confirm(page, card.get_by_role("button", name="Drain"))
    expect(page.get_by_text("Node gpu-h100-07 is draining")).to_be_visible()
    assert questions == ["Drain gpu-h100-07? Its replicas move to other nodes."]
    node.refresh_from_db()
    replica.refresh_from_db()
    assert node.state == NodeState.DRAINING and replica.state == ReplicaState.DRAINING

    page.get_by_label("Name").fill("rack 7")
    page.get_by_role("button", name="Create join token").click()
    token = page.get_by_test_id("new-secret").input_value()
    assert re.match(r"^jt_", token)
    screenshot(page, "15-join-token")
    page.get_by_role("link", name="Back to the fleet").click()
    expect(page.get_by_role("heading", name="Audit log")).to_be_visible()
    expect(page.locator(".events")).to_contain_text("node.draining")
    screenshot(page, "16-fleet-after")


def test_a_new_staff_member_enrols_with_an_operators_code_and_signs_in_later_with_a_recovery_code(page):
    staff = UserFactory(username="new-ops@example.test", is_staff=True)
    MembershipFactory(organization=OrganizationFactory(name="Platform team"), user=staff, role=Role.OWNER)
    enrolment_code = enrolment_code_for(staff)  # what the operator's `reset_staff_second_factor` printed

    page.goto("/login/")
    page.get_by_label("Email").fill("new-ops@example.test")
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Log in").click()
    expect(page.get_by_role("heading", name="Your enrolment code")).to_be_visible()
    screenshot(page, "staff-01-enrolment-code")
    page.get_by_label("Enrolment code").fill(enrolment_code)
    page.get_by_role("button", name="Continue").click()
    expect(page.get_by_role("heading", name="Set up your authenticator")).to_be_visible()
    device = TOTPDevice.objects.get(user=staff, confirmed=False)
    page.get_by_label("Code from the app").fill(totp_code(device))
    page.get_by_role("button", name="Confirm").click()

    expect(page.get_by_role("heading", name="Recovery codes")).to_be_visible()
    codes = page.get_by_test_id("recovery-codes").locator("li code").all_inner_texts()
    assert len(set(codes)) == 10
    screenshot(page, "staff-02-recovery-codes")
    page.get_by_role("link", name="I copied them, continue").click()
    expect(page.get_by_role("heading", name="Dashboard")).to_be_visible()
    page.get_by_role("button", name="Log out").click()

    page.goto("/login/")
    page.get_by_label("Email").fill("new-ops@example.test")
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Log in").click()
    page.get_by_label("Code").fill(codes[0])
    page.get_by_role("button", name="Verify").click()
    expect(page.get_by_role("heading", name="Dashboard")).to_be_visible()
    expect(page.get_by_text("You signed in with a recovery code, which no longer works; 9 left.")).to_be_visible()
    nav(page, "Fleet")
