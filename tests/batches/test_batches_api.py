"""The Batch API with the official `openai` client against mock engines: a batch runs to an output file
in OpenAI's format, billed once per line at the batch price; malformed input fails with per-line
errors and runs nothing; cancel keeps what finished; another organisation's batch is a 404; batch
work never wakes a sleeping endpoint."""

from __future__ import annotations

import io
import json
from decimal import Decimal

import openai
import pytest

from billing.ledger import cost_of
from billing.models import UsageRecord
from endpoints.batches.models import Batch
from endpoints.models import EndpointEvent, EventKind
from tests.batches.conftest import bucket_objects
from tests.batches.test_files_api import _other_tenant_client
from tests.conftest import wait_until
from tests.gateway.conftest import serve_endpoint

pytestmark = pytest.mark.django_db(transaction=True)

FINAL = {"completed", "failed", "expired", "cancelled"}


def _jsonl(rows) -> io.BytesIO:
    return io.BytesIO(b"".join(json.dumps(row).encode() + b"\n" for row in rows))


def _chat_line(custom_id: str, model: str, max_tokens: int = 3) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": f"say {custom_id}"}], "max_tokens": max_tokens}}


def _wait_for(client, batch_id: str, statuses=FINAL, timeout_s: float = 180):
    found = {}

    def reached():
        found["batch"] = client.batches.retrieve(batch_id)
        return found["batch"].status in statuses

    wait_until(reached, timeout_s, interval_s=0.1, message=f"batch {batch_id} to reach {statuses}")
    return found["batch"]


def test_a_batch_completes_with_openais_output_file_billed_once_per_line_at_the_batch_price(
        gateway, tenant, batch_worker, start_mock_upstream, files_bucket):
    endpoint = serve_endpoint(tenant.org, start_mock_upstream(), target_concurrency=4)
    client = tenant.client(gateway)
    rows = [_chat_line(f"line-{i}", endpoint.name) for i in range(12)] + [_chat_line("too-long", endpoint.name, 5000)]
    input_file = client.files.create(file=("in.jsonl", _jsonl(rows)), purpose="batch")
    batch = client.batches.create(input_file_id=input_file.id, endpoint="/v1/chat/completions", completion_window="24h",
                                  metadata={"job": "nightly"})
    assert batch.status == "validating" and batch.metadata == {"job": "nightly"}

    batch = _wait_for(client, batch.id)
    assert batch.status == "completed"
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (13, 12, 1)
    output = [json.loads(line) for line in client.files.content(batch.output_file_id).read().splitlines()]
    assert sorted(row["custom_id"] for row in output) == sorted(f"line-{i}" for i in range(12))
    for row in output:
        assert row["error"] is None and row["response"]["status_code"] == 200
        assert row["response"]["body"]["choices"][0]["message"]["content"] == "tok tok tok"
        assert row["response"]["request_id"].startswith(batch.id)
    errors = [json.loads(line) for line in client.files.content(batch.error_file_id).read().splitlines()]
    assert [(row["custom_id"], row["response"]["status_code"]) for row in errors] == [("too-long", 400)]
    # The line results were only kept until the output and error files held them.
    assert [key for key in bucket_objects(files_bucket) if "/lines/" in key] == []

    # One usage row per line that ran, each carrying the batch id, priced at half the interactive price.
    rows = UsageRecord.objects.filter(organization=tenant.org)
    assert rows.count() == 12 and set(rows.values_list("batch_id", flat=True)) == {batch.id}
    assert len(set(rows.values_list("request_id", flat=True))) == 12
    for row in rows:
        full = cost_of(endpoint, row.prompt_tokens, row.cached_tokens, row.completion_tokens)
        assert row.cost == (full * Decimal("0.5")).quantize(Decimal("0.000000001")) and row.cost > 0
    assert [b.id for b in client.batches.list()] == [batch.id]
    # The scheduling decision is in the endpoint's event log.
    assert EndpointEvent.objects.filter(endpoint=endpoint, kind=EventKind.BATCH, message__contains="spare slots").exists()


