"""Usage by key (the console's page and chart, `/api/v1/usage/?group_by=key`, its CSV) names each key as the keys page
does: a name stored before the name rule (`controlplane.text.name_problem`) with its direction override escaped
(`text.shown_name`), never reordered into another key's name."""

import csv
import io
import json
import re

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from billing.ledger import record_usage
from controlplane.accounts.models import ApiKey
from tests.billing.conftest import usage_report
from tests.factories import EndpointFactory

pytestmark = pytest.mark.django_db

SPOOFED = "\u202eyek-dorp"  # reads "prod-key"


@pytest.fixture
def spoofed_usage(owner_client):
    key = ApiKey.objects.get(created_by=owner_client.user)
    ApiKey.objects.filter(pk=key.pk).update(name=SPOOFED)
    record_usage(usage_report(EndpointFactory(organization=owner_client.organization), api_key=key))
    return key


def _range() -> dict:
    today = timezone.now().date().isoformat()
    return {"group_by": "key", "start": today, "end": today}


def test_the_usage_api_names_a_key_from_before_the_rule_escaped(owner_client, spoofed_usage):
    [row] = owner_client.get("/api/v1/usage/", _range()).json()["results"]
    assert row["key_name"] == "\\u202eyek-dorp"


def test_the_usage_csv_names_a_key_from_before_the_rule_escaped(owner_client, spoofed_usage):
    response = owner_client.get("/api/v1/usage/export.csv", _range())
    [row] = list(csv.DictReader(io.StringIO(response.content.decode())))
    assert row["key_name"] == "\\u202eyek-dorp"


def test_the_usage_page_and_its_chart_name_a_key_from_before_the_rule_escaped(owner_client, spoofed_usage):
    console = Client()
    console.force_login(owner_client.user)
    page = console.get(reverse("console:usage"), _range()).content.decode()
    assert "\\u202eyek-dorp" in page and "\u202e" not in page
    chart = json.loads(re.search(r'<script id="usage-chart-data" type="application/json">(.*?)</script>', page).group(1))
    assert list(chart["series"]) == ["\\u202eyek-dorp"]  # the chart's legend, set by its script
