"""`Idempotency-Key` on `POST /v1/batches` and `POST /v1/files`, with the official `openai` client (`extra_headers`):
a creation sent again returns the first object, and only that one runs and is billed; the key sent with another request
is a 422, while the first still runs a 409; two at once make one object; another organisation's same key is its own; a
refused creation frees its key; a bad key is a 400; keys are swept a day on.

Before, the gateway ignored the header: a client that timed out and sent its batch again ran every line twice."""

from __future__ import annotations

import io
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import httpx
import openai
import pytest

from billing.models import UsageRecord
from endpoints.batches import idempotency, services
from endpoints.batches.models import Batch, File, IdempotentRequest
from endpoints.gateway.auth import Caller
from tests.batches.conftest import bucket_objects, s3_stalled
from tests.batches.test_batches_api import _chat_line, _jsonl, _wait_for
from tests.batches.test_files_api import LINES, _on_plan
from tests.conftest import start_web_server, wait_until
from tests.gateway.conftest import new_tenant, serve_endpoint

pytestmark = pytest.mark.django_db(transaction=True)


def _key(value: str) -> dict:
    return {"Idempotency-Key": value}


def _create(client, input_file_id: str, key: str, **kwargs):
    return client.batches.with_raw_response.create(
        input_file_id=input_file_id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        extra_headers=_key(key),
        **kwargs,
    )


def _caller_of(tenant) -> Caller:
    return Caller(
        organization_id=tenant.org.pk,
        api_key_id=tenant.api_key.pk,
        user_id=tenant.owner.pk,
        can_infer=True,
        requests_per_minute=None,
        tokens_per_minute=None,
    )


def test_a_batch_sent_again_with_its_key_is_the_first_batch_and_only_it_runs_and_is_billed(
    gateway, tenant, batch_worker, start_mock_upstream
):
    endpoint = serve_endpoint(tenant.org, start_mock_upstream(), target_concurrency=4)
    client = tenant.client(gateway)
    input_file = client.files.create(
        file=("in.jsonl", _jsonl([_chat_line(f"l{i}", endpoint.name) for i in range(3)])), purpose="batch"
    )

    first = _create(client, input_file.id, "nightly-2026-12-04", metadata={"job": "nightly"})
    again = _create(client, input_file.id, "nightly-2026-12-04", metadata={"job": "nightly"})
    assert first.status_code == again.status_code == 200
    assert (
        again.parse().id == first.parse().id and again.http_response.json() == first.http_response.json()
    )  # the first answer, replayed
    assert again.headers["idempotent-replayed"] == "true" and "idempotent-replayed" not in first.headers

    batch = _wait_for(client, first.parse().id)
    assert batch.status == "completed" and batch.request_counts.completed == 3
    assert (
        _create(client, input_file.id, "nightly-2026-12-04", metadata={"job": "nightly"}).parse().id
        == batch.id
    )
    assert Batch.objects.filter(organization=tenant.org).count() == 1
    assert UsageRecord.objects.filter(organization=tenant.org).count() == 3  # each line billed once


def test_a_key_sent_with_another_request_is_a_422_and_makes_nothing(gateway, tenant):
    client = tenant.client(gateway)
    input_file = client.files.create(file=("in.jsonl", _jsonl([_chat_line("a", "m")])), purpose="batch")
    first = _create(client, input_file.id, "k-1", metadata={"run": "1"}).parse()

    with pytest.raises(openai.UnprocessableEntityError) as reused:
        _create(client, input_file.id, "k-1", metadata={"run": "2"})
    assert (reused.value.code, reused.value.param) == ("idempotency_key_reused", "Idempotency-Key")
    # Another path is another request too: a file uploaded under the batch's key.
    with pytest.raises(openai.UnprocessableEntityError):
        client.files.create(file=("in.jsonl", io.BytesIO(LINES)), purpose="batch", extra_headers=_key("k-1"))
    assert list(Batch.objects.values_list("pk", flat=True)) == [first.id]
    assert File.objects.count() == 1


def test_two_creations_at_once_with_one_key_make_one_batch(gateway, tenant):
    client = tenant.client(gateway)
    input_file = client.files.create(file=("in.jsonl", _jsonl([_chat_line("a", "m")])), purpose="batch")
    body = {"input_file_id": input_file.id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}

    def create(_):
        return httpx.post(
            f"{gateway}/v1/batches",
            json=body,
            timeout=30,
            headers={"authorization": f"Bearer {tenant.key}"} | _key("at-once"),
        )

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(create, range(8)))
    created = {answer.json()["id"] for answer in answers if answer.status_code == 200}
    in_progress = [answer.json()["error"]["code"] for answer in answers if answer.status_code == 409]
    assert len(created) == 1 and len(in_progress) + sum(a.status_code == 200 for a in answers) == 8
    assert set(in_progress) <= {"idempotency_key_in_use"}
    assert list(Batch.objects.values_list("pk", flat=True)) == list(created)