def test_a_batch_with_malformed_lines_fails_with_an_error_per_line_and_runs_nothing(
        gateway, tenant, batch_worker, start_mock_upstream):
    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    client = tenant.client(gateway)
    good = _chat_line("ok", endpoint.name)
    lines = (json.dumps(good) + "\n" + "{not json\n" + json.dumps(good) + "\n"
             + json.dumps(good | {"custom_id": "m", "method": "GET"}) + "\n"
             + json.dumps(good | {"custom_id": "u", "url": "/v1/completions"}) + "\n"
             + json.dumps(good | {"custom_id": "p", "body": good["body"] | {"priority": 0}}) + "\n"
             + json.dumps(_chat_line("x", "no-such-model")) + "\n")
    input_file = client.files.create(file=("in.jsonl", io.BytesIO(lines.encode())), purpose="batch")
    batch = _wait_for(client, client.batches.create(input_file_id=input_file.id, endpoint="/v1/chat/completions",
                                                    completion_window="24h").id)

    assert batch.status == "failed" and batch.failed_at is not None
    assert [(e.line, e.code) for e in batch.errors.data] == [
        (2, "invalid_json"), (3, "duplicate_custom_id"), (4, "invalid_method"), (5, "invalid_url"),
        (6, "priority_not_allowed"), (7, "model_not_found")]
    assert batch.output_file_id is None and batch.request_counts.total == 0
    assert not UsageRecord.objects.exists()


def test_a_batch_naming_an_unknown_model_fails_before_any_line_runs(gateway, tenant, batch_worker):
    client = tenant.client(gateway)
    input_file = client.files.create(file=("in.jsonl", _jsonl([_chat_line("a", "nobody-deployed-this")])), purpose="batch")
    batch = _wait_for(client, client.batches.create(input_file_id=input_file.id, endpoint="/v1/chat/completions",
                                                    completion_window="24h").id)
    assert batch.status == "failed"
    assert [(e.code, e.param) for e in batch.errors.data] == [("model_not_found", "body.model")]


