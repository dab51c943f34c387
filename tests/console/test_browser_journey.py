"""The console's whole journey in a real browser, on real processes: a live control plane, a Celery worker,
a CPU agent running vLLM on the tiny model, and the gateway the playground streams from.

sign up → create a key → deploy the tiny model through the wizard → READY → chat in the playground →
the usage page shows the tokens → a staff user drains the node.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django_otp.plugins.otp_totp.models import TOTPDevice

from billing.models import UsageRecord
from controlplane.accounts.models import Role
from controlplane.accounts.services import SYSTEM
from endpoints.fleet.services import create_join_token
from endpoints.models import Endpoint, Replica
from endpoints.nodes.models import Node
from gpu_agent.protocol import NodeState, ReplicaState
from tests.conftest import (
    REPO_ROOT,
    start_agent,
    start_celery_beat,
    start_celery_worker,
    start_web_server,
    wait_until,
)
from tests.console.conftest import screenshot
from tests.console.test_browser_pages import copy_new_secret, log_in_staff, nav, press_and_confirm, sign_up
from tests.factories import MembershipFactory, OrganizationFactory, UserFactory

NEEDED = [REPO_ROOT / "gpu_agent" / "runtime" / "cli.py"]
GATEWAY = [REPO_ROOT / "endpoints" / "gateway.py", REPO_ROOT / "endpoints" / "gateway"]

pytestmark = [
    pytest.mark.browser, pytest.mark.vllm, pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not all(path.exists() for path in NEEDED), reason="the agent runtime (gpu_agent/runtime/cli.py) is missing"),
    pytest.mark.skipif(not any(path.exists() for path in GATEWAY), reason="the inference gateway (endpoints/gateway) is missing"),
]

FAST = {"INFERPLANE_AGENT_HEARTBEAT_INTERVAL_S": "0.5", "INFERPLANE_AUTOSCALER_TICK_S": "1"}
NODE = "console-cpu-node"


@pytest.fixture
def platform(tmp_path):
    children = []
    web, base_url = start_web_server(tmp_path, extra_env=FAST)
    children.append(web)
    children.append(start_celery_worker(tmp_path, extra_env=FAST))
    children.append(start_celery_beat(tmp_path, extra_env=FAST))  # the autoscaler's tick, as in `make run`
    children.append(start_agent(tmp_path, base_url, create_join_token(SYSTEM, name="journey").plain, name=NODE))
    try:
        wait_until(lambda: Node.objects.filter(name=NODE, state=NodeState.READY).exists(), 90, message="the agent to register")
        yield base_url
    finally:
        for child in reversed(children):
            child.stop(timeout_s=60)


def test_sign_up_deploy_chat_see_usage_and_drain(browser, platform, tiny_model_dir):
    from playwright.sync_api import expect

    context = browser.new_context(base_url=platform, viewport={"width": 1280, "height": 900},
                                  permissions=["clipboard-read", "clipboard-write"])
    context.set_default_timeout(20_000)
    page = context.new_page()
    try:
        sign_up(page, "journey@example.test", "Journey Labs")

        nav(page, "API keys")
        page.get_by_label("Name").fill("journey")
        page.get_by_role("button", name="Create key").click()
        copy_new_secret(page)

        # Deploy: a first attempt without a model source is refused inline, the second deploys.
        page.goto("/console/endpoints/new/")
        page.get_by_label("Endpoint name").fill("tiny-chat")
        page.locator("label[for=gpu-cpu]").click()
        page.get_by_role("button", name="Deploy endpoint").click()
        expect(page.get_by_text("This field may not be blank.")).to_be_visible()
        page.get_by_label("Model source", exact=True).fill(str(Path(tiny_model_dir)))
        page.get_by_label("Minimum replicas").fill("1")
        page.get_by_label("Maximum replicas").fill("1")
        page.get_by_label("Max model length (tokens)").fill("512")
        page.get_by_label("Max sequences per batch").fill("8")
        page.get_by_role("button", name="Deploy endpoint").click()
        expect(page.get_by_role("heading", name="tiny-chat")).to_be_visible()
        endpoint = Endpoint.objects.get(name="tiny-chat")

        # The page follows the cold start live until the replica is READY.
        try:
            expect(page.locator("#endpoint-status .badge")).to_have_text("Ready", timeout=300_000)
        except AssertionError:
            endpoint.refresh_from_db()
            events = [event.message for event in endpoint.events.order_by("created_at")]
            replicas = list(endpoint.replicas.values_list("state", "failure_reason"))
            raise AssertionError(f"not READY: min_replicas={endpoint.min_replicas} status={endpoint.status_message!r} "
                                 f"events={events} replicas={replicas}") from None
        expect(page.get_by_test_id("replica-table")).to_contain_text(NODE)
        expect(page.get_by_test_id("event-log")).to_contain_text("READY after")

        # The playground streams a reply through the gateway as the signed-in user, with tokens and cost.
        page.get_by_label("Max tokens").fill("16")
        page.get_by_label("Message").fill("Tell me a story")
        page.get_by_role("button", name="Send").click()
        meta = page.locator(".chat-assistant .chat-meta")
        expect(meta).to_contain_text("completion tokens", timeout=120_000)
        assert page.locator(".chat-assistant .chat-text").inner_text().strip()
        assert "$" in meta.inner_text()
        screenshot(page, "journey-1-playground")

        row = wait_until(lambda: UsageRecord.objects.filter(endpoint=endpoint).first(), 30, message="the usage row")
        assert f"{row.prompt_tokens} prompt + {row.completion_tokens} completion tokens" in meta.inner_text()

        # A second tab switches the session to another organisation: this tab's playground (shown for Journey Labs)
        # then runs nothing, in neither (before: the call went to the other organisation, a 404 there or, on an
        # endpoint of the same name, run and billed there).
        other = OrganizationFactory(name="Other Labs")
        MembershipFactory(organization=other, user=get_user_model().objects.get(email="journey@example.test"))
        tab2 = context.new_page()
        tab2.goto("/console/")
        with tab2.expect_navigation():
            tab2.get_by_label("Organisation").select_option(label="Other Labs")
        page.get_by_label("Message").fill("And another")
        page.get_by_role("button", name="Send").click()
        refused = page.locator(".chat-assistant .chat-meta.error")
        expect(refused).to_contain_text("opened for another organisation")
        screenshot(page, "journey-1-playground-switched")
        assert UsageRecord.objects.count() == 1
        with tab2.expect_navigation():
            tab2.get_by_label("Organisation").select_option(label="Journey Labs")
        tab2.close()

        nav(page, "Usage")
        table = page.get_by_test_id("usage-table")
        expect(table).to_contain_text("tiny-chat")
        expect(table).to_contain_text(str(row.completion_tokens))
        screenshot(page, "journey-2-usage")
        page.get_by_role("button", name="Log out").click()

        # A staff user drains the node: its replica drains.
        staff = UserFactory(username="staff@example.test", is_staff=True)
        MembershipFactory(organization=endpoint.organization, user=staff, role=Role.VIEWER)
        log_in_staff(page, "staff@example.test", TOTPDevice.objects.create(user=staff, name="phone", confirmed=True))
        nav(page, "Fleet")
        card = page.get_by_test_id(f"node-{NODE}")
        expect(card).to_contain_text("tiny-chat")
        questions = press_and_confirm(page, card.get_by_role("button", name="Drain"))
        expect(page.get_by_text(f"Node {NODE} is draining")).to_be_visible()
        assert questions == [f"Drain {NODE}? Its replicas move to other nodes."]
        assert Node.objects.get(name=NODE).state == NodeState.DRAINING
        wait_until(lambda: not Replica.objects.filter(endpoint=endpoint, node__name=NODE, state=ReplicaState.READY).exists(),
                   30, message="the replica to leave READY")
        screenshot(page, "journey-3-fleet-drained")
    finally:
        context.close()
