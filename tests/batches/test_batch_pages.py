"""The console's Batches page: upload a file and start a batch, follow it, download its files, cancel it;
another organisation's batch or file is a 404."""

from __future__ import annotations

import json
import os
import re

import pytest
from django.contrib.messages import get_messages
from django.core.files.uploadedfile import SimpleUploadedFile
from django.urls import reverse

from controlplane.accounts.console import PAGE_ORGANIZATION_FIELD
from controlplane.accounts.models import Role
from endpoints.batches.models import Batch, BatchStatus, File
from tests.batches.conftest import bucket_objects
from tests.factories import MembershipFactory, OrganizationFactory

pytestmark = pytest.mark.django_db(transaction=True)

LINE = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}


def _start(client) -> Batch:
    upload = SimpleUploadedFile("requests.jsonl", json.dumps(LINE).encode() + b"\n", content_type="application/jsonl")
    response = client.post(reverse("console:batches"), {"file": upload, "endpoint": "/v1/chat/completions"})
    assert response.status_code == 302
    return Batch.objects.get(organization=client.organization)


def test_a_member_uploads_a_file_starts_a_batch_and_follows_it(console_client_factory, files_bucket, org):
    member = console_client_factory(org, Role.MEMBER)
    assert 'href="/console/batches/"' in member.get(reverse("console:dashboard")).content.decode()
    batch = _start(member)

    assert batch.status == BatchStatus.VALIDATING and batch.input_file.filename == "requests.jsonl"
    assert list(bucket_objects(files_bucket).values()) == [json.dumps(LINE).encode() + b"\n"]
    page = member.get(reverse("console:batch", args=[batch.pk])).content.decode()
    assert "validating" in page and "0 completed, 0 failed of 0 requests" in page
    assert batch.pk in member.get(reverse("console:batches")).content.decode()
    download = member.get(reverse("console:file-download", args=[batch.input_file_id]))
    # NOTE: its content is asynchronous (`storage.open_stream`); iterating the answer reads it as a WSGI server would.
    assert b"".join(download) == json.dumps(LINE).encode() + b"\n"

    member.post(reverse("console:batch-cancel", args=[batch.pk]))
    batch.refresh_from_db()
    assert batch.status == BatchStatus.CANCELLING and batch.cancelling_at is not None
    assert "cancelling" in member.get(reverse("console:batch-live", args=[batch.pk])).content.decode()


def test_cancelling_a_batch_that_ended_since_its_page_was_shown_says_it_cannot_and_changes_nothing(
        console_client_factory, files_bucket, org):
    member = console_client_factory(org, Role.MEMBER)
    batch = _start(member)
    Batch.objects.filter(pk=batch.pk).update(status=BatchStatus.COMPLETED)

    response = member.post(reverse("console:batch-cancel", args=[batch.pk]))

    assert response.status_code == 302
    assert [str(m) for m in get_messages(response.wsgi_request)][-1] == "Cannot cancel a batch with status 'completed'."
    batch.refresh_from_db()
    assert batch.status == BatchStatus.COMPLETED and batch.cancelling_at is None


def test_the_form_states_the_size_the_console_takes_and_where_larger_files_go(console_client_factory, org):
    """Before, the form said "Up to 200 MB" (the Files API's limit), and the public ingress (16 MiB) answered a larger
    file with nginx's own HTML page."""
    page = console_client_factory(org, Role.MEMBER).get(reverse("console:batches")).content.decode()
    assert "Up to 15 MB here (up to 200 MB through the Files API" in page


def test_a_viewer_sees_batches_but_cannot_start_or_cancel_one(console_client_factory, files_bucket, org):
    batch = _start(console_client_factory(org, Role.MEMBER))
    viewer = console_client_factory(org, Role.VIEWER)
    assert viewer.get(reverse("console:batch", args=[batch.pk])).status_code == 200
    assert viewer.post(reverse("console:batch-cancel", args=[batch.pk])).status_code == 403
    assert Batch.objects.get(pk=batch.pk).status == BatchStatus.VALIDATING


def test_a_viewer_cannot_download_a_batchs_prompts_or_answers(console_client_factory, files_bucket, org):
    # /v1/files refuses a viewer (it may not call the API); the console handed them the same bytes.
    batch = _start(console_client_factory(org, Role.MEMBER))
    viewer = console_client_factory(org, Role.VIEWER)

    assert viewer.get(reverse("console:file-download", args=[batch.input_file_id])).status_code == 403
    page = viewer.get(reverse("console:batch", args=[batch.pk])).content.decode()
    assert reverse("console:file-download", args=[batch.input_file_id]) not in page


