"""Uploads share a gateway process's few places fairly, those to `/v1/files` and those of the console's batch form
alike: one organisation never takes the last one, a form refused one says why (429, Retry-After), and a body that
comes too slowly (dripped, or stopped) is cut off with a 408; a place is given back however its upload ends."""

from __future__ import annotations

import json
import re
import select
import socket
import time

import httpx
import pytest
from django.conf import settings
from django.middleware.csrf import _get_new_csrf_string

from controlplane.accounts.models import Role
from endpoints.batches import storage
from endpoints.batches.models import Batch
from tests.batches.conftest import bucket_objects
from tests.batches.test_upload_disk_use import LINE, MiB, _held_upload, _upload, held_files
from tests.conftest import start_web_server, wait_until
from tests.gateway.conftest import new_tenant

pytestmark = pytest.mark.django_db(transaction=True)

IDLE_S = 2


def _web(tmp_path, web_zygote, temporary, **extra_env):
    child, base_url = start_web_server(tmp_path, name="web", zygote=web_zygote, extra_env={
        "TMPDIR": str(temporary), "INFERPLANE_FILES_MAX_BYTES": str(64 * MiB),
        "INFERPLANE_FILES_UPLOADS_PER_PROCESS": "2", **extra_env})
    child.temporary, child.base_url = temporary, base_url
    return child


@pytest.fixture(scope="module")
def web_temporary(tmp_path_factory):
    """The web servers' temporary folder, the module's (one environment, one zygote: `WebZygote.for_env`): each test's
    server is a process of its own, and the files it holds there are told apart by its pid (`held_files`)."""
    return tmp_path_factory.mktemp("web-tmp")


@pytest.fixture
def web(files_bucket, transactional_db, tmp_path, web_zygote, web_temporary):
    child = _web(tmp_path, web_zygote, web_temporary)
    yield child
    child.stop()


@pytest.fixture
def impatient_web(files_bucket, transactional_db, tmp_path, web_zygote, web_temporary):
    """A web server that cuts an upload off after `IDLE_S` without a byte, or at under 64 KiB a second."""
    child = _web(tmp_path, web_zygote, web_temporary, INFERPLANE_FILES_UPLOAD_IDLE_S=str(IDLE_S),
                 INFERPLANE_FILES_UPLOAD_MIN_BYTES_PER_S="65536")
    yield child
    child.stop()


def test_one_organisation_never_takes_the_last_upload_place_of_a_process(web, tenant):
    """Before, one organisation's two slow uploads took both places: every other tenant's upload was a 429."""
    held = _held_upload(web, tenant.key, declared=32 * MiB)
    wait_until(lambda: len(held_files(web.pid, web.temporary)) == 1, 10, message="the held upload to be spooled")

    refused = _upload(web, tenant.key, LINE)
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "rate_limit_exceeded" and "kept for others" in refused.text
    assert int(refused.headers["retry-after"]) >= 1

    other = new_tenant()
    assert _upload(web, other.key, LINE).status_code == 200  # the last place, kept for it
    held.close()
    wait_until(lambda: _upload(web, tenant.key, LINE).status_code == 200, 10,
               message="the organisation's upload to go on once its held one ended")


def _answer_of(connection: socket.socket, *, drip_every_s: float | None, within_s: float) -> tuple[bytes, float]:
    """The server's answer on `connection` (its status line and body), and how long it took; meanwhile a byte of the
    body sent every `drip_every_s` (None: nothing more sent)."""
    started = time.monotonic()
    received = b""
    poller = select.poll()  # NOTE: not select(): it fails on an fd past 1,024
    poller.register(connection, select.POLLIN)
    while time.monotonic() - started < within_s:
        if poller.poll((drip_every_s or 0.2) * 1000):
            chunk = connection.recv(65536)
            if not chunk:
                break
            received += chunk
            if b"\r\n\r\n" in received and received.split(b"\r\n\r\n", 1)[1].endswith(b"}}"):
                break
        elif drip_every_s is not None:
            try:
                connection.sendall(b"x")
            except OSError:
                break
    return received, time.monotonic() - started


