"""The Files API with the official `openai` client: upload, retrieve, list, content, delete; bytes in
S3 only; the size limit; another organisation's file is a 404."""

from __future__ import annotations

import io

import httpx
import openai
import pytest
from django.db import connection

from tests.batches.conftest import bucket_objects
from tests.conftest import start_web_server
from tests.factories import MembershipFactory, OrganizationFactory, UserFactory

pytestmark = pytest.mark.django_db(transaction=True)

LINES = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m", "messages": []}}\n'


@pytest.fixture
def web(files_bucket, transactional_db, tmp_path, web_zygote):
    # NOTE: 9 places: one organisation's 8 uploads at once all go on (the last place is kept for another).
    child, base_url = start_web_server(tmp_path, name="web", extra_env={"INFERPLANE_FILES_MAX_BYTES": "4096",
                                                                        "INFERPLANE_FILES_UPLOADS_PER_PROCESS": "9"},
                                       zygote=web_zygote)
    yield base_url
    child.stop()


def _other_tenant_client(base_url: str) -> openai.OpenAI:
    from controlplane.accounts.keys import create_api_key
    from controlplane.accounts.models import Role, Scope
    from controlplane.accounts.services import Actor

    organization, user = OrganizationFactory(), UserFactory()
    MembershipFactory(organization=organization, user=user, role=Role.OWNER)
    key = create_api_key(Actor(user=user), organization, name="other", scopes=[Scope.INFERENCE])
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=key.plain, max_retries=0)


def test_openai_client_uploads_retrieves_lists_downloads_and_deletes_a_file(web, tenant, files_bucket):
    client = tenant.client(web)
    created = client.files.create(file=("requests.jsonl", io.BytesIO(LINES)), purpose="batch")
    assert created.id.startswith("file-") and created.bytes == len(LINES) and created.purpose == "batch"
    assert created.filename == "requests.jsonl"

    assert client.files.retrieve(created.id).bytes == len(LINES)
    assert [f.id for f in client.files.list()] == [created.id]
    assert client.files.content(created.id).read() == LINES

    deleted = client.files.delete(created.id)
    assert deleted.deleted is True
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(created.id)
    assert bucket_objects(files_bucket) == {}  # the bytes are gone from S3 too


def test_file_bytes_live_in_s3_and_never_in_postgresql(web, tenant, files_bucket):
    marker = b"needle-7d1f0c2e-in-the-upload"
    data = LINES.replace(b'"messages": []', b'"messages": [], "user": "' + marker + b'"')
    created = tenant.client(web).files.create(file=("r.jsonl", io.BytesIO(data)), purpose="batch")

    assert list(bucket_objects(files_bucket).values()) == [data]
    with connection.cursor() as cursor:
        cursor.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        tables = [row[0] for row in cursor.fetchall()]
        holding = []
        for table in tables:
            cursor.execute(f'SELECT count(*) FROM "{table}" t WHERE t::text LIKE %s', [f"%{marker.decode()}%"])
            if cursor.fetchone()[0]:
                holding.append(table)
    assert holding == []
    assert created.bytes == len(data)


def test_an_upload_past_the_size_limit_is_refused_with_413_and_stores_nothing(web, tenant, files_bucket):
    with pytest.raises(openai.APIStatusError) as refused:
        tenant.client(web).files.create(file=("big.jsonl", io.BytesIO(LINES * 100)), purpose="batch")
    assert refused.value.status_code == 413
    assert "larger than 4096 bytes" in refused.value.message
    assert bucket_objects(files_bucket) == {}