def test_a_files_download_link_answers_only_a_read_and_streams_nothing_to_a_post(console_client_factory, files_bucket,
                                                                                 org):
    # Before, the download answered every method: a POST (or PUT, PATCH, DELETE) streamed the file's prompts, and
    # where S3 refused the read it was a 500 (`test_role_routes`: no route answers an empty write with a 5xx).
    batch = _start(member := console_client_factory(org, Role.MEMBER))
    url = reverse("console:file-download", args=[batch.input_file_id])
    for method in ("post", "put", "patch", "delete"):
        response = getattr(member, method)(url)
        assert (response.status_code, response.get("Content-Disposition")) == (405, None), method
    assert member.get(url).status_code == 200


def test_downloading_a_file_whose_bytes_are_gone_from_s3_is_a_404_not_a_500(console_client_factory, files_bucket, org):
    from endpoints.batches import storage

    member = console_client_factory(org, Role.MEMBER)
    batch = _start(member)
    storage.delete(batch.input_file.s3_key)

    assert member.get(reverse("console:file-download", args=[batch.input_file_id])).status_code == 404


def test_a_file_s3_will_not_let_the_fleet_read_is_no_404_page_saying_its_bytes_are_gone(
        console_client_factory, files_bucket, org, monkeypatch):
    """AccessDenied (an IAM policy or KMS key changed) is the operator's to mend: the bytes are still stored. Before,
    the console answered it with a 404 page saying "This file's content is no longer stored"."""
    from botocore.exceptions import ClientError

    from endpoints.batches import storage

    member = console_client_factory(org, Role.MEMBER)
    batch = _start(member)

    def refused(**kwargs):
        raise ClientError({"Error": {"Code": "AccessDenied", "Message": "no"}}, "GetObject")

    monkeypatch.setattr(storage._client(), "get_object", refused)
    member.raise_request_exception = False
    answer = member.get(reverse("console:file-download", args=[batch.input_file_id]))

    assert answer.status_code == 500 and b"no longer stored" not in answer.content


def test_a_cross_site_post_of_the_batch_form_naming_another_organisation_is_csrfs_403_leaving_no_message(
        console_client_factory, files_bucket, org):
    """The action's page organisation is read before the body (and its CSRF token): a page of another site that posts
    to the form, naming an organisation, was answered "This page was for another organisation…", a message written
    into the member's session and a redirect, where any other forged post is CSRF's 403. Its Origin is checked
    first now, as Django's CSRF check does before it reads the token."""
    member = console_client_factory(org, Role.MEMBER)
    member.handler.enforce_csrf_checks = True
    other = OrganizationFactory(name="Other")
    MembershipFactory(organization=other, user=member.user, role=Role.MEMBER)
    upload = SimpleUploadedFile("requests.jsonl", json.dumps(LINE).encode() + b"\n", content_type="application/jsonl")

    for shown_for in (other.pk, "x"):
        forged = member.post(f"{reverse('console:batches')}?{PAGE_ORGANIZATION_FIELD}={shown_for}",
                             {"file": upload, "endpoint": "/v1/chat/completions"}, HTTP_ORIGIN="https://evil.example")
        assert forged.status_code == 403
        assert list(get_messages(forged.wsgi_request)) == []
    assert not Batch.objects.exists() and not File.objects.exists()
    # the Origin checked first marks nothing done: a post of this site's origin without the form's token is still refused
    upload.seek(0)
    tokenless = member.post(f"{reverse('console:batches')}?{PAGE_ORGANIZATION_FIELD}={org.pk}",
                            {"file": upload, "endpoint": "/v1/chat/completions"}, HTTP_ORIGIN="http://testserver")
    assert tokenless.status_code == 403 and not Batch.objects.exists()

    # the member's own stale tab (its origin this site's) is still told why
    stale = member.post(f"{reverse('console:batches')}?{PAGE_ORGANIZATION_FIELD}={other.pk}", {},
                        HTTP_ORIGIN="http://testserver")
    assert stale.status_code == 302
    assert [str(m) for m in get_messages(stale.wsgi_request)] == [
        "This page was for Other; you have since switched to " f"{org.name}. Nothing was changed."]


