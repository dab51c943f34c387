"""The check a batch's creation makes of its input's first line (`services._refuse_a_model_of_another_task`): a model
PostgreSQL cannot take is left to the validation (it was a 500), S3 sending the bytes slowly gives the check up within
seconds (it held the creation for ever), and the console form refused for the model's task keeps no file (each try
left one, and its S3 object, counted against the storage quota)."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.urls import reverse

from controlplane.accounts.models import Role
from endpoints.batches import services, storage
from endpoints.batches.models import Batch, BatchStatus, File
from tests.batches.conftest import bucket_objects, new_batch
from tests.gateway.conftest import serve_endpoint

pytestmark = pytest.mark.django_db(transaction=True)


def _embedding_line(model: str, path: str = "/v1/embeddings") -> bytes:
    line = {"custom_id": "a", "method": "POST", "url": path, "body": {"model": model, "input": "hi"}}
    return json.dumps(line).encode() + b"\n"


@pytest.mark.parametrize("model", ["ep\u0000x", "ep\ud800"], ids=["nul", "lone-surrogate"])
def test_a_first_line_model_postgres_refuses_is_left_to_the_validation(files_bucket, tenant, model):
    endpoint = serve_endpoint(tenant.org, "http://127.0.0.1:9", task="embed")
    batch = new_batch(endpoint, _embedding_line(model), request_path="/v1/embeddings")
    batch = services.validate_batch(Batch.objects.select_related("input_file").get(pk=batch.pk))
    assert batch.status == BatchStatus.FAILED
    assert [error["param"] for error in batch.errors] == ["body.model"]


def _post_form(member, model: str, path: str):
    upload = SimpleUploadedFile(
        "requests.jsonl", _embedding_line(model, path), content_type="application/jsonl"
    )
    return member.post(reverse("console:batches"), {"file": upload, "endpoint": path})


def test_the_console_form_refused_for_the_models_task_keeps_no_file(
    console_client_factory, files_bucket, org
):
    serve_endpoint(org, "http://127.0.0.1:9", task="embed", name="m")
    member = console_client_factory(org, Role.MEMBER)
    for _ in range(3):
        refused = _post_form(member, "m", "/v1/chat/completions")
        assert refused.status_code == 400
        assert "does not serve it" in str(refused.context["form"].errors["endpoint"])
    assert Batch.objects.count() == 0
    assert not File.objects.filter(organization=org, deleted_at__isnull=True).exists()
    assert bucket_objects(files_bucket) == {}


def test_the_console_form_with_a_nul_model_creates_a_batch_its_validation_fails(
    console_client_factory, files_bucket, org
):
    serve_endpoint(org, "http://127.0.0.1:9", task="embed", name="m")
    member = console_client_factory(org, Role.MEMBER)
    created = _post_form(member, "m\u0000", "/v1/embeddings")
    assert created.status_code == 302
    assert Batch.objects.get().status == BatchStatus.VALIDATING


def _trickle(listener: socket.socket, stop: threading.Event) -> None:
    """An S3 that answers a ranged GET's headers at once, then a byte every 3 s."""
    while not stop.is_set():
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        conn.recv(65536)
        conn.sendall(
            b"HTTP/1.1 206 Partial Content\r\nContent-Length: 1048576\r\nContent-Type: binary/octet-stream\r\n"
            b"Content-Range: bytes 0-1048575/2000000\r\n\r\n"
        )
        while not stop.is_set():
            try:
                conn.sendall(b"{")
            except OSError:
                break
            stop.wait(3)
        conn.close()


def test_reading_the_first_line_from_an_s3_that_trickles_gives_up(settings):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    stop = threading.Event()
    threading.Thread(target=_trickle, args=(listener, stop), daemon=True).start()
    settings.FILES_S3_ENDPOINT_URL = f"http://127.0.0.1:{listener.getsockname()[1]}"
    settings.FILES_S3_BUCKET = "b"
    storage.forget_clients()
    result = {}

    def read():
        try:
            result["read"] = storage.read_start("k", 1024 * 1024)
        except Exception as exc:  # the caller skips its check on any error
            result["error"] = exc

    reader = threading.Thread(target=read, daemon=True)
    started = time.monotonic()
    try:
        reader.start()
        reader.join(60)  # far past `READ_START_WITHIN_S`: before, it was still reading after 40 s
        assert not reader.is_alive(), f"still reading after {time.monotonic() - started:.0f} s"
        assert "error" in result, result  # given up (its socket timed out, or past `READ_START_WITHIN_S`)
    finally:
        stop.set()
        listener.close()
        storage.forget_clients()


@pytest.fixture
def quick_client_of_a_stopped_s3(settings):
    """The quick S3 client made while the settings named an S3 server since gone (an earlier test's): before the
    bucket's fixture names this test's server."""
    settings.FILES_S3_ENDPOINT_URL = "http://127.0.0.1:9"  # nothing listens
    storage._quick_client()


def test_the_first_line_check_reads_from_the_s3_the_settings_name_now(
    quick_client_of_a_stopped_s3, console_client_factory, files_bucket, org
):
    # The suite's run: the bucket's fixture dropped the run's S3 client only, and the check's kept an earlier test's
    # server (connection refused): the check was skipped and the batch created, a 302 where the refusal was a 400.
    serve_endpoint(org, "http://127.0.0.1:9", task="embed", name="m")
    member = console_client_factory(org, Role.MEMBER)
    assert _post_form(member, "m", "/v1/chat/completions").status_code == 400
