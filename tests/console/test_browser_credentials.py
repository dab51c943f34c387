"""The Credentials page in a real browser: a secret typed once is never on any page again, and the
wizard offers the credential for a private source."""

from __future__ import annotations

import pytest

from endpoints.models import Endpoint, ModelCredential
from tests.console.conftest import screenshot
from tests.console.test_browser_pages import expect, nav, sign_up

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYzBROWSERKEY"


def test_an_owner_adds_a_bucket_credential_and_deploys_a_private_model_with_it(page):
    sign_up(page, "grace@example.test", "Compilers Inc")
    nav(page, "Credentials")
    expect(page.get_by_text("No credentials yet")).to_be_visible()
    page.get_by_label("Name", exact=True).fill("prod-bucket")
    page.get_by_label("Kind").select_option("s3")
    page.get_by_label("Access key id").fill("AKIAEXAMPLEBROWSER01")
    page.get_by_label("Secret access key").fill(SECRET)
    page.get_by_label("Region").fill("eu-west-1")
    page.get_by_role("button", name="Save credential").click()
    expect(page.get_by_test_id("secret-set")).to_have_text("secret_access_key set")
    credential = ModelCredential.objects.get(name="prod-bucket")
    expect(page.get_by_test_id("external-id")).to_have_text(credential.external_id)
    assert SECRET not in page.content()
    assert page.get_by_label("Secret access key").input_value() == ""
    screenshot(page, "20-credential")

    nav(page, "Credentials")
    expect(page.get_by_test_id("credential-table")).to_contain_text("AKIAEXAMPLEBROWSER01")
    assert SECRET not in page.content()
    screenshot(page, "21-credentials")

    nav(page, "Endpoints")
    page.get_by_role("link", name="New endpoint").first.click()
    page.get_by_label("Endpoint name").fill("private-llama")
    page.get_by_label("Model source", exact=True).fill("s3://compilers-weights/llama-3.1-8b")
    page.get_by_label("Credential").select_option(label="prod-bucket (s3)")
    page.locator("label[for=gpu-l4]").click()
    page.get_by_role("button", name="Deploy endpoint").click()
    expect(page.get_by_role("heading", name="private-llama")).to_be_visible()
    expect(page.get_by_text("credential prod-bucket")).to_be_visible()
    assert Endpoint.objects.get(name="private-llama").credential == credential