def test_a_key_held_by_a_creation_in_progress_is_a_409_until_it_ends_or_its_claim_lapses(gateway, tenant):
    client = tenant.client(gateway)
    input_file = client.files.create(file=("in.jsonl", _jsonl([_chat_line("a", "m")])), purpose="batch")
    claim = idempotency.begin(_caller_of(tenant), "held", digest="")

    with pytest.raises(openai.ConflictError) as in_progress:
        _create(client, input_file.id, "held")
    assert (
        in_progress.value.code == "idempotency_key_in_use"
        and in_progress.value.response.headers["retry-after"]
    )
    assert not Batch.objects.exists()

    # The process holding it died: once its claim lapses, the next request takes the key over.
    IdempotentRequest.objects.filter(pk=claim.pk).update(
        locked_until=IdempotentRequest.objects.get().created_at
    )
    created = _create(client, input_file.id, "held").parse()
    assert list(Batch.objects.values_list("pk", flat=True)) == [created.id]
    with pytest.raises(idempotency.InProgress):  # the dead one's creation could no longer save its answer
        idempotency.save_answer(claim, {"id": "batch_dead"})


def test_another_organisations_same_key_is_its_own(gateway, tenant):
    other = new_tenant()
    batches = []
    for owner in (tenant, other):
        client = owner.client(gateway)
        input_file = client.files.create(
            file=("in.jsonl", _jsonl([_chat_line("a", "m")])),
            purpose="batch",
            extra_headers=_key("shared-file"),
        )
        batches.append(_create(client, input_file.id, "shared").parse())
    assert batches[0].id != batches[1].id
    assert set(Batch.objects.values_list("organization_id", flat=True)) == {tenant.org.pk, other.org.pk}
    assert _create(tenant.client(gateway), batches[0].input_file_id, "shared").parse().id == batches[0].id


def test_a_refused_creation_frees_its_key_for_the_retry(gateway, tenant):
    client = tenant.client(gateway)
    input_file = client.files.create(file=("in.jsonl", _jsonl([_chat_line("a", "m")])), purpose="batch")
    _on_plan(tenant.org, max_file_bytes=input_file.bytes)  # no room left for the batch's output

    with pytest.raises(openai.BadRequestError) as refused:
        _create(client, input_file.id, "after-quota")
    assert refused.value.code == "storage_quota_exceeded"
    assert not Batch.objects.exists() and not IdempotentRequest.objects.exists()

    tenant.org.plan.max_file_bytes = 10 * input_file.bytes
    tenant.org.plan.save(update_fields=["max_file_bytes"])
    created = _create(client, input_file.id, "after-quota")
    assert created.status_code == 200 and "idempotent-replayed" not in created.headers
    assert list(Batch.objects.values_list("pk", flat=True)) == [created.parse().id]


def test_a_file_sent_again_with_its_key_is_the_first_file_stored_once(gateway, tenant, files_bucket):
    client = tenant.client(gateway)

    def upload(data: bytes, key: str = "upload-1"):
        return client.files.with_raw_response.create(
            file=("in.jsonl", io.BytesIO(data)), purpose="batch", extra_headers=_key(key)
        )

    first, again = upload(LINES), upload(LINES)
    assert again.parse().id == first.parse().id and again.headers["idempotent-replayed"] == "true"
    assert list(File.objects.values_list("pk", flat=True)) == [first.parse().id]
    assert len(bucket_objects(files_bucket)) == 1
    with pytest.raises(openai.UnprocessableEntityError):
        upload(LINES * 2)
    assert File.objects.count() == 1 and len(bucket_objects(files_bucket)) == 1
    assert upload(LINES * 2, key="upload-2").parse().id != first.parse().id