def _assert_too_slow(answer: bytes) -> None:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer[:300]
    error = json.loads(body)["error"]
    assert error["code"] == "upload_too_slow" and error["param"] == "file", error
    assert "too slow" in error["message"]


def _no_upload_left_in(bucket: str) -> bool:
    return (bucket_objects(bucket) == {}
            and not storage._client().list_multipart_uploads(Bucket=bucket).get("Uploads"))


def test_an_upload_dripped_a_byte_at_a_time_is_cut_off_with_408_and_gives_its_place_back(
        impatient_web, tenant, files_bucket):
    """Before, a body dripped a byte every fraction of a second held its place for ever (two such held every place of
    the process)."""
    host, port = impatient_web.base_url.removeprefix("http://").split(":")
    connection = socket.create_connection((host, int(port)))
    connection.sendall(f"POST /v1/files HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {tenant.key}\r\n"
                       f"Content-Type: multipart/form-data; boundary=b\r\nContent-Length: {MiB}\r\n\r\n".encode()
                       + b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"r.jsonl\"\r\n\r\n")
    answer, took_s = _answer_of(connection, drip_every_s=0.2, within_s=20)
    connection.close()

    _assert_too_slow(answer)
    assert took_s < IDLE_S + 5, f"cut after {took_s:.1f} s"
    assert _upload(impatient_web, tenant.key, LINE).status_code == 200  # its place is free again
    assert _upload(impatient_web, tenant.key, LINE).status_code == 200
    assert len(bucket_objects(files_bucket)) == 2


def test_an_upload_that_stops_sending_its_body_is_cut_off_with_408(impatient_web, tenant, files_bucket):
    """Before, a client that sent part of its body and then nothing held its place until it closed the connection."""
    connection = _held_upload(impatient_web, tenant.key, declared=32 * MiB)  # 3 MiB, then nothing
    answer, took_s = _answer_of(connection, drip_every_s=None, within_s=20)
    connection.close()

    _assert_too_slow(answer)
    assert took_s < IDLE_S + 5, f"cut after {took_s:.1f} s"
    assert _no_upload_left_in(files_bucket)
    wait_until(lambda: held_files(impatient_web.pid, impatient_web.temporary) == {}, 10,
               message="the cut body's temporary file to go")
    assert _upload(impatient_web, tenant.key, LINE).status_code == 200


CONSOLE_BATCHES = "/console/batches/"


class _Member:
    """A console session of a member of `tenant`'s organisation, with its CSRF cookie."""

    def __init__(self, console_client_factory, tenant, role=Role.MEMBER):
        client = console_client_factory(tenant.org, role)
        self.user = client.user
        self.csrf = _get_new_csrf_string()
        self.cookie = (f"{settings.SESSION_COOKIE_NAME}={client.cookies[settings.SESSION_COOKIE_NAME].value}; "
                       f"{settings.CSRF_COOKIE_NAME}={self.csrf}")

    def post(self, web, data: bytes, *, endpoint: str = "/v1/chat/completions", path: str = CONSOLE_BATCHES
             ) -> httpx.Response:
        """The batch form posted with `data` as its file."""
        return httpx.post(f"{web.base_url}{path}", headers={"cookie": self.cookie},
                          files={"file": ("requests.jsonl", data)},
                          data={"endpoint": endpoint, "csrfmiddlewaretoken": self.csrf}, timeout=60)

    def held(self, web, *, declared: int = 12 * MiB, path: str = CONSOLE_BATCHES) -> socket.socket:
        """The batch form's upload, whose client sent its headers and the first 3 MiB of its file, then waits."""
        host, port = web.base_url.removeprefix("http://").split(":")
        connection = socket.create_connection((host, int(port)))
        head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nCookie: {self.cookie}\r\n"
                f"Content-Type: multipart/form-data; boundary=b\r\nContent-Length: {declared}\r\n\r\n")
        fields = (f"--b\r\nContent-Disposition: form-data; name=\"csrfmiddlewaretoken\"\r\n\r\n{self.csrf}\r\n"
                  "--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"r.jsonl\"\r\n\r\n")
        connection.sendall(head.encode() + fields.encode() + b"x" * (3 * MiB))
        return connection