def test_bad_create_parameters_are_400s_in_openais_shape(gateway, tenant, files_bucket):
    client = tenant.client(gateway)
    input_file = client.files.create(file=("in.jsonl", _jsonl([_chat_line("a", "m")])), purpose="batch")
    with pytest.raises(openai.BadRequestError) as refused:
        client.batches.create(input_file_id=input_file.id, endpoint="/v1/embeddings/nope", completion_window="24h")
    assert refused.value.body["param"] == "endpoint"
    with pytest.raises(openai.BadRequestError) as refused:
        client.batches.create(input_file_id=input_file.id, endpoint="/v1/chat/completions", completion_window="1h")
    assert refused.value.body["param"] == "completion_window"

    # Each open batch keeps room for its output (its input's size) within the storage quota: before, any
    # number of batches of one input could each write output files nobody could stop.
    from controlplane.accounts.models import Plan

    tenant.org.plan = Plan.objects.create(name="small-files", max_file_bytes=2 * input_file.bytes)
    tenant.org.save(update_fields=["plan"])
    client.batches.create(input_file_id=input_file.id, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError) as refused:
        client.batches.create(input_file_id=input_file.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert (refused.value.code, refused.value.body["param"]) == ("storage_quota_exceeded", "input_file_id")
    assert "open batches" in refused.value.message


def test_cancel_stops_new_lines_and_keeps_the_ones_that_finished(gateway, tenant, batch_worker, start_mock_upstream):
    # One slot and a slow engine: lines finish one at a time.
    endpoint = serve_endpoint(tenant.org, start_mock_upstream(token_delay_ms=100), target_concurrency=1)
    client = tenant.client(gateway)
    input_file = client.files.create(file=("in.jsonl", _jsonl([_chat_line(f"l{i}", endpoint.name, 5) for i in range(60)])),
                                     purpose="batch")
    batch = client.batches.create(input_file_id=input_file.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_until(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 3, 120,
               message="a few lines to finish")

    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    batch = _wait_for(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at is not None
    output = client.files.content(batch.output_file_id).read().splitlines()
    assert 3 <= len(output) == batch.request_counts.completed < 60
    # Billed exactly for what finished; nothing starts after the cancel.
    assert UsageRecord.objects.filter(batch_id=batch.id).count() == len(output)
    assert Batch.objects.get(pk=batch.id).num_completed == len(output)


def test_cancelling_a_batch_that_has_ended_is_a_409_naming_its_status_and_a_cancelling_one_is_answered_as_it_is(
        gateway, tenant):
    """As OpenAI answers: before, an ended batch's cancel was a 200 with the batch as it was, taken for a cancel."""
    client = tenant.client(gateway)
    input_file = client.files.create(file=("in.jsonl", _jsonl([_chat_line("a", "m")])), purpose="batch")
    batch = client.batches.create(input_file_id=input_file.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert client.batches.cancel(batch.id).status == "cancelling"
    assert client.batches.cancel(batch.id).status == "cancelling"  # sent again: the same answer
    for status in ("completed", "failed", "expired", "cancelled", "finalizing"):
        Batch.objects.filter(pk=batch.id).update(status=status)
        with pytest.raises(openai.ConflictError) as refused:
            client.batches.cancel(batch.id)
        assert refused.value.body["message"] == f"Cannot cancel a batch with status '{status}'."
        assert refused.value.body["type"] == "invalid_request_error"
        assert refused.value.response.headers["x-should-retry"] == "false"  # the client does not send it again
        assert client.batches.retrieve(batch.id).status == status


def test_revoking_the_key_that_created_a_batch_stops_it_and_keeps_what_finished(gateway, tenant, batch_worker,
                                                                                 start_mock_upstream):
    """A leaked key's batch must stop with the key: before, it ran on as its creator after the revocation."""
    from controlplane.accounts.keys import revoke_api_key
    from controlplane.accounts.services import Actor

    endpoint = serve_endpoint(tenant.org, start_mock_upstream(token_delay_ms=100), target_concurrency=1)
    client = tenant.client(gateway)
    input_file = client.files.create(file=("in.jsonl", _jsonl([_chat_line(f"l{i}", endpoint.name, 5) for i in range(60)])),
                                     purpose="batch")
    created = client.batches.create(input_file_id=input_file.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_until(lambda: Batch.objects.get(pk=created.id).num_completed >= 2, 120, message="a few lines to finish")

    revoke_api_key(Actor(user=tenant.owner), tenant.api_key)
    batch = wait_until(lambda: (found := Batch.objects.get(pk=created.id)).status in FINAL and found, 60,
                       message="the batch to stop")
    assert batch.status == "cancelled" and batch.num_completed < 60
    # What finished before the stop is kept, written and billed once; nothing starts after it.
    assert UsageRecord.objects.filter(batch_id=batch.pk).count() == batch.num_completed
    assert EndpointEvent.objects.filter(endpoint=endpoint, kind=EventKind.BATCH, message__contains="stopped").exists()


def test_another_organisations_batch_is_a_404(gateway, tenant, batch_worker, start_mock_upstream):
    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    client = tenant.client(gateway)
    input_file = client.files.create(file=("in.jsonl", _jsonl([_chat_line("a", endpoint.name)])), purpose="batch")
    batch = client.batches.create(input_file_id=input_file.id, endpoint="/v1/chat/completions", completion_window="24h")
    stranger = _other_tenant_client(gateway)
    for attempt in (lambda: stranger.batches.retrieve(batch.id), lambda: stranger.batches.cancel(batch.id)):
        with pytest.raises(openai.NotFoundError):
            attempt()
    assert list(stranger.batches.list()) == []
    assert _wait_for(client, batch.id).status == "completed"  # the stranger's cancel changed nothing


def test_batch_work_does_not_wake_a_sleeping_endpoint_and_says_so(gateway, tenant, batch_worker, files_bucket):
    from tests.factories import EndpointFactory

    endpoint = EndpointFactory(organization=tenant.org, max_model_len=2048)  # no replica: scaled to zero
    client = tenant.client(gateway)
    input_file = client.files.create(file=("in.jsonl", _jsonl([_chat_line("a", endpoint.name)])), purpose="batch")
    batch = client.batches.create(input_file_id=input_file.id, endpoint="/v1/chat/completions", completion_window="24h")
    batch = _wait_for(client, batch.id, statuses={"in_progress"})

    wait_until(lambda: EndpointEvent.objects.filter(endpoint=endpoint, kind=EventKind.BATCH,
                                                    message__contains="waits").exists(), 60,
               message="the batch's wait in the event log")
    assert endpoint.replicas.count() == 0
    assert client.batches.retrieve(batch.id).request_counts.completed == 0
    assert [key for key in bucket_objects(files_bucket) if "/lines/" in key] == []


def test_a_batch_line_larger_than_a_request_may_be_is_refused_before_it_is_decoded():
    # One line of 15 MiB of `{},` took a batch worker ~1.2 GiB to check (its container's limit, shared with every
    # other tenant's run): refused from its size, as the gateway refuses such a body.
    import tracemalloc

    from endpoints.batches.validation import parse_lines

    line = b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"model": "m", "x": [' + \
        b"{}," * 3_000_000 + b'{}]}}'
    tracemalloc.start()
    checked = parse_lines([line + b"\n"], request_path="/v1/completions", kind="completion", max_lines=10)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()

    assert [error.code for error in checked.errors] == ["line_too_large"] and not checked.num_lines
    assert peak < 4 * len(line)  # the file's text and its lines, never the line's elements (~1.2 GiB)


def test_a_batch_line_setting_priority_is_refused_before_any_line_runs():
    """Before, a line with `priority` (0 included) passed validation, then every such line failed as it ran
    (`priority_not_allowed`: the runner sets the batch's own engine priority)."""
    from endpoints.batches.validation import parse_lines

    lines = [_chat_line("zero", "m") | {"body": _chat_line("zero", "m")["body"] | {"priority": 0}},
             _chat_line("five", "m") | {"body": _chat_line("five", "m")["body"] | {"priority": 5}},
             _chat_line("none", "m") | {"body": _chat_line("none", "m")["body"] | {"priority": None}},
             _chat_line("plain", "m")]
    checked = parse_lines([_jsonl(lines).getvalue()], request_path="/v1/chat/completions", kind="chat", max_lines=10)
    assert [(error.line, error.code, error.param) for error in checked.errors] == [
        (1, "priority_not_allowed", "body.priority"), (2, "priority_not_allowed", "body.priority")]
    assert "batch priority" in checked.errors[0].message and not checked.num_lines


def test_a_batch_line_with_stream_options_but_no_stream_is_refused_before_any_line_runs():
    """OpenAI's rule, and the engine's: `stream_options` only with `stream`. Before, such a line passed validation,
    then every one failed as it ran (the engine's 400); an interactive call was refused only once admitted."""
    from endpoints.batches.validation import parse_lines
    from endpoints.gateway.errors import OpenAIError
    from endpoints.gateway.request import parse_payload

    body = _chat_line("usage", "m")["body"]
    lines = [_chat_line("usage", "m") | {"body": body | {"stream_options": {"include_usage": True}}},
             _chat_line("empty", "m") | {"body": body | {"stream_options": {}}},  # vLLM takes an empty one
             _chat_line("plain", "m")]
    checked = parse_lines([_jsonl(lines).getvalue()], request_path="/v1/chat/completions", kind="chat", max_lines=10)
    assert [(error.line, error.param) for error in checked.errors] == [(1, "body.stream_options")]
    assert "'stream' is enabled" in checked.errors[0].message
    with pytest.raises(OpenAIError) as refused:
        parse_payload(json.dumps({"model": "m", "prompt": "hi", "stream_options": {"include_usage": True}}).encode(),
                      "completion")
    assert (refused.value.status, refused.value.param) == (400, "stream_options")
    streamed = {"model": "m", "prompt": "hi", "stream": True, "stream_options": {"include_usage": True}}
    assert parse_payload(json.dumps(streamed).encode(), "completion") == streamed
