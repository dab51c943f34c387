"""OpenAI's `expires_after` on an upload (and a batch's `output_expires_after` on its output and error files): the
file is gone to its tenant once it expires, and its bytes are deleted from S3 by the sweep (`services.sweep_expired_files`, every minute in the beat); out-of-range values are a 400.

Before: both fields were ignored. A tenant whose client asked for its prompts' file to go after an hour had it listed,
downloadable and stored in S3 for good, answered `expires_at: null`."""

from __future__ import annotations

import io
import json
import threading
import time
from datetime import timedelta

import openai
import pytest
from django.db import connection
from django.utils import timezone

from controlplane.accounts.models import Role
from endpoints.batches import services, storage
from endpoints.batches.models import Batch, BatchStatus, File
from tests.batches.conftest import bucket_objects, new_batch, s3_stalled
from tests.conftest import start_web_server
from tests.factories import EndpointFactory, MembershipFactory, OrganizationFactory, UserFactory

pytestmark = pytest.mark.django_db(transaction=True)

LINES = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m", "messages": []}}\n'


@pytest.fixture
def web(files_bucket, transactional_db, tmp_path, web_zygote):
    child, base_url = start_web_server(tmp_path, name="web", zygote=web_zygote)
    yield base_url
    child.stop()


def _expire(file_id: str) -> None:
    """The clock past the file's expiry and the sweep's grace (its `expires_at` moved back to an hour ago)."""
    File.objects.filter(pk=file_id).update(expires_at=timezone.now() - timedelta(hours=1))


def test_a_file_uploaded_with_expires_after_is_gone_once_it_expires_and_its_bytes_are_deleted(
        web, tenant, files_bucket):
    client = tenant.client(web)
    created = client.files.create(file=("prompts.jsonl", io.BytesIO(LINES)), purpose="batch",
                                  expires_after={"anchor": "created_at", "seconds": 3600})
    assert created.expires_at == created.created_at + 3600
    assert client.files.retrieve(created.id).expires_at == created.expires_at
    kept = client.files.create(file=("kept.jsonl", io.BytesIO(LINES)), purpose="batch")
    assert kept.expires_at is None

    _expire(created.id)
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        client.files.content(created.id)
    assert [f.id for f in client.files.list()] == [kept.id]

    assert services.sweep_expired_files() == 1
    assert list(bucket_objects(files_bucket)) == [File.objects.get(pk=kept.id).s3_key]  # the expired bytes are gone
    assert client.files.content(kept.id).read() == LINES


@pytest.mark.parametrize("expires_after", [
    {"anchor": "created_at", "seconds": 60},  # under OpenAI's hour
    {"anchor": "created_at", "seconds": 31 * 24 * 3600},  # past its 30 days
    {"anchor": "last_active_at", "seconds": 3600},
    {"anchor": "created_at", "seconds": "soon"},
])
def test_an_upload_with_an_expires_after_out_of_bounds_is_a_400_naming_it_and_stores_nothing(
        web, tenant, files_bucket, expires_after):
    client = tenant.client(web)
    with pytest.raises(openai.BadRequestError) as refused:
        client.files.create(file=("r.jsonl", io.BytesIO(LINES)), purpose="batch", expires_after=expires_after)
    assert refused.value.body["param"] == "expires_after"
    assert list(client.files.list()) == []
    assert bucket_objects(files_bucket) == {}


def test_an_expired_file_an_open_batch_reads_is_deleted_once_the_batch_ends(files_bucket):
    endpoint = EndpointFactory(max_model_len=2048)  # scaled to zero: no line runs by itself
    line = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": endpoint.name, "messages": [{"role": "user", "content": "hi"}]}}
    batch = new_batch(endpoint, json.dumps(line).encode() + b"\n")
    services.run_batch(batch.pk)
    _expire(batch.input_file_id)

    assert services.sweep_expired_files() == 0  # its batch still reads it
    assert storage.read_bytes(batch.input_file.s3_key)

    services.cancel_batch(Batch.objects.get(pk=batch.pk))
    services.run_batch(batch.pk)
    assert Batch.objects.get(pk=batch.pk).status == BatchStatus.CANCELLED
    assert services.sweep_expired_files() == 1
    assert File.objects.get(pk=batch.input_file_id).deleted_at is not None
    assert batch.input_file.s3_key not in bucket_objects(files_bucket)