def _form_error(answer: httpx.Response) -> str:
    return " ".join(re.findall(r'<small class="error" role="alert">(.*?)</small>', answer.text, re.S))


def test_a_console_upload_holds_a_place_that_the_same_organisation_cannot_add_the_last_one_to(
        web, tenant, console_client_factory):
    """Before, console uploads took no place: beside one held on the form, the organisation took the process's last
    place through `/v1/files`, and ran any number of form uploads at once."""
    member = _Member(console_client_factory, tenant)
    held = member.held(web)
    wait_until(lambda: len(held_files(web.pid, web.temporary)) == 1, 10, message="the held form upload to be spooled")

    refused = _upload(web, tenant.key, LINE)
    assert refused.status_code == 429, refused.text
    assert "kept for others" in refused.json()["error"]["message"]

    refused = member.post(web, LINE)
    assert refused.status_code == 429, refused.text
    assert int(refused.headers["retry-after"]) >= 1
    assert "kept for others" in _form_error(refused)  # the form says why, its page whole
    assert not Batch.objects.filter(organization=tenant.org).exists()

    other = new_tenant()
    assert _upload(web, other.key, LINE).status_code == 200  # the last place, kept for it
    held.close()
    wait_until(lambda: member.post(web, LINE).status_code == 302, 10,
               message="the form's upload to go on once the held one ended")
    assert Batch.objects.filter(organization=tenant.org).count() == 1


def test_a_console_upload_that_stops_sending_is_cut_off_with_408_and_gives_its_place_back(
        impatient_web, tenant, console_client_factory):
    """Before, a form upload whose client stopped sending held its spooled body (and a connection) for ever."""
    member = _Member(console_client_factory, tenant)
    connection = member.held(impatient_web)
    answer, took_s = _answer_of(connection, drip_every_s=None, within_s=20)
    connection.close()

    _assert_too_slow(answer)
    assert took_s < IDLE_S + 5, f"cut after {took_s:.1f} s"
    wait_until(lambda: held_files(impatient_web.pid, impatient_web.temporary) == {}, 10,
               message="the cut body's temporary file to go")
    # Had the cut upload kept its place, the organisation's next would be refused the last one.
    assert member.post(impatient_web, LINE).status_code == 302
    assert _upload(impatient_web, tenant.key, LINE).status_code == 200


def test_a_console_upload_gives_its_place_back_when_the_form_refuses_it_or_its_client_goes(
        web, tenant, console_client_factory):
    member = _Member(console_client_factory, tenant)
    refused = member.post(web, LINE, endpoint="/v1/nowhere")
    assert refused.status_code == 400 and "valid choice" in _form_error(refused), _form_error(refused)
    gone = member.held(web)
    wait_until(lambda: len(held_files(web.pid, web.temporary)) == 1, 10, message="the held form upload to be spooled")
    gone.close()
    wait_until(lambda: held_files(web.pid, web.temporary) == {}, 10, message="the gone upload's body to go")

    # Both places free again: one held by the organisation, the last kept for another, which takes it.
    held = member.held(web)
    wait_until(lambda: len(held_files(web.pid, web.temporary)) == 1, 10, message="the held form upload to be spooled")
    assert _upload(web, new_tenant().key, LINE).status_code == 200
    held.close()