def test_another_organisations_batch_and_files_are_404s(console_client_factory, files_bucket, org):
    batch = _start(console_client_factory(org, Role.MEMBER))
    stranger = console_client_factory(OrganizationFactory(), Role.OWNER)
    for url in (reverse("console:batch", args=[batch.pk]), reverse("console:batch-live", args=[batch.pk]),
                reverse("console:file-download", args=[batch.input_file_id])):
        assert stranger.get(url).status_code == 404
    assert stranger.post(reverse("console:batch-cancel", args=[batch.pk])).status_code == 404
    assert batch.pk not in stranger.get(reverse("console:batches")).content.decode()
    assert Batch.objects.get(pk=batch.pk).status == BatchStatus.VALIDATING


def _form_as_rendered(client) -> dict[str, str]:
    """The hidden fields of the batch form on the page, as a browser sends them."""
    page = client.get(reverse("console:batches")).content.decode()
    return dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)"', page))


def test_a_batch_form_sent_twice_starts_one_batch_and_both_answers_lead_to_it(
        console_client_factory, files_bucket, org):
    """Before, the form took no key: sent twice (a double click, a resend after a timeout), it started two batches,
    each run and billed."""
    from endpoints.batches import storage
    from endpoints.batches.models import File

    member = console_client_factory(org, Role.MEMBER)
    line = json.dumps(LINE).encode() + b"\n"

    def send(form: dict[str, str], data: bytes = line, endpoint: str = "/v1/chat/completions"):
        upload = SimpleUploadedFile("requests.jsonl", data, content_type="application/jsonl")
        return member.post(reverse("console:batches"), {**form, "file": upload, "endpoint": endpoint})

    form = _form_as_rendered(member)
    first, again = send(form), send(form)
    assert first.status_code == again.status_code == 302
    batch = Batch.objects.get(organization=org)
    assert first.headers["location"] == again.headers["location"] == reverse("console:batch", args=[batch.pk])
    assert list(File.objects.values_list("pk", flat=True)) == [batch.input_file_id]
    assert list(bucket_objects(files_bucket).values()) == [line]  # the second file left unstored, no parts left
    assert not storage._client().list_multipart_uploads(Bucket=files_bucket).get("Uploads")

    refused = send(form, data=line * 2)  # the same form, with another file: it says so, and starts nothing
    assert refused.status_code == 400 and "already started a batch" in refused.content.decode()
    another = _form_as_rendered(member)  # a page loaded again is a new form
    assert another["idempotency_key"] != form["idempotency_key"]
    assert send(another, data=line * 2).status_code == 302
    assert Batch.objects.filter(organization=org).count() == 2


def test_a_batch_form_refused_as_its_file_is_read_comes_back_with_a_key_of_its_own(console_client_factory, files_bucket,
                                                                                   org):
    """Refused before it was bound (past the storage quota), the form came back with no key: sent twice from there, it
    started two batches (found by the review of the form's key)."""
    from tests.batches.test_files_api import _on_plan

    _on_plan(org, max_file_bytes=10)
    member = console_client_factory(org, Role.MEMBER)
    form = _form_as_rendered(member)
    upload = SimpleUploadedFile("requests.jsonl", json.dumps(LINE).encode() * 4, content_type="application/jsonl")
    refused = member.post(reverse("console:batches"), {**form, "file": upload, "endpoint": "/v1/chat/completions"})
    assert refused.status_code == 400
    shown = dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)"', refused.content.decode()))
    assert shown.get("idempotency_key")


def test_a_batch_form_sent_again_while_its_first_sending_still_starts_its_batch_says_so_and_starts_nothing(
        console_client_factory, files_bucket, org):
    from endpoints.batches import idempotency
    from endpoints.gateway.auth import Caller

    member = console_client_factory(org, Role.MEMBER)
    form = _form_as_rendered(member)
    caller = Caller(organization_id=org.pk, api_key_id=None, user_id=member.user.pk, can_infer=False,
                    requests_per_minute=None, tokens_per_minute=None)
    idempotency.begin(caller, form["idempotency_key"], digest="")  # the first sending, still creating

    upload = SimpleUploadedFile("requests.jsonl", json.dumps(LINE).encode() + b"\n", content_type="application/jsonl")
    answer = member.post(reverse("console:batches"), {**form, "file": upload, "endpoint": "/v1/chat/completions"})
    assert answer.status_code == 400 and "its batch is still starting" in answer.content.decode()
    assert not Batch.objects.exists() and bucket_objects(files_bucket) == {}


