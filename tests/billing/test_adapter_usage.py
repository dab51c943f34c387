"""Usage per LoRA adapter: rows name the adapter a call named, are priced at the adapter's own
prices where it has them (the endpoint's otherwise), and the usage API and CSV break down by adapter."""

import csv
import dataclasses
import io
from datetime import datetime
from decimal import Decimal

import pytest
from django.utils import timezone

from billing.ledger import cost_of, record_usage
from billing.models import UsageRecord
from endpoints.gateway.directory import AdapterInfo, _endpoint_info
from endpoints.models import Adapter
from tests.billing.conftest import usage_report as base_report
from tests.factories import EndpointFactory

pytestmark = pytest.mark.django_db

def usage_report(endpoint, *, adapter: str = "", **values):
    return dataclasses.replace(base_report(endpoint, **values), adapter=adapter)


MARCH = datetime(2026, 3, 2, 12, tzinfo=timezone.get_current_timezone())


@pytest.fixture
def llama(owner_client):
    endpoint = EndpointFactory(organization=owner_client.organization, name="llama", max_loras=2,
                               price_input_per_million=Decimal("1"), price_cached_input_per_million=Decimal("0.5"),
                               price_output_per_million=Decimal("2"))
    Adapter.objects.create(endpoint=endpoint, name="legal", source="/a/legal",
                           price_input_per_million=Decimal("3"), price_output_per_million=Decimal("6"))
    Adapter.objects.create(endpoint=endpoint, name="plain", source="/a/plain")  # no prices: the endpoint's
    return endpoint


def test_an_adapter_with_its_own_prices_is_billed_at_them_and_one_without_at_the_endpoints(llama):
    record_usage(usage_report(llama, finished_at=MARCH, prompt_tokens=1000, completion_tokens=100, adapter="legal"))
    record_usage(usage_report(llama, finished_at=MARCH, prompt_tokens=1000, completion_tokens=100, adapter="plain"))
    record_usage(usage_report(llama, finished_at=MARCH, prompt_tokens=1000, completion_tokens=100))
    costs = dict(UsageRecord.objects.values_list("adapter", "cost"))
    assert costs["legal"] == Decimal("0.0036")  # 1000 × $3 + 100 × $6 per million
    assert costs["plain"] == costs[""] == Decimal("0.0012")


def test_the_gateways_reservation_prices_an_adapter_as_the_ledger_does(llama):
    legal = Adapter.objects.get(name="legal")
    priced = AdapterInfo(str(legal.pk), "legal", legal.price_input_per_million, legal.price_output_per_million).priced(
        _endpoint_info(llama))
    record_usage(usage_report(llama, finished_at=MARCH, prompt_tokens=900, cached_tokens=300, completion_tokens=50,
                              adapter="legal"))
    assert UsageRecord.objects.get().cost == cost_of(priced, 900, 300, 50)


def test_usage_api_and_csv_break_down_by_adapter(owner_client, llama):
    record_usage(usage_report(llama, finished_at=MARCH, prompt_tokens=10, completion_tokens=1, adapter="legal"))
    record_usage(usage_report(llama, finished_at=MARCH, prompt_tokens=20, completion_tokens=2))
    params = {"start": "2026-03-01", "end": "2026-03-31", "group_by": "adapter"}
    rows = owner_client.get("/api/v1/usage/", params).json()["results"]
    assert [(row["adapter"], row["prompt_tokens"]) for row in rows] == [("llama", 20), ("llama:legal", 10)]
    exported = owner_client.get("/api/v1/usage/export.csv", params).content.decode()
    assert [row[0] for row in csv.reader(io.StringIO(exported))] == ["adapter", "llama", "llama:legal"]