def test_a_member_still_starts_a_batch_from_the_form_and_others_are_answered_as_before(
        web, tenant, console_client_factory):
    member = _Member(console_client_factory, tenant)
    answer = member.post(web, LINE)
    assert answer.status_code == 302, answer.text
    batch = Batch.objects.get(organization=tenant.org)
    assert answer.headers["location"] == f"/console/batches/{batch.pk}/"

    viewer = _Member(console_client_factory, tenant, Role.VIEWER)
    assert viewer.post(web, LINE).status_code == 403
    anonymous = httpx.post(f"{web.base_url}{CONSOLE_BATCHES}", files={"file": ("r.jsonl", LINE)}, timeout=60)
    assert anonymous.status_code == 302 and "/login/" in anonymous.headers["location"]
    assert Batch.objects.filter(organization=tenant.org).count() == 1


def test_a_console_upload_past_the_forms_limit_or_the_storage_quota_is_refused_before_its_body_is_spooled(
        web, tenant, console_client_factory):
    """Before, the gateway cut a form's body only at the Files API's limit (64 MiB on this server, 200 MB by default)
    and never asked the storage quota: a form upload the console states a 15 MB limit for, or one its organisation
    had no room for, was spooled whole to the web pod's disk before the view refused it."""
    from tests.batches.test_files_api import _on_plan
    from tests.batches.test_upload_disk_use import DiskSampler

    member = _Member(console_client_factory, tenant)
    with DiskSampler(web.pid, web.temporary) as disk:
        connection = member.held(web, declared=40 * MiB)
        try:
            connection.sendall(b"x" * (10 * MiB))  # a browser sends on: the answer comes once the gateway stops reading
        except OSError:
            pass  # the server answered and closed
        connection.settimeout(10)
        answer = b""
        while b"</html>" not in answer and (piece := connection.recv(65536)):
            answer += piece
        connection.close()
    assert answer.startswith(b"HTTP/1.1 413"), answer[:300]
    assert b"larger than 15 MB" in answer
    assert disk.peak_bytes < MiB, f"{disk.peak_bytes / MiB:.1f} MiB spooled"

    _on_plan(tenant.org, max_file_bytes=MiB)
    with DiskSampler(web.pid, web.temporary) as disk:
        refused = member.post(web, (LINE * (4 * MiB // len(LINE) + 1))[:4 * MiB])
    assert refused.status_code == 400, refused.text[:300]
    assert "max_file_bytes" in _form_error(refused), _form_error(refused)
    assert disk.peak_bytes < MiB, f"{disk.peak_bytes / MiB:.1f} MiB spooled"
    assert member.post(web, LINE).status_code == 302  # one it has room for goes on


@pytest.mark.parametrize("places", [1, 2])
def test_an_upload_sent_as_soon_as_the_last_one_is_answered_waits_for_django_to_close_it_rather_than_a_429(
        monkeypatch, settings, places):
    """Django closes an upload's body file after its answer's last byte is sent: a client that sent its next upload
    as soon as it read the answer (the openai client's `files.create` twice) was refused now and then with a 429, its
    own previous upload still counted (a CI run's failure). Here Django takes 0.3 s to close after answering."""
    import asyncio
    from types import SimpleNamespace

    from endpoints.gateway import app as gateway_app

    settings.FILES_UPLOADS_PER_PROCESS = places

    async def authenticate(headers, **_):
        return SimpleNamespace(organization_id=7)

    monkeypatch.setattr(gateway_app.auth, "authenticate", authenticate)

    async def django(scope, receive, send):
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})
        await asyncio.sleep(0.3)  # the body's temporary file and the response closed, in Django's thread

    gateway = gateway_app.Gateway(fallback=django)
    scope = {"type": "http", "path": "/v1/files", "method": "POST", "client": ("203.0.113.9", 4000),
             "headers": [(b"content-type", b"multipart/form-data; boundary=x"), (b"authorization", b"Bearer k")]}

    async def upload(answered: asyncio.Event | None = None) -> int:
        sent = []

        async def receive():
            return {"type": "http.request", "body": b"x", "more_body": False}

        async def send(message):
            sent.append(message)
            if answered is not None and message["type"] == "http.response.body":
                answered.set()

        await gateway(scope, receive, send)
        return sent[0]["status"]

    async def one_after_the_other() -> tuple[int, int, int]:
        answered = asyncio.Event()
        first = asyncio.ensure_future(upload(answered))
        await answered.wait()  # the client has read its answer; Django has not returned yet
        second = await upload()
        return await first, second, gateway.upload_places.num_taken

    assert asyncio.run(one_after_the_other()) == (200, 200, 0)


def test_an_upload_waits_for_an_answered_place_only_so_long_then_is_refused(monkeypatch, settings):
    import asyncio

    from endpoints.gateway import errors, upload_places

    settings.FILES_UPLOADS_PER_PROCESS = 1
    monkeypatch.setattr(upload_places, "CLOSING_WAIT_S", 0.2)
    places = upload_places.UploadPlaces()

    async def take_while_one_is_answered_and_never_closed():
        places.answered(await places.take(7))
        started = asyncio.get_running_loop().time()
        with pytest.raises(errors.OpenAIError) as refused:
            await places.take(8)
        return refused.value.status, asyncio.get_running_loop().time() - started

    status, waited_s = asyncio.run(take_while_one_is_answered_and_never_closed())
    assert status == 429 and 0.2 <= waited_s < 2


def test_a_stale_tabs_console_upload_takes_no_place_or_storage_of_the_organisation_switched_to(
        web, tenant, console_client_factory, files_bucket):
    """The batch form shown for another organisation (a tab left open there; the session since switched to this one):
    its action names that organisation, and the gateway takes no place for it, its body dropped unread. Before, it
    held this organisation's upload place, its body spooled and streamed to S3, until its view refused it."""
    from controlplane.accounts.console import PAGE_ORGANIZATION_FIELD
    from endpoints.batches.models import File
    from tests.factories import MembershipFactory, OrganizationFactory

    member = _Member(console_client_factory, tenant)
    other = OrganizationFactory(name="Other")
    MembershipFactory(organization=other, user=member.user, role=Role.MEMBER)
    stale_action = f"{CONSOLE_BATCHES}?{PAGE_ORGANIZATION_FIELD}={other.pk}"

    held = member.held(web, path=stale_action)
    time.sleep(1.5)
    assert held_files(web.pid, web.temporary) == {}, "the stale upload's body was spooled"
    assert _upload(web, tenant.key, LINE).status_code == 200  # the organisation's place is its own
    held.close()

    refused = member.post(web, LINE, path=stale_action)
    assert refused.status_code == 302, refused.text
    assert not Batch.objects.exists() and list(File.objects.filter(organization=other)) == []
    assert File.objects.filter(organization=tenant.org).count() == 1  # the `/v1/files` upload alone
    assert [key for key in bucket_objects(files_bucket) if f"/{other.pk}/" in key] == []


@pytest.mark.parametrize("query", ["page_organization=", "page_organization={org}&page_organization=",
                                   "page_organization"])
def test_a_console_upload_naming_an_empty_page_organisation_takes_no_place_as_its_view_refuses_it(
        web, tenant, console_client_factory, files_bucket, query):
    """The view reads the action's query as Django does, keeping a blank value (`?page_organization=`: "another
    organisation", refused); the gateway read it dropping blanks, as naming none, and took the organisation's place
    for it, its body spooled, for an upload its view then refused unread."""
    member = _Member(console_client_factory, tenant)
    path = f"{CONSOLE_BATCHES}?{query.format(org=tenant.org.pk)}"

    held = member.held(web, path=path)
    time.sleep(1.5)
    assert held_files(web.pid, web.temporary) == {}, "the refused upload's body was spooled"
    held.close()

    refused = member.post(web, LINE, path=path)
    assert refused.status_code == 302, refused.text
    assert not Batch.objects.exists() and not bucket_objects(files_bucket)