def test_a_file_of_exactly_the_size_limit_is_stored_and_one_byte_more_is_refused(web, tenant, files_bucket):
    # NOTE: the gateway held the whole multipart body (the file, its boundaries and part headers) to the file's limit:
    # a file of exactly 4096 bytes was refused with 413 by the gateway, before the view (which allows the overhead).
    client = tenant.client(web)
    exact = (LINES * 100)[:4095] + b"\n"
    created = client.files.create(file=("r.jsonl", io.BytesIO(exact)), purpose="batch")
    assert created.bytes == 4096
    assert client.files.content(created.id).read() == exact
    with pytest.raises(openai.APIStatusError) as refused:
        client.files.create(file=("r.jsonl", io.BytesIO(exact + b"\n")), purpose="batch")
    assert refused.value.status_code == 413
    assert "larger than 4096 bytes" in refused.value.message


def test_a_chunked_upload_past_the_size_limit_is_refused_stating_the_files_limit(web, tenant, files_bucket):
    """A body that declares no length is cut at the file's limit plus the multipart overhead; before, its 413 stated
    that sum ("larger than 69632 bytes"), not the limit stated everywhere else (4096 here)."""
    def body():
        yield b"--b\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
        yield b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"r.jsonl\"\r\n\r\n"
        for _ in range(33):  # 2 KiB past the cut (4096 + 64 KiB): little left unread as the server closes
            yield LINES * 20

    answer = httpx.post(f"{web}/v1/files", content=body(), timeout=30, headers={
        "authorization": f"Bearer {tenant.key}", "content-type": "multipart/form-data; boundary=b"})
    assert "content-length" not in answer.request.headers  # chunked: only the cut refuses it
    assert answer.status_code == 413, answer.text
    assert answer.json()["error"]["message"] == "The file is larger than 4096 bytes."
    assert bucket_objects(files_bucket) == {}