def test_a_console_upload_goes_to_s3_as_it_is_parsed_with_no_copy_on_disk_and_still_needs_its_csrf_token(
        console_client_factory, files_bucket, org, tmp_path, settings):
    """Before, the console's form wrote its file to a temporary file (Django's `TemporaryFileUploadHandler`, a second
    copy beside the body's own), then from there to S3; `/v1/files` streamed it."""
    from endpoints.batches import storage
    from endpoints.batches.models import File
    from tests.batches.test_upload_disk_use import DiskSampler

    settings.FILE_UPLOAD_TEMP_DIR = str(tmp_path)
    member = console_client_factory(org, Role.MEMBER)
    member.handler.enforce_csrf_checks = True
    line = json.dumps(LINE).encode() + b"\n"
    data = line * (10 * 1024 * 1024 // len(line))

    def post(**fields):
        upload = SimpleUploadedFile("requests.jsonl", data, content_type="application/jsonl")
        return member.post(reverse("console:batches"), {"file": upload, "endpoint": "/v1/chat/completions", **fields})

    def nothing_stored() -> bool:
        unfinished = storage._client().list_multipart_uploads(Bucket=files_bucket).get("Uploads")
        return not File.objects.exists() and bucket_objects(files_bucket) == {} and not unfinished

    assert post().status_code == 403  # no CSRF token: refused, its upload abandoned
    assert nothing_stored()
    token = member.get(reverse("console:batches")).cookies["csrftoken"].value
    refused = post(csrfmiddlewaretoken=token, endpoint="/v1/nope")
    assert refused.status_code == 400 and "/v1/nope" in refused.content.decode()
    assert nothing_stored()

    with DiskSampler(os.getpid(), tmp_path) as disk:
        started = post(csrfmiddlewaretoken=token)
    assert started.status_code == 302, started.content.decode()[:2000]
    batch = Batch.objects.get(organization=org)
    assert batch.input_file.bytes == len(data) and list(bucket_objects(files_bucket).values()) == [data]
    assert disk.peak_bytes == 0, f"{disk.peak_bytes / 1024 / 1024:.1f} MiB written to disk"


def test_a_console_upload_past_the_storage_quota_is_a_form_error_leaving_no_row_or_parts(
        console_client_factory, files_bucket, org):
    """Before, the refusal came as the body was parsed, before the form was bound, and answered 500."""
    from endpoints.batches import storage
    from endpoints.batches.models import File
    from tests.batches.test_files_api import _on_plan

    _on_plan(org, max_file_bytes=10)
    member = console_client_factory(org, Role.MEMBER)
    upload = SimpleUploadedFile("requests.jsonl", json.dumps(LINE).encode() * 4, content_type="application/jsonl")
    refused = member.post(reverse("console:batches"), {"file": upload, "endpoint": "/v1/chat/completions"})
    assert refused.status_code == 400 and "max_file_bytes" in refused.content.decode()
    assert not File.objects.exists() and bucket_objects(files_bucket) == {}
    assert not storage._client().list_multipart_uploads(Bucket=files_bucket).get("Uploads")


def test_a_batch_form_shown_for_one_organisation_starts_nothing_in_the_one_switched_to_meanwhile(
        console_client_factory, files_bucket, org):
    """Tab 1 shows organisation A's Batches page; tab 2 switches to B; tab 1's upload is refused, its file (streamed
    to S3 as it was parsed) left unstored. Before, the batch started in B, billed to B, without a word."""
    member = console_client_factory(org, Role.MEMBER)
    other = OrganizationFactory(name="Other")
    MembershipFactory(organization=other, user=member.user, role=Role.MEMBER)
    page = member.get(reverse("console:batches")).content.decode()
    shown_for = re.search(rf'name="{PAGE_ORGANIZATION_FIELD}" value="(\d+)"', page).group(1)
    # its action names the organisation too, for the gateway to refuse it before its body is read
    action = re.search(r'<form method="post" class="form" enctype="multipart/form-data" novalidate action="([^"]*)"',
                       page).group(1)
    assert action == f"?{PAGE_ORGANIZATION_FIELD}={org.pk}"
    member.post(reverse("switch-organization"), {"organization": other.pk})

    upload = SimpleUploadedFile("requests.jsonl", json.dumps(LINE).encode() + b"\n", content_type="application/jsonl")
    response = member.post(reverse("console:batches") + action, {PAGE_ORGANIZATION_FIELD: shown_for, "file": upload,
                                                                 "endpoint": "/v1/chat/completions"})

    assert response.status_code == 302
    assert [str(m) for m in get_messages(response.wsgi_request)] == [
        f"This page was for {org.name}; you have since switched to Other. Nothing was changed."]
    assert not Batch.objects.exists()
    assert not File.objects.exists() and bucket_objects(files_bucket) == {}
