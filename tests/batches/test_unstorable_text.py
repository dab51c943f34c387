"""Text PostgreSQL cannot keep (a NUL, a lone surrogate) in a batch's lines or in a files or batches
call: a clear refusal, never a 500, and never a batch stuck in `validating` that takes a place in
every tick. Also: one organisation's backlog of open batches does not starve another's."""

from __future__ import annotations

import json
import time

import pytest

from endpoints.batches import services
from endpoints.batches.models import Batch, BatchStatus, File
from endpoints.batches.validation import Checked, LineError
from tests.batches.conftest import new_batch
from tests.factories import EndpointFactory, OrganizationFactory

pytestmark = pytest.mark.django_db(transaction=True)


def _line(custom_id_json: str, model: str) -> str:
    """A line whose custom_id is written as JSON source (`"a\\u0000"`), escapes and all."""
    return (f'{{"custom_id": {custom_id_json}, "method": "POST", "url": "/v1/chat/completions", '
            f'"body": {{"model": "{model}", "messages": [{{"role": "user", "content": "hi"}}]}}}}\n')


@pytest.fixture
def dispatched(monkeypatch) -> list[str]:
    """The batches `tick` queues a run of (nothing reaches Celery)."""
    queued: list[str] = []
    monkeypatch.setattr(services, "dispatch", lambda batch_id: queued.append(batch_id) or True)
    return queued


@pytest.mark.parametrize("custom_id", ['"a\\u0000"', '"a\\ud800"'])
def test_a_custom_id_with_a_nul_or_a_lone_surrogate_fails_the_batch_with_a_readable_error_and_it_is_not_queued_again(
        files_bucket, dispatched, custom_id):
    """Before, the duplicate's error quoted the NUL, PostgreSQL's jsonb refused it, and the batch stayed
    `validating`, queued again every 2 s for ever."""
    endpoint = EndpointFactory(max_model_len=2048)
    batch = new_batch(endpoint, (_line(custom_id, endpoint.name) * 2).encode())

    services.run_batch(batch.pk)
    services.run_batch(batch.pk)

    batch = Batch.objects.get(pk=batch.pk)
    assert batch.status == BatchStatus.FAILED and batch.failed_at is not None
    assert [(e["line"], e["code"], e["param"]) for e in batch.errors] == [(1, "invalid_value", "custom_id"),
                                                                          (2, "invalid_value", "custom_id")]
    assert "control characters" in batch.errors[0]["message"]
    dispatched.clear()
    services.tick()
    assert batch.pk not in dispatched


def test_errors_postgresql_refuses_still_fail_the_batch_with_an_error_that_says_so(files_bucket, monkeypatch):
    endpoint = EndpointFactory(max_model_len=2048)
    batch = new_batch(endpoint, _line('"a"', endpoint.name).encode())

    class QuotedAsItCame(LineError):
        def as_openai(self) -> dict:
            return {"code": self.code, "message": "quoted \x00 as it came", "param": None, "line": self.line}

    monkeypatch.setattr(services, "parse_lines",
                        lambda *args, **kwargs: Checked(0, [QuotedAsItCame(1, "invalid_json", "x")], None))

    services.run_batch(batch.pk)

    batch = Batch.objects.get(pk=batch.pk)
    assert batch.status == BatchStatus.FAILED
    assert [e["code"] for e in batch.errors] == ["invalid_request"]


def test_a_batch_whose_check_keeps_dying_fails_after_a_few_attempts(files_bucket, monkeypatch):
    endpoint = EndpointFactory(max_model_len=2048)
    batch = new_batch(endpoint, _line('"a"', endpoint.name).encode())

    def dies(*args, **kwargs):
        raise RuntimeError("the check died")

    monkeypatch.setattr(services, "parse_lines", dies)
    for _ in range(services.MAX_VALIDATION_ATTEMPTS):
        with pytest.raises(RuntimeError):
            services.run_batch(batch.pk)
        assert Batch.objects.get(pk=batch.pk).status == BatchStatus.VALIDATING

    services.run_batch(batch.pk)

    batch = Batch.objects.get(pk=batch.pk)
    assert batch.status == BatchStatus.FAILED and [e["code"] for e in batch.errors] == ["validation_failed"]