def test_another_organisations_file_is_a_404_as_if_it_did_not_exist(web, tenant):
    created = tenant.client(web).files.create(file=("r.jsonl", io.BytesIO(LINES)), purpose="batch")
    stranger = _other_tenant_client(web)

    for attempt in (lambda: stranger.files.retrieve(created.id), lambda: stranger.files.content(created.id),
                    lambda: stranger.files.delete(created.id), lambda: stranger.files.retrieve("file-doesnotexist")):
        with pytest.raises(openai.NotFoundError) as refused:
            attempt()
        assert refused.value.body["type"] == "invalid_request_error"
    assert list(stranger.files.list()) == []
    with pytest.raises(openai.NotFoundError):
        stranger.batches.create(input_file_id=created.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert tenant.client(web).files.retrieve(created.id).id == created.id  # untouched


def test_a_call_without_a_key_is_refused_in_openais_shape(web):
    client = openai.OpenAI(base_url=f"{web}/v1", api_key="ip_not-a-real-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as refused:
        client.files.list()
    assert refused.value.body["code"] == "invalid_api_key"


def test_a_malformed_upload_is_a_400_in_openais_shape_not_a_500(web, tenant):
    headers = {"authorization": f"Bearer {tenant.key}"}
    broken = httpx.post(f"{web}/v1/files", headers=headers | {"content-type": "multipart/form-data; boundary=xyz"},
                        content=b"--xyz\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a\"\r\n\r\nabc")
    assert broken.status_code == 400 and broken.json()["error"]["type"] == "invalid_request_error"
    no_boundary = httpx.post(f"{web}/v1/files", headers=headers | {"content-type": "multipart/form-data"}, content=b"x")
    assert no_boundary.status_code == 400 and no_boundary.json()["error"]["type"] == "invalid_request_error"
    # A part's headers past Django's limit (a file name of 2,000 characters; 1,024 bytes at most): before, Django's 400 with no body at all.
    long_name = httpx.post(f"{web}/v1/files", headers=headers | {"content-type": "multipart/form-data; boundary=xyz"},
                           content=b'--xyz\r\nContent-Disposition: form-data; name="file"; filename="' + b"x" * 2000
                           + b'"\r\n\r\n' + LINES + b"\r\n--xyz--\r\n")
    assert long_name.status_code == 400 and "header size" in long_name.json()["error"]["message"]
    not_multipart = httpx.post(f"{web}/v1/files", headers=headers, json={"purpose": "batch"})
    assert not_multipart.status_code == 400 and not_multipart.json()["error"]["param"] == "file"
    wrong_purpose = httpx.post(f"{web}/v1/files", headers=headers, files={"file": ("a.jsonl", b"{}")},
                               data={"purpose": "fine-tune"})
    assert wrong_purpose.status_code == 400 and wrong_purpose.json()["error"]["param"] == "purpose"


def test_a_hostile_file_name_is_stored_and_sent_back_as_its_last_printable_segment_and_a_broken_one_is_a_400(
        web, tenant, files_bucket):
    """Django's multipart parser keeps a part's file name after its last `/` or `\\`, without its unprintable
    characters (direction overrides, NUL, CR/LF); a part header it cannot read (an RFC 2231 `filename*=` in a charset
    such as idna, which fails whatever the error handler) is no file part. The S3 key is the file's id, never its
    name, and the download's `Content-Disposition` is Django's, quoted. (A guard: no change was needed.)"""
    headers = {"authorization": f"Bearer {tenant.key}", "content-type": "multipart/form-data; boundary=b"}

    def upload(disposition: bytes, part_type: bytes = b"") -> httpx.Response:
        return httpx.post(f"{web}/v1/files", headers=headers, content=(
            b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            b'--b\r\nContent-Disposition: form-data; name="file"; ' + disposition + b"\r\n" + part_type + b"\r\n"
            + LINES + b"\r\n--b--\r\n"))

    for disposition, part_type, stored in [
        (b"filename*=UTF-8''%E2%80%AEgpj.exe", b"", "gpj.exe"),
        (b"filename*=UTF-8''a%0d%0aSet-Cookie%3A%20x%00.jsonl", b"", "aSet-Cookie: x.jsonl"),
        (b'filename="../../etc/passwd"', b"", "passwd"),
        (b'filename="a\\b.jsonl"', b"Content-Type: application/jsonl; charset=punycode\r\n", "b.jsonl"),
    ]:
        answer = upload(disposition, part_type)
        assert answer.status_code == 200 and answer.json()["filename"] == stored, (disposition, answer.text)
        download = httpx.get(f"{web}/v1/files/{answer.json()['id']}/content", headers=headers)
        assert download.content == LINES and "\n" not in download.headers["content-disposition"]
    assert not any(name in key for key in bucket_objects(files_bucket) for name in ("passwd", "gpj", "Set-Cookie", ".."))
    for disposition in (b"filename*=idna''a.jsonl", b"filename*=nope''a.jsonl", b'filename=".."'):
        refused = upload(disposition)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "file", (disposition, refused.text)


@pytest.mark.parametrize("charset", ["punycode", "utf-7"])
def test_an_upload_in_a_charset_other_than_utf8_is_a_400_in_openais_shape_not_retried(web, tenant, files_bucket, charset):
    """`charset=punycode`: Django's multipart parser raised `UnicodeError` whatever the error handler, an HTML 500 the
    openai client retried, uploading again (`controlplane.request_charset`)."""
    body = (b'--XyZ\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\xff\r\n'
            b'--XyZ\r\nContent-Disposition: form-data; name="file"; filename="r.jsonl"\r\n\r\n' + LINES + b'\r\n--XyZ--\r\n')
    response = httpx.post(f"{web}/v1/files", content=body,
                          headers={"authorization": f"Bearer {tenant.key}",
                                   "content-type": f"multipart/form-data; boundary=XyZ; charset={charset}"})
    assert response.status_code == 400, (response.status_code, response.content[:200])
    assert response.json()["error"]["type"] == "invalid_request_error" and "charset" in response.json()["error"]["message"]
    assert response.headers["x-should-retry"] == "false"
    assert bucket_objects(files_bucket) == {}


def test_files_and_batches_answers_carry_the_callers_rate_limit_headers(web, tenant):
    client = tenant.client(web)
    listed = client.files.with_raw_response.list()
    for name in ("x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests",
                 "x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens"):
        assert name in listed.headers, name
    assert int(listed.headers["x-ratelimit-remaining-requests"]) <= int(listed.headers["x-ratelimit-limit-requests"])
    missing = httpx.get(f"{web}/v1/batches/batch_nope", headers={"Authorization": f"Bearer {tenant.key}"})
    assert missing.status_code == 404 and "x-ratelimit-limit-requests" in missing.headers
    anonymous = httpx.get(f"{web}/v1/files")
    assert anonymous.status_code == 401 and "x-ratelimit-limit-requests" in anonymous.headers


def test_files_and_batches_answers_name_their_request_as_every_v1_answer_does(web, tenant):
    """`x-request-id`, which the openai client keeps as `_request_id` (what a support ticket quotes): before, only the
    gateway's own refusals on these paths carried one, never Django's answers."""
    client = tenant.client(web)
    created = client.files.create(file=("r.jsonl", io.BytesIO(LINES)), purpose="batch")
    answers = [client.files.with_raw_response.list(), client.files.with_raw_response.retrieve(created.id),
               client.batches.with_raw_response.list(),
               httpx.get(f"{web}/v1/batches/batch_nope", headers={"Authorization": f"Bearer {tenant.key}"}),
               httpx.get(f"{web}/v1/files")]  # refused by the gateway itself, as before
    request_ids = [created._request_id] + [answer.headers.get("x-request-id") for answer in answers]
    assert all(request_id and request_id.startswith("req_") for request_id in request_ids), request_ids
    assert len(set(request_ids)) == len(request_ids)


def test_paths_under_files_and_batches_that_nothing_serves_are_openais_404(web, tenant):
    """Before, Django's HTML page, where the gateway answers every other unknown `/v1` path `unknown_url`."""
    headers = {"authorization": f"Bearer {tenant.key}"}
    for method, path in (("GET", "/v1/files/"), ("GET", "/v1/batches/"), ("GET", "/v1/files/file-x/content/more"),
                         ("POST", "/v1/batches/batch_x/cancel/"), ("GET", "/v1/filesystem")):
        answer = httpx.request(method, f"{web}{path}", headers=headers)
        assert answer.status_code == 404 and answer.headers["content-type"] == "application/json", (path, answer.text)
        assert answer.json()["error"] == {"message": f"Unknown URL {method} {path}.", "type": "invalid_request_error",
                                          "param": None, "code": "unknown_url"}
        assert "x-ratelimit-limit-requests" in answer.headers
    assert httpx.get(f"{web}/v1/files/", headers={"authorization": "Bearer ip_nope"}).status_code == 401


def test_a_client_deleting_files_as_it_lists_them_sees_each_file_once(web, tenant):
    """The openai client asks for each next page `after` the last file of the one before. Before, a file deleted since
    was taken for no cursor and the list started over: the client was given its first page again."""
    client = tenant.client(web)
    uploaded = [client.files.create(file=(f"r{n}.jsonl", io.BytesIO(LINES)), purpose="batch").id for n in range(4)]
    newest_first = uploaded[::-1]

    first = client.files.list(limit=2)
    assert [f.id for f in first.data] == newest_first[:2] and first.has_more
    client.files.delete(first.data[-1].id)
    assert [f.id for f in client.files.list(limit=2, after=first.data[-1].id).data] == newest_first[2:]

    client.files.create(file=("r4.jsonl", io.BytesIO(LINES)), purpose="batch")
    seen = []
    for file in client.files.list(limit=2):  # every second file deleted as it goes, the pages' last ones
        seen.append(file.id)
        if len(seen) % 2 == 0:
            client.files.delete(file.id)
    assert len(seen) == len(set(seen)) == 4


def test_a_files_list_takes_openais_limits_and_answers_pages_of_at_most_100(web, tenant):
    """OpenAI's files list takes a `limit` from 1 to 10,000: before, anything past 100 was a 400."""
    from datetime import timedelta

    from django.utils import timezone

    from endpoints.batches.models import File

    started = timezone.now()
    File.objects.bulk_create(File(organization=tenant.org, purpose="batch", filename=f"r{n}.jsonl", bytes=1,
                                  s3_key=f"files/{tenant.org.pk}/r{n}", created_at=started + timedelta(seconds=n))
                             for n in range(101))
    client = tenant.client(web)

    page = client.files.list(limit=10_000)
    assert len(page.data) == 100 and page.has_more
    rest = client.files.list(limit=10_000, after=page.data[-1].id)
    assert [f.filename for f in rest.data] == ["r0.jsonl"] and not rest.has_more
    assert len(list(client.files.list(limit=1000))) == 101  # the client's own paging
    for limit in (0, 10_001):
        with pytest.raises(openai.BadRequestError) as refused:
            client.files.list(limit=limit)
        assert refused.value.param == "limit"
    with pytest.raises(openai.BadRequestError):
        client.batches.list(limit=101)  # OpenAI's batches list takes 100 at most


def _on_plan(organization, *, max_file_bytes: int) -> None:
    from controlplane.accounts.models import Plan

    organization.plan = Plan.objects.create(name=f"files-{organization.pk}", max_file_bytes=max_file_bytes)
    organization.save(update_fields=["plan"])


def test_uploads_past_the_storage_quota_are_refused_even_all_at_once_and_deleting_frees_room(web, tenant, files_bucket):
    """Before, an organisation could keep any number of 200 MB files in the fleet's bucket. An upload counts its whole
    body (the file and its multipart framing, a few hundred bytes) while it streams in, then the file alone."""
    from concurrent.futures import ThreadPoolExecutor

    data = LINES * 20
    limit = 3 * len(data) + 1024
    _on_plan(tenant.org, max_file_bytes=limit)
    client = tenant.client(web)

    def upload(n: int):
        try:
            return client.files.create(file=(f"r{n}.jsonl", io.BytesIO(data)), purpose="batch")
        except openai.APIStatusError as exc:
            return exc

    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(upload, range(8)))
    stored = [o for o in outcomes if not isinstance(o, Exception)]
    refused = [o for o in outcomes if isinstance(o, Exception)]
    assert len(stored) == 3 and len(refused) == 5
    assert {(e.status_code, e.code, e.param) for e in refused} == {(400, "storage_quota_exceeded", "file")}
    assert "max_file_bytes" in refused[0].message
    assert len(bucket_objects(files_bucket)) == 3

    quotas = httpx.get(f"{web}/api/v1/quotas/", headers={"Authorization": f"Bearer {tenant.key}"}).json()["quotas"]
    assert {"quota": "max_file_bytes", "label": "File storage (batch inputs and outputs)", "limit": limit,
            "used": 3 * len(data), "unit": "bytes"} in quotas

    client.files.delete(stored[0].id)
    assert not isinstance(upload(9), Exception)


def test_an_upload_that_fails_or_dies_stops_counting_against_the_quota(tenant, files_bucket):
    from datetime import timedelta

    from django.utils import timezone

    from endpoints.batches import services
    from endpoints.batches.models import File

    _on_plan(tenant.org, max_file_bytes=len(LINES))

    class Broken(io.BytesIO):
        def read(self, *args):
            raise OSError("the client went away")

    with pytest.raises(OSError):
        services.create_file(organization_id=tenant.org.pk, purpose="batch", filename="r.jsonl", stream=Broken(LINES),
                             size=len(LINES))
    assert not File.objects.exists()

    # A process that died mid-upload left its row: not listed, counted while its lease lasts, swept an hour on.
    File.objects.create(organization=tenant.org, purpose="batch", filename="r.jsonl", bytes=len(LINES),
                        s3_key=f"files/{tenant.org.pk}/file-dead", created_at=timezone.now() - timedelta(minutes=61),
                        stored_at=None, upload_lease_until=timezone.now() + timedelta(minutes=1))
    assert not File.objects.for_org(tenant.org.pk).exists()
    with pytest.raises(services.Refused):
        services.create_file(organization_id=tenant.org.pk, purpose="batch", filename="r.jsonl", stream=io.BytesIO(LINES),
                             size=len(LINES))
    # A row written without `stored_at` (older code during a deploy) is stored: never swept.
    older = File.objects.create(organization=tenant.org, purpose="batch", filename="old.jsonl", bytes=0,
                                s3_key=f"files/{tenant.org.pk}/file-old", created_at=timezone.now() - timedelta(hours=2))
    assert services.sweep_abandoned_uploads() == 1
    assert File.objects.filter(pk=older.pk, stored_at__isnull=False).exists()
    older.delete()
    stored = services.create_file(organization_id=tenant.org.pk, purpose="batch", filename="r.jsonl",
                                  stream=io.BytesIO(LINES), size=len(LINES))
    assert list(File.objects.for_org(tenant.org.pk)) == [stored]


def test_a_file_whose_bytes_are_gone_from_s3_is_openais_404_not_a_503_to_retry_for_ever(web, tenant, files_bucket):
    """Before: a 503 with `retry-after: 1`; the openai client sent it again, and its caller after it, for ever."""
    from endpoints.batches import storage
    from endpoints.batches.models import File

    client = tenant.client(web)
    created = client.files.create(file=("r.jsonl", io.BytesIO(LINES)), purpose="batch")
    storage.delete(File.objects.get(pk=created.id).s3_key)

    with pytest.raises(openai.NotFoundError) as refused:
        client.files.content(created.id)
    assert refused.value.body["type"] == "invalid_request_error" and created.id in refused.value.body["message"]
    assert "retry-after" not in refused.value.response.headers
    assert client.files.retrieve(created.id).id == created.id  # its row is still listed, and can be deleted
    assert client.files.delete(created.id).deleted is True


def _a_stored_file(tenant):
    """The tenant's batch file of LINES, stored in the files bucket."""
    from endpoints.batches import services

    return services.create_file(organization_id=tenant.org.pk, purpose="batch", filename="r.jsonl",
                                stream=io.BytesIO(LINES), size=len(LINES))


def _read_content(tenant, file):
    """GET /v1/files/{id}/content as the tenant, an exception in the view answered as a client sees it."""
    from django.test import Client

    return Client(raise_request_exception=False).get(f"/v1/files/{file.pk}/content",
                                                     HTTP_AUTHORIZATION=f"Bearer {tenant.key}")


def test_s3_down_while_a_files_content_is_read_is_still_a_503_to_retry(tenant, files_bucket, settings):
    from endpoints.batches import storage

    file = _a_stored_file(tenant)
    settings.FILES_S3_ENDPOINT_URL = "http://127.0.0.1:9"  # nothing listens there
    storage.forget_clients()

    answer = _read_content(tenant, file)

    assert (answer.status_code, answer.get("retry-after")) == (503, "1"), answer.content
    assert answer.json()["error"]["code"] == "service_unavailable"


@pytest.mark.parametrize("code", ["AccessDenied", "NoSuchBucket"])
def test_a_files_bytes_s3_will_not_let_the_fleet_read_are_a_503_not_a_404_saying_they_are_gone(
        tenant, files_bucket, monkeypatch, code):
    """The fleet lists the bucket (a batch's results), so an object not there is S3's NoSuchKey; AccessDenied (an IAM
    policy or KMS key changed) or NoSuchBucket (the bucket's setting) is the operator's to mend, and the bytes are
    still stored. Before, each was a 404 `file_content_not_found` telling the tenant its file's bytes were gone."""
    from botocore.exceptions import ClientError

    from endpoints.batches import storage

    file = _a_stored_file(tenant)

    def refused(**kwargs):
        raise ClientError({"Error": {"Code": code, "Message": "no"}}, "GetObject")

    monkeypatch.setattr(storage._client(), "get_object", refused)
    answer = _read_content(tenant, file)

    assert (answer.status_code, answer.get("retry-after")) == (503, "1"), answer.content
    assert answer.json()["error"]["code"] == "service_unavailable"


@pytest.mark.parametrize("code", ["AccessDenied", "InternalError"])
def test_a_file_whose_bytes_s3_will_not_delete_is_not_deleted_and_its_delete_can_be_sent_again(
        tenant, files_bucket, monkeypatch, code):
    """Before: its row was marked deleted before S3 was asked, and S3 refusing (an IAM policy without DeleteObject, S3
    down) answered a 503 for a file gone from every listing: the delete sent again was a 404, and the tenant's prompts
    stayed in the bucket for good, named by no file anyone could see or delete."""
    from botocore.exceptions import ClientError
    from django.test import Client

    from endpoints.batches import storage

    file = _a_stored_file(tenant)
    web = Client(raise_request_exception=False)
    with monkeypatch.context() as refusing:
        def refused(**kwargs):
            raise ClientError({"Error": {"Code": code, "Message": "no"}}, "DeleteObject")

        refusing.setattr(storage._client(), "delete_object", refused)
        answer = web.delete(f"/v1/files/{file.pk}", HTTP_AUTHORIZATION=f"Bearer {tenant.key}")
        assert answer.status_code == 503, answer.content

    listed = web.get("/v1/files", HTTP_AUTHORIZATION=f"Bearer {tenant.key}").json()
    assert [listed_file["id"] for listed_file in listed["data"]] == [file.pk], "still there, to delete again"
    answer = web.delete(f"/v1/files/{file.pk}", HTTP_AUTHORIZATION=f"Bearer {tenant.key}")
    assert (answer.status_code, answer.json()["deleted"]) == (200, True), answer.content
    assert file.s3_key not in bucket_objects(files_bucket)


def test_head_on_every_v1_get_route_answers_as_its_get_without_a_body(web, tenant, files_bucket):
    """HTTP requires a server to answer HEAD wherever it answers GET (RFC 9110, 9.1): the same status and headers, no
    body. Before, HEAD was a 405 on every `/v1` GET route, its `Allow` naming GET alone."""
    from tests.factories import EndpointFactory

    endpoint = EndpointFactory(organization=tenant.org)
    raw = httpx.Client(base_url=web, headers={"Authorization": f"Bearer {tenant.key}"})
    uploaded = raw.post("/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", b'{"a": 1}\n')})
    assert uploaded.status_code == 200, uploaded.text
    file_id = uploaded.json()["id"]
    for path in ("/v1/models", f"/v1/models/{endpoint.name}", "/v1/files", f"/v1/files/{file_id}",
                 f"/v1/files/{file_id}/content", "/v1/batches", "/v1/models/no-such-model", "/v1/files/file-none"):
        got, head = raw.get(path), raw.head(path)
        assert head.status_code == got.status_code and got.status_code in (200, 404), (path, head.status_code)
        assert head.content == b"", path
        assert head.headers["content-type"] == got.headers["content-type"], path
        if "content-length" in got.headers:
            assert head.headers.get("content-length") == got.headers["content-length"], path
        assert head.headers["x-request-id"].startswith("req_")
    assert raw.head(f"/v1/files/{file_id}/content").headers["content-disposition"] == 'attachment; filename="in.jsonl"'