def test_a_batchs_output_files_expire_as_its_output_expires_after_asks_and_are_deleted(files_bucket):
    endpoint = EndpointFactory(max_model_len=2048)  # scaled to zero: no line runs by itself
    line = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": endpoint.name, "messages": [{"role": "user", "content": "hi"}]}}
    data = json.dumps(line).encode() + b"\n"
    input_file = services.create_file(organization_id=endpoint.organization_id, purpose="batch", filename="in.jsonl",
                                      stream=io.BytesIO(data), size=len(data))
    member = UserFactory()  # a batch whose creator is no member is cancelled
    MembershipFactory(organization=endpoint.organization, user=member, role=Role.MEMBER)
    batch = services.create_batch(organization_id=endpoint.organization_id, api_key_id=None, user_id=member.pk,
                                  input_file_id=input_file.pk, request_path="/v1/chat/completions",
                                  completion_window="24h", metadata=None,
                                  output_expires_after={"anchor": "created_at", "seconds": 7200})
    services.run_batch(batch.pk)
    Batch.objects.filter(pk=batch.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    services.run_batch(batch.pk)  # its window has passed: it ends `expired`, its line's row in its error file
    batch = Batch.objects.get(pk=batch.pk)
    assert batch.status == BatchStatus.EXPIRED
    error_file = batch.error_file
    assert error_file.as_openai()["expires_at"] == error_file.as_openai()["created_at"] + 7200
    assert File.objects.get(pk=input_file.pk).expires_at is None  # the input is the upload's own, kept

    _expire(error_file.pk)
    assert services.sweep_expired_files() == 1
    assert error_file.s3_key not in bucket_objects(files_bucket)
    assert list(bucket_objects(files_bucket)) == [input_file.s3_key]


def test_a_batch_ended_by_a_worker_of_the_release_before_has_its_output_files_expire_all_the_same(files_bucket):
    # Before: a worker of the release before ends a batch without its files' `expires_at` (it knows nothing of
    # `output_expires_after`): the batch asked for its output to go after two hours, and it was kept for good.
    endpoint = EndpointFactory(max_model_len=2048)  # scaled to zero: no line runs by itself
    line = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": endpoint.name, "messages": [{"role": "user", "content": "hi"}]}}
    data = json.dumps(line).encode() + b"\n"
    input_file = services.create_file(organization_id=endpoint.organization_id, purpose="batch", filename="in.jsonl",
                                      stream=io.BytesIO(data), size=len(data))
    member = UserFactory()
    MembershipFactory(organization=endpoint.organization, user=member, role=Role.MEMBER)
    batch = services.create_batch(organization_id=endpoint.organization_id, api_key_id=None, user_id=member.pk,
                                  input_file_id=input_file.pk, request_path="/v1/chat/completions",
                                  completion_window="24h", metadata=None,
                                  output_expires_after={"anchor": "created_at", "seconds": 7200})
    services.run_batch(batch.pk)
    Batch.objects.filter(pk=batch.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    services.run_batch(batch.pk)
    error_file = Batch.objects.get(pk=batch.pk).error_file
    File.objects.filter(pk=error_file.pk).update(expires_at=None)  # as a worker of the release before ended it

    services.sweep_expired_files()

    shown = File.objects.get(pk=error_file.pk).as_openai()
    assert shown["expires_at"] == shown["created_at"] + 7200
    assert File.objects.get(pk=input_file.pk).expires_at is None  # the input is the upload's own, kept
    _expire(error_file.pk)
    assert services.sweep_expired_files() == 1
    assert list(bucket_objects(files_bucket)) == [input_file.s3_key]


@pytest.mark.parametrize("output_expires_after", [
    {"anchor": "created_at", "seconds": 10}, {"anchor": "created_at", "seconds": True}, {"seconds": 3600}, "1h",
    {}, {"anchor": None, "seconds": None},  # before: taken as no expiry at all, the outputs kept for good
])
def test_a_batch_with_an_output_expires_after_out_of_bounds_is_a_400_naming_it(
        web, tenant, files_bucket, output_expires_after):
    client = tenant.client(web)
    input_file = client.files.create(file=("r.jsonl", io.BytesIO(LINES)), purpose="batch")
    with pytest.raises(openai.BadRequestError) as refused:
        client.batches.create(input_file_id=input_file.id, endpoint="/v1/chat/completions", completion_window="24h",
                              extra_body={"output_expires_after": output_expires_after})
    assert refused.value.body["param"] == "output_expires_after"
    assert list(client.batches.list()) == []


def test_expired_files_open_batches_still_read_hold_back_no_other_expired_file(files_bucket, monkeypatch):
    monkeypatch.setattr(services, "NUM_EXPIRED_FILES_PER_RUN", 1)
    endpoint = EndpointFactory(max_model_len=2048)
    line = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": endpoint.name, "messages": [{"role": "user", "content": "hi"}]}}
    batch = new_batch(endpoint, json.dumps(line).encode() + b"\n")
    _expire(batch.input_file_id)  # expired first, but read by its open batch
    later = services.create_file(organization_id=endpoint.organization_id, purpose="batch", filename="later.jsonl",
                                 stream=io.BytesIO(LINES), size=len(LINES))
    _expire(later.pk)

    assert services.sweep_expired_files() == 1
    assert File.objects.get(pk=later.pk).deleted_at is not None
    assert later.s3_key not in bucket_objects(files_bucket)
    assert File.objects.get(pk=batch.input_file_id).deleted_at is None


def test_an_expires_after_of_thousands_of_digits_is_a_400_naming_it_not_a_500(web, tenant, files_bucket):
    """Before: `int()` of over 4,300 digits raises ValueError (Python's limit on a string's digits): a 500."""
    client = tenant.client(web)
    with pytest.raises(openai.BadRequestError) as refused:
        client.files.create(file=("r.jsonl", io.BytesIO(LINES)), purpose="batch",
                            expires_after={"anchor": "created_at", "seconds": "9" * 5000})
    assert refused.value.body["param"] == "expires_after"
    input_file = client.files.create(file=("r.jsonl", io.BytesIO(LINES)), purpose="batch")
    with pytest.raises(openai.BadRequestError) as refused:
        client.batches.create(input_file_id=input_file.id, endpoint="/v1/chat/completions", completion_window="24h",
                              extra_body={"output_expires_after": {"anchor": "created_at", "seconds": "9" * 5000}})
    assert refused.value.body["param"] == "output_expires_after"
    assert list(client.batches.list()) == []


def test_an_upload_sent_again_under_its_key_with_another_expires_after_is_a_422_not_the_first_file(
        web, tenant, files_bucket):
    """Before: an upload's key covered its bytes and purpose only: the same bytes sent again under the key, asking to
    expire in an hour, were answered the first upload's file, kept for good (`expires_at: null`)."""
    client = tenant.client(web)
    kept = client.files.create(file=("r.jsonl", io.BytesIO(LINES)), purpose="batch",
                               extra_headers={"Idempotency-Key": "upload-1"})
    with pytest.raises(openai.UnprocessableEntityError) as reused:
        client.files.create(file=("r.jsonl", io.BytesIO(LINES)), purpose="batch",
                            expires_after={"anchor": "created_at", "seconds": 3600},
                            extra_headers={"Idempotency-Key": "upload-1"})
    assert reused.value.code == "idempotency_key_reused"
    again = client.files.create(file=("r.jsonl", io.BytesIO(LINES)), purpose="batch",
                                extra_headers={"Idempotency-Key": "upload-1"})
    assert (again.id, again.expires_at) == (kept.id, None)
    assert [f.id for f in client.files.list()] == [kept.id]


def test_one_sweep_deletes_every_expired_file_not_only_its_first_page(files_bucket, monkeypatch):
    """Before: 100 files a run, every 60 s: uploads expiring faster than 100 a minute (all tenants together) left a
    backlog that only grew, each file gone to its tenant but kept in S3 and counted against its storage quota."""
    monkeypatch.setattr(services, "NUM_EXPIRED_FILES_PER_RUN", 2)
    endpoint = EndpointFactory(max_model_len=2048)
    expired = [services.create_file(organization_id=endpoint.organization_id, purpose="batch", filename=f"{n}.jsonl",
                                    stream=io.BytesIO(LINES), size=len(LINES)) for n in range(5)]
    File.objects.filter(pk__in=[f.pk for f in expired]).update(expires_at=timezone.now() - timedelta(hours=1))

    assert services.sweep_expired_files() == 5
    assert bucket_objects(files_bucket) == {}


def test_a_batch_created_as_its_input_expires_keeps_its_input_until_it_ends(files_bucket, monkeypatch):
    """Before: the sweep deleted a file the moment it expired. A batch created from it an instant before (its lookup
    passed, its row not yet committed) was answered 200, then failed: its input deleted under it."""
    endpoint = EndpointFactory(max_model_len=2048)
    line = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": endpoint.name, "messages": [{"role": "user", "content": "hi"}]}}
    data = json.dumps(line).encode() + b"\n"
    input_file = services.create_file(organization_id=endpoint.organization_id, purpose="batch", filename="in.jsonl",
                                      stream=io.BytesIO(data), size=len(data))
    member = UserFactory()
    MembershipFactory(organization=endpoint.organization, user=member, role=Role.MEMBER)
    checked = services._refuse_a_model_of_another_task

    def expiring_meanwhile(*args, **kwargs):  # between the creation's lookup of its input and its batch's commit
        checked(*args, **kwargs)
        File.objects.filter(pk=input_file.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
        services.sweep_expired_files()

    monkeypatch.setattr(services, "_refuse_a_model_of_another_task", expiring_meanwhile)
    batch = services.create_batch(organization_id=endpoint.organization_id, api_key_id=None, user_id=member.pk,
                                  input_file_id=input_file.pk, request_path="/v1/chat/completions",
                                  completion_window="24h", metadata=None)
    monkeypatch.undo()

    assert File.objects.get(pk=input_file.pk).deleted_at is None
    assert input_file.s3_key in bucket_objects(files_bucket)
    _expire(input_file.pk)
    assert services.sweep_expired_files() == 0  # its batch, open, still reads it
    assert Batch.objects.get(pk=batch.pk).status in (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS)


def test_a_sweep_under_a_slow_s3_stops_at_its_budget_not_at_the_end_of_its_page(files_bucket, monkeypatch):
    """Before: the budget was looked at only between pages: 100 deletes of a second each (a slow S3) ran 100 s, past
    the beat's next run (60 s), which took the same page again, the runs piling up on the workers."""
    endpoint = EndpointFactory(max_model_len=2048)
    expired = [services.create_file(organization_id=endpoint.organization_id, purpose="batch", filename=f"{n}.jsonl",
                                    stream=io.BytesIO(LINES), size=len(LINES)) for n in range(4)]
    File.objects.filter(pk__in=[f.pk for f in expired]).update(expires_at=timezone.now() - timedelta(hours=1))
    clock = [1000.0]
    monkeypatch.setattr(services.time, "monotonic", lambda: clock[0])
    slow_delete = storage.delete

    def delete_in_20_s(key, **kwargs):
        clock[0] += 20
        slow_delete(key, **kwargs)

    monkeypatch.setattr(storage, "delete", delete_in_20_s)

    assert services.sweep_expired_files() == 3  # 60 s of deletes: the third ends past 45 s, the fourth left
    assert File.objects.filter(deleted_at__isnull=True).count() == 1


def test_a_sweep_under_a_stalled_s3_gives_up_its_delete_within_seconds(files_bucket, s3_child):
    """Before: a delete made with the run's client (five tries, boto3's 60 s timeouts) held the sweep for minutes, each
    beat's run (every 60 s) starting another on the workers, stuck on the same file."""
    endpoint = EndpointFactory(max_model_len=2048)
    file = services.create_file(organization_id=endpoint.organization_id, purpose="batch", filename="a.jsonl",
                                stream=io.BytesIO(LINES), size=len(LINES))
    File.objects.filter(pk=file.pk).update(expires_at=timezone.now() - timedelta(hours=1))
    outcome = []

    def sweep():
        try:
            outcome.append(services.sweep_expired_files())
        finally:
            connection.close()

    with s3_stalled(s3_child):
        sweeping = threading.Thread(target=sweep, daemon=True)
        started = time.monotonic()
        sweeping.start()
        sweeping.join(20)
        assert not sweeping.is_alive(), "the sweep still waits on S3"
        given_up_after_s = time.monotonic() - started
    assert outcome == [0]
    # NOTE: one try: `QUICK_READ`'s `max_attempts: 1` was boto3's count of retries, a second try and a second read
    # timeout (10 s in all)
    assert given_up_after_s < 2 * storage.QUICK_READ.read_timeout, f"given up after {given_up_after_s:.1f} s"
    assert File.objects.filter(pk=file.pk, deleted_at__isnull=True).exists()  # deleted by a later run


def test_two_sweeps_at_once_under_a_slow_s3_delete_each_expired_file_once_and_leave_no_bytes(files_bucket, monkeypatch):
    """Two runs overlapping (a slow S3, or the beat's messages queued while the workers were down): each file is taken
    by one run alone (`delete_file` marks its row only where no other run has), so no file's bytes are deleted twice,
    none is counted twice, and none is marked deleted with its bytes kept. Why the sweep takes no run lock."""
    endpoint = EndpointFactory(max_model_len=2048)
    expired = [services.create_file(organization_id=endpoint.organization_id, purpose="batch", filename=f"{n}.jsonl",
                                    stream=io.BytesIO(LINES), size=len(LINES)) for n in range(6)]
    File.objects.filter(pk__in=[f.pk for f in expired]).update(expires_at=timezone.now() - timedelta(hours=1))
    deleted_keys, both_started = [], threading.Barrier(2)
    slow_delete = storage.delete

    def slow_s3_delete(key, **kwargs):
        deleted_keys.append(key)
        time.sleep(0.2)
        slow_delete(key, **kwargs)

    monkeypatch.setattr(storage, "delete", slow_s3_delete)
    counts = []

    def sweep():
        try:
            both_started.wait(10)
            counts.append(services.sweep_expired_files())
        finally:
            connection.close()

    runs = [threading.Thread(target=sweep) for _ in range(2)]
    for run in runs:
        run.start()
    for run in runs:
        run.join(30)

    assert sum(counts) == 6 and len(counts) == 2
    assert sorted(deleted_keys) == sorted(f.s3_key for f in expired)
    assert bucket_objects(files_bucket) == {}
    assert File.objects.filter(pk__in=[f.pk for f in expired], deleted_at__isnull=True).count() == 0


def test_a_tenants_expired_file_is_deleted_in_its_first_sweep_behind_another_tenants_backlog(files_bucket, monkeypatch):
    """Before: the sweep took every tenant's expired files in one queue, oldest expiry first. One tenant uploading tiny
    files with the shortest expiry (an hour: no file count bound, only bytes) kept a backlog longer than a run clears,
    and every other tenant's expired files waited behind all of it: kept in S3 past the expiry they asked for, counted
    against their storage quota, yet gone to them (a 404, never listed), so they could not delete them either."""
    def expired_file(organization_id: int, name: str, hours_ago: float) -> File:
        file = services.create_file(organization_id=organization_id, purpose="batch", filename=name,
                                    stream=io.BytesIO(LINES), size=len(LINES))
        File.objects.filter(pk=file.pk).update(expires_at=timezone.now() - timedelta(hours=hours_ago))
        return file

    flooding, quiet = OrganizationFactory(), OrganizationFactory()
    backlog = [expired_file(flooding.pk, f"{n}.jsonl", 3 - n / 10) for n in range(5)]  # expired before the quiet one's
    quiet_file = expired_file(quiet.pk, "mine.jsonl", 1)
    clock = [1000.0]
    monkeypatch.setattr(services.time, "monotonic", lambda: clock[0])
    delete = storage.delete

    def delete_in_20_s(key, **kwargs):  # a run's budget (45 s) takes three deletes
        clock[0] += 20
        delete(key, **kwargs)

    monkeypatch.setattr(storage, "delete", delete_in_20_s)

    assert services.sweep_expired_files() == 3
    assert File.objects.get(pk=quiet_file.pk).deleted_at is not None
    assert quiet_file.s3_key not in bucket_objects(files_bucket)
    assert File.objects.filter(pk__in=[f.pk for f in backlog], deleted_at__isnull=False).count() == 2


def test_one_sweep_clears_one_tenants_backlog_behind_other_tenants_single_files_not_only_its_share(
        files_bucket, monkeypatch):
    """Before: each page took each organisation's oldest ceil(page / organisations) only, and the run stops at its
    first page short of full: with a page of 5 and three tenants, the backlog's share of 2 and the others' 1 each made a
    page of 4, and the run ended with the backlog's other 4 files left though the page had room for them. Other
    tenants' files trickling in each minute, a tenant's backlog drained by its share a minute, not by the budget."""
    monkeypatch.setattr(services, "NUM_EXPIRED_FILES_PER_RUN", 5)

    def expired_file(organization_id: int, name: str) -> File:
        file = services.create_file(organization_id=organization_id, purpose="batch", filename=name,
                                    stream=io.BytesIO(LINES), size=len(LINES))
        _expire(file.pk)
        return file

    flooding = OrganizationFactory()
    backlog = [expired_file(flooding.pk, f"{n}.jsonl") for n in range(6)]
    singles = [expired_file(OrganizationFactory().pk, "mine.jsonl") for _ in range(2)]

    assert services.sweep_expired_files() == len(backlog) + len(singles)
    assert File.objects.filter(deleted_at__isnull=True).count() == 0
    assert bucket_objects(files_bucket) == {}