def test_one_organisations_backlog_of_open_batches_does_not_starve_another_organisations(dispatched):
    """Before, the tick queued the 500 oldest open batches of the fleet: 500 of one organisation's (stuck
    or not) kept every other organisation's batches from ever running."""
    crowded, other = OrganizationFactory(), OrganizationFactory()

    def open_batches(organization, count: int) -> list[Batch]:
        input_file = File.objects.create(organization=organization, purpose="batch", filename="in.jsonl", bytes=1,
                                         s3_key=f"files/{organization.pk}/in")
        return Batch.objects.bulk_create(
            Batch(organization=organization, request_path="/v1/chat/completions", input_file=input_file,
                  expires_at=input_file.created_at) for _ in range(count))

    open_batches(crowded, services.MAX_DISPATCHED_PER_TICK + 1)
    [waiting] = open_batches(other, 1)

    services.tick()

    assert waiting.pk in dispatched and len(dispatched) == services.MAX_DISPATCHED_PER_TICK


# --- files and batches calls ---------------------------------------------------------------------

@pytest.mark.parametrize("path, param", [("/v1/files?after=%00", "after"), ("/v1/files?purpose=%00", "purpose"),
                                         ("/v1/batches?after=file-%00", "after")])
def test_a_nul_in_a_list_parameter_is_a_400_naming_it(owner_client, path, param):
    response = owner_client.get(path)

    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error" and response.json()["error"]["param"] == param


@pytest.mark.parametrize("metadata", [{"job": "a\u0000"}, {"job\u0000": "a"}, {"job": "a\ud800"}])
def test_batch_metadata_postgresql_cannot_keep_is_a_400_naming_it(owner_client, metadata):
    input_file = File.objects.create(organization=owner_client.organization, purpose="batch", filename="in.jsonl",
                                     bytes=1, s3_key=f"files/{owner_client.organization.pk}/in")

    response = owner_client.post("/v1/batches", json.dumps({
        "input_file_id": input_file.pk, "endpoint": "/v1/chat/completions", "completion_window": "24h",
        "metadata": metadata}), content_type="application/json")

    assert response.status_code == 400 and response.json()["error"]["param"] == "metadata"
    assert not Batch.objects.exists()


def test_a_check_that_takes_longer_than_the_lease_is_not_taken_over_meanwhile(files_bucket, monkeypatch, settings):
    # A large input's check outlasted the run's lease (never renewed while checking): the tick gave the batch
    # to another worker, each take-over counted a validation attempt, and a valid batch failed.
    settings.BATCH_LEASE_S = 0.05
    endpoint = EndpointFactory(max_model_len=2048)
    batch = new_batch(endpoint, _line('"a"', endpoint.name).encode())
    checks, taken_over = services.parse_lines, []

    def slow_check(*args, **kwargs):
        time.sleep(0.2)  # past BATCH_LEASE_S
        taken_over.append(services._claim(batch.pk))  # another worker, queued by the tick
        return checks(*args, **kwargs)

    monkeypatch.setattr(services, "parse_lines", slow_check)
    services.run_batch(batch.pk)

    assert taken_over and taken_over[0] is None
    batch = Batch.objects.get(pk=batch.pk)
    assert batch.status == BatchStatus.IN_PROGRESS and batch.num_validation_attempts == 1


def test_a_custom_id_past_its_length_fails_the_batch_saying_how_long_it_may_be_not_that_it_is_missing(
        files_bucket, dispatched):
    from endpoints.batches.validation import MAX_CUSTOM_ID

    endpoint = EndpointFactory(max_model_len=2048)
    batch = new_batch(endpoint, _line(json.dumps("x" * (MAX_CUSTOM_ID + 1)), endpoint.name).encode()
                      + _line('"ok"', endpoint.name).encode())

    services.run_batch(batch.pk)

    batch = Batch.objects.get(pk=batch.pk)
    assert batch.status == BatchStatus.FAILED
    assert [(e["line"], e["code"], e["param"]) for e in batch.errors] == [(1, "invalid_value", "custom_id")]
    assert batch.errors[0]["message"] == f"The custom_id may hold at most {MAX_CUSTOM_ID} characters; this one has {MAX_CUSTOM_ID + 1:,}."