def test_head_on_a_files_content_whose_bytes_are_gone_is_the_404_its_get_is(tenant, files_bucket):
    """Before: HEAD answered 200 from the file's row, its `Content-Length` and name, while GET of the same content,
    its object gone from the bucket, was a 404 `file_content_not_found`: a client checking with HEAD before it
    downloads was told the bytes were there."""
    from django.test import Client

    from endpoints.batches import storage

    file = _a_stored_file(tenant)
    storage.delete(file.s3_key)
    web = Client(raise_request_exception=False)
    path, auth = f"/v1/files/{file.pk}/content", {"HTTP_AUTHORIZATION": f"Bearer {tenant.key}"}

    got, head = web.get(path, **auth), web.head(path, **auth)

    assert (got.status_code, got.json()["error"]["code"]) == (404, "file_content_not_found"), got.content
    assert (head.status_code, head["content-type"]) == (404, got["content-type"]), head.content
    assert "content-disposition" not in head


@pytest.mark.parametrize("code", ["AccessDenied", "NoSuchBucket"])
def test_head_on_a_files_content_s3_will_not_let_the_fleet_read_is_the_503_its_get_is(
        tenant, files_bucket, monkeypatch, code):
    """Before: HEAD answered 200 without asking S3 while GET was a 503 to retry (the bytes unreadable for now)."""
    from botocore.exceptions import ClientError
    from django.test import Client

    from endpoints.batches import storage

    file = _a_stored_file(tenant)

    def refused(**kwargs):
        raise ClientError({"Error": {"Code": code, "Message": "no"}}, "GetObject")

    monkeypatch.setattr(storage._client(), "get_object", refused)
    monkeypatch.setattr(storage._client(), "head_object", refused)
    web = Client(raise_request_exception=False)
    path, auth = f"/v1/files/{file.pk}/content", {"HTTP_AUTHORIZATION": f"Bearer {tenant.key}"}

    got, head = web.get(path, **auth), web.head(path, **auth)

    assert (got.status_code, got.get("retry-after")) == (503, "1"), got.content
    assert (head.status_code, head.get("retry-after")) == (503, "1"), head.content


