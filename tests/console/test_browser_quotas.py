"""Quotas and key limits in a real browser: what a customer sees of the abuse limits (screenshots in
tests/artifacts/screenshots/)."""

from __future__ import annotations

import pytest

from controlplane.accounts.keys import create_api_key
from controlplane.accounts.models import Plan, Role, Scope
from controlplane.accounts.services import SYSTEM, Actor, save_plan, set_organization_plan
from endpoints.models import Replica
from tests.console.conftest import screenshot
from tests.console.test_browser_pages import PASSWORD, expect, log_in, nav
from tests.factories import EndpointFactory, MembershipFactory, OrganizationFactory, UserFactory

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_a_customer_sees_quotas_their_use_key_limits_and_a_refused_spec(page):
    organization = OrganizationFactory(name="Analytical Engines")
    user = UserFactory(username="ada@example.test", password=PASSWORD)
    MembershipFactory(organization=organization, user=user, role=Role.OWNER)
    set_organization_plan(SYSTEM, organization, save_plan(SYSTEM, Plan(
        name="starter", max_endpoints=3, max_replicas=2, max_min_replicas=1, max_gpus_by_type={"h100-80gb": 0})))
    endpoint = EndpointFactory(organization=organization, name="support-chat", min_replicas=1)
    Replica.objects.create(endpoint=endpoint)
    create_api_key(Actor(user=user), organization, name="batch job", scopes=[Scope.INFERENCE], requests_per_minute=60)

    log_in(page, "ada@example.test")
    nav(page, "Endpoints")
    quotas = page.get_by_test_id("quotas")
    expect(quotas).to_contain_text("starter")
    expect(quotas).to_contain_text("Replicas kept warm (min_replicas and pre-warm windows)")
    screenshot(page, "abuse-01-quotas")

    nav(page, "API keys")
    expect(page.get_by_test_id("key-table")).to_contain_text("60 requests/min")
    expect(page.get_by_test_id("key-table")).to_contain_text("(platform default)")
    screenshot(page, "abuse-02-key-limits")

    nav(page, "Endpoints")
    page.get_by_role("link", name="New endpoint").click()
    page.get_by_label("Endpoint name").fill("second-chat")
    page.get_by_label("Model source", exact=True).fill("hf:meta-llama/Llama-3.1-8B-Instruct")
    page.get_by_label("Minimum replicas").fill("1")
    page.get_by_role("button", name="Deploy endpoint").click()
    expect(page.get_by_text("quota max_min_replicas")).to_be_visible()
    screenshot(page, "abuse-03-wizard-quota")
