"""Refusals of the Files and Batch APIs that a retry within seconds cannot change tell the official `openai` client
not to retry them (`x-should-retry: false`): it retries every 409 and 429 by itself (twice by default), as it would a
lock timeout or a rate limit. A 409 that a retry does settle (`idempotency_key_in_use`) still invites one."""

from __future__ import annotations

import io
import json

import openai
import pytest

from endpoints.batches.models import Batch
from tests.gateway.conftest import counting_openai_client, serve_endpoint

pytestmark = pytest.mark.django_db(transaction=True)


def _batch_input(model: str) -> io.BytesIO:
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": "hi"}]}}
    return io.BytesIO(json.dumps(line).encode() + b"\n")


def test_deleting_the_input_of_an_open_batch_is_refused_once_not_three_times(gateway, tenant, start_mock_upstream,
                                                                             monkeypatch):
    # Before: the 409 `file_in_use` was sent 3 times, the client sleeping between, then raised.
    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    client, sent, slept = counting_openai_client(f"{gateway}/v1", tenant.key, monkeypatch)
    input_file = client.files.create(file=("in.jsonl", _batch_input(endpoint.name)), purpose="batch")
    client.batches.create(input_file_id=input_file.id, endpoint="/v1/chat/completions", completion_window="24h")
    del sent[:]

    with pytest.raises(openai.ConflictError) as refused:
        client.files.delete(input_file.id)
    assert refused.value.code == "file_in_use"
    assert (len(sent), slept) == (1, [])


def test_a_batch_past_the_organisations_cap_of_open_batches_is_refused_once_not_three_times(
        gateway, tenant, start_mock_upstream, monkeypatch):
    # Before: the 429 `batch_limit_reached` (no `retry-after`) was sent 3 times, the client sleeping between, then
    # raised: it is settled when batches end, in minutes or hours.
    from django.conf import settings

    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    client, sent, slept = counting_openai_client(f"{gateway}/v1", tenant.key, monkeypatch)
    input_file = client.files.create(file=("in.jsonl", _batch_input(endpoint.name)), purpose="batch")
    first = client.batches.create(input_file_id=input_file.id, endpoint="/v1/chat/completions", completion_window="24h")
    template = Batch.objects.get(pk=first.id)
    Batch.objects.bulk_create(
        Batch(organization_id=template.organization_id, request_path=template.request_path,
              input_file_id=template.input_file_id, completion_window=template.completion_window,
              expires_at=template.expires_at) for _ in range(settings.BATCH_MAX_OPEN_PER_ORG - 1))
    del sent[:]

    with pytest.raises(openai.RateLimitError) as refused:
        client.batches.create(input_file_id=input_file.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert refused.value.code == "batch_limit_reached"
    assert (len(sent), slept) == (1, [])