def test_a_list_cursor_naming_another_organisations_file_pages_nothing_of_theirs(web, tenant):
    """A pin (passes): `after` is looked up among the caller's own files only, so a cursor forged to another
    organisation's file reads as no cursor (the caller's first page, as for an id that names nothing), never a page of
    theirs nor a sign that the id exists."""
    client, other = tenant.client(web), _other_tenant_client(web)
    mine = [client.files.create(file=(f"m{n}.jsonl", io.BytesIO(LINES)), purpose="batch").id for n in range(2)]
    theirs = [other.files.create(file=(f"t{n}.jsonl", io.BytesIO(LINES)), purpose="batch").id for n in range(3)]

    for after in (theirs[1], theirs[0], "file-nosuchfile"):
        for order in ("asc", "desc"):
            page = client.files.list(after=after, order=order)
            assert sorted(f.id for f in page.data) == sorted(mine), (after, order)


def test_head_on_a_files_content_whose_bytes_are_gone_is_the_gets_404_not_a_200(web, tenant, files_bucket):
    """HEAD answers as GET would, without the body (RFC 9110, 9.3.2). Before, HEAD on a file's content answered 200
    from its row alone while GET was a 404 (its object gone from S3): a client checking with HEAD before it
    downloads was told the bytes were there."""
    from endpoints.batches import storage
    from endpoints.batches.models import File

    raw = httpx.Client(base_url=web, headers={"Authorization": f"Bearer {tenant.key}"})
    uploaded = raw.post("/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", LINES)})
    assert uploaded.status_code == 200, uploaded.text
    file_id = uploaded.json()["id"]
    storage.delete(File.objects.get(pk=file_id).s3_key)

    got, head = raw.get(f"/v1/files/{file_id}/content"), raw.head(f"/v1/files/{file_id}/content")
    assert got.status_code == 404, got.text
    assert head.status_code == 404 and head.content == b""
    assert head.headers["content-type"] == got.headers["content-type"]