def test_a_batch_cancelled_again_with_a_key_is_answered_as_it_is(gateway, tenant):
    client = tenant.client(gateway)
    input_file = client.files.create(file=("in.jsonl", _jsonl([_chat_line("a", "m")])), purpose="batch")
    batch = client.batches.create(
        input_file_id=input_file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    first = client.batches.cancel(batch.id, extra_headers=_key("stop"))
    again = client.batches.cancel(batch.id, extra_headers=_key("stop"))
    assert first.id == again.id == batch.id and {first.status, again.status} <= {"cancelling", "cancelled"}


@pytest.mark.parametrize("value", ["x" * 256, "tab\there", b"caf\xc3\xa9"])
@pytest.mark.parametrize("path", ["/v1/batches", "/v1/files", "/v1/batches/batch_x/cancel"])
def test_a_key_that_is_not_printable_ascii_up_to_255_is_a_400_in_openais_shape(gateway, tenant, path, value):
    answer = httpx.post(
        f"{gateway}{path}",
        timeout=30,
        headers={"authorization": f"Bearer {tenant.key}", "idempotency-key": value},
        **(
            {"files": {"file": ("in.jsonl", LINES)}, "data": {"purpose": "batch"}}
            if path == "/v1/files"
            else {"json": {}}
        ),
    )
    assert answer.status_code == 400
    assert answer.json()["error"]["code"] == "invalid_idempotency_key"
    assert answer.json()["error"]["param"] == "Idempotency-Key"
    assert not File.objects.exists() and not IdempotentRequest.objects.exists()


def test_keys_are_swept_a_day_after_their_first_use_by_the_batch_tick(gateway, tenant):
    client = tenant.client(gateway)
    input_file = client.files.create(file=("in.jsonl", _jsonl([_chat_line("a", "m")])), purpose="batch")
    first = _create(client, input_file.id, "daily").parse()
    IdempotentRequest.objects.update(
        created_at=IdempotentRequest.objects.get().created_at - timedelta(hours=25)
    )

    # A day on, the key names nothing: the same request makes a new batch (the old row taken over)...
    second = _create(client, input_file.id, "daily").parse()
    assert second.id != first.id
    # ...and the tick sweeps what is left past the day.
    IdempotentRequest.objects.update(
        created_at=IdempotentRequest.objects.get().created_at - timedelta(hours=25)
    )
    services.tick()
    assert not IdempotentRequest.objects.exists()
    assert _create(client, input_file.id, "daily").parse().id not in {first.id, second.id}


# The web servers of the tests of a creation's lease: a key leased for 2 s, renewed every 0.67 s.
LEASE_S = 2


def _leased_web(tmp_path, name: str, web_zygote):
    """Forked from the zygote of this environment (one import for the module's three servers, not one each)."""
    child, child.base_url = start_web_server(
        tmp_path,
        name=name,
        extra_env={
            "INFERPLANE_IDEMPOTENCY_LEASE_S": str(LEASE_S),
            "INFERPLANE_FILES_UPLOADS_PER_PROCESS": "4",
        },
        zygote=web_zygote,
    )
    return child


def _upload_to(web, tenant, key: str) -> httpx.Response:
    return httpx.post(
        f"{web.base_url}/v1/files",
        files={"file": ("in.jsonl", LINES)},
        data={"purpose": "batch"},
        headers={"authorization": f"Bearer {tenant.key}"} | _key(key),
        timeout=60,
    )


def _claimed(key: str) -> bool:
    return IdempotentRequest.objects.filter(key=key, response_status__isnull=True).exists()


def test_an_uploads_key_is_free_again_soon_after_its_web_process_dies_mid_upload(
    files_bucket, s3_child, tenant, tmp_path, web_zygote
):
    """Before, an upload's claim was held an hour: the retry of an upload whose web process died mid-upload got a
    409 for an hour. Here the process is killed (SIGKILL) while it stores the file (S3 stalled)."""
    dying, other = _leased_web(tmp_path, "dying", web_zygote), _leased_web(tmp_path, "other", web_zygote)
    try:
        with ThreadPoolExecutor(1) as pool:
            with s3_stalled(s3_child):
                first = pool.submit(_upload_to, dying, tenant, "crash-1")
                wait_until(lambda: _claimed("crash-1"), 30, message="the upload to claim its key")
                dying.kill()
                killed_at = time.monotonic()
            with pytest.raises(httpx.TransportError):
                first.result()

        refusals = []
        while (retried := _upload_to(other, tenant, "crash-1")).status_code == 409:
            refusals.append(retried.json()["error"]["code"])
            assert time.monotonic() - killed_at < 30, "the dead process's key is still held"
            time.sleep(0.1)
        assert retried.status_code == 200, retried.text
        assert time.monotonic() - killed_at < LEASE_S + 10
        assert set(refusals) <= {"idempotency_key_in_use"}
        stored = retried.json()["id"]
        assert list(File.objects.filter(stored_at__isnull=False).values_list("pk", flat=True)) == [stored]
        again = _upload_to(other, tenant, "crash-1")
        assert again.json()["id"] == stored and again.headers["idempotent-replayed"] == "true"
    finally:
        dying.stop()
        other.stop()


def test_a_retry_while_the_upload_with_its_key_still_goes_on_is_a_409_however_long_it_takes(
    files_bucket, s3_child, tenant, tmp_path, web_zygote
):
    """The lease is renewed while the upload goes on: with S3 stalled for two leases, its retry is still refused;
    once it is stored, the retry is answered with it."""
    # NOTE: two leases (three before, 2 s more): a claim not renewed lapses a whole lease before the retry, which then
    # takes the key over, as it did after three
    web = _leased_web(tmp_path, "web", web_zygote)
    try:
        with ThreadPoolExecutor(1) as pool:
            with s3_stalled(s3_child):
                first = pool.submit(_upload_to, web, tenant, "slow-1")
                wait_until(lambda: _claimed("slow-1"), 30, message="the upload to claim its key")
                time.sleep(2 * LEASE_S)
                refused = _upload_to(web, tenant, "slow-1")
                assert refused.status_code == 409, refused.text
                assert refused.json()["error"]["code"] == "idempotency_key_in_use"
            assert first.result().status_code == 200, first.result().text
        again = _upload_to(web, tenant, "slow-1")
        assert (
            again.json()["id"] == first.result().json()["id"]
            and again.headers["idempotent-replayed"] == "true"
        )
        assert (
            File.objects.filter(stored_at__isnull=False).count() == 1
            and len(bucket_objects(files_bucket)) == 1
        )
    finally:
        web.stop()
