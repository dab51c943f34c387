"""A batch whose run cannot be queued when it is created or cancelled (the broker or Redis down) is answered all the
same, and the batch tick queues its run once they are back.

Before: the run was queued right after the commit, in the request, and its failure answered 503 (Redis) or 500 (the
broker) for a batch that was created; the openai client sends a request again after a 5xx, twice, so three batches
were created, each run and billed. A failed `send_task` also left the batch's dispatch key standing for a run that
was never queued, so the tick did not queue it for `DISPATCH_HELD_S`."""

from __future__ import annotations

import json

import kombu.exceptions
import pytest
import redis.exceptions
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from controlplane import tasks as controlplane_tasks
from controlplane.accounts.models import Role
from controlplane.redis_client import get_redis
from controlplane.redis_keys import batch_dispatch_key
from endpoints.batches import services
from endpoints.batches.models import Batch, BatchStatus, File, FilePurpose
from endpoints.gateway import errors
from tests.gateway.conftest import new_tenant

pytestmark = pytest.mark.django_db(transaction=True)


def _input_file(organization_id: int) -> File:
    return File.objects.create(id=f"file-{organization_id}q", organization_id=organization_id,
                               purpose=FilePurpose.BATCH, filename="in.jsonl", bytes=100, s3_key="k",
                               stored_at=timezone.now())


def _broker_down(*args, **kwargs):
    raise kombu.exceptions.OperationalError("Error 111 connecting to the broker. Connection refused.")


class _RedisDown:
    def set(self, *args, **kwargs):
        raise redis.exceptions.ConnectionError("Error 111 connecting to Redis. Connection refused.")

    delete = set


def _break(monkeypatch, failure: str) -> None:
    if failure == "broker":
        monkeypatch.setattr(controlplane_tasks.current_app, "send_task", _broker_down)
    else:
        monkeypatch.setattr(services, "get_redis", lambda: _RedisDown())


def _mend(monkeypatch) -> list:
    """The broker and Redis back: the runs queued from now on."""
    monkeypatch.setattr(services, "get_redis", get_redis)
    sent = []
    monkeypatch.setattr(controlplane_tasks.current_app, "send_task", lambda name, **kwargs: sent.append(kwargs["args"]))
    return sent


@pytest.mark.parametrize("failure", ["broker", "redis"])
def test_a_batch_whose_run_could_not_be_queued_is_created_once_and_queued_by_the_tick(monkeypatch, failure):
    tenant = new_tenant()
    input_file = _input_file(tenant.org.pk)
    _break(monkeypatch, failure)
    body = json.dumps({"input_file_id": input_file.pk, "endpoint": "/v1/chat/completions", "completion_window": "24h"})

    response = Client(raise_request_exception=False).post(
        "/v1/batches", data=body, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {tenant.key}")

    assert response.status_code == 200, response.content
    [batch] = Batch.objects.filter(organization_id=tenant.org.pk)
    assert (response.json()["id"], response.json()["status"]) == (batch.pk, "validating")
    sent = _mend(monkeypatch)
    services.tick()
    assert sent == [[batch.pk]], "the tick queues the run that could not be queued, not DISPATCH_HELD_S later"


def test_a_cancel_whose_run_could_not_be_queued_is_answered_and_queued_by_the_tick(monkeypatch):
    tenant = new_tenant()
    monkeypatch.setattr(controlplane_tasks.current_app, "send_task", lambda name, **kwargs: None)
    batch = services.create_batch(organization_id=tenant.org.pk, api_key_id=tenant.api_key.pk, user_id=None,
                                  input_file_id=_input_file(tenant.org.pk).pk, request_path="/v1/chat/completions",
                                  completion_window="24h", metadata=None)
    get_redis().delete(batch_dispatch_key(batch.pk))  # its first run ran
    _break(monkeypatch, "broker")

    response = Client(raise_request_exception=False).post(
        f"/v1/batches/{batch.pk}/cancel", HTTP_AUTHORIZATION=f"Bearer {tenant.key}")

    assert response.status_code == 200, response.content
    assert response.json()["status"] == BatchStatus.CANCELLING
    sent = _mend(monkeypatch)
    services.tick()
    assert sent == [[batch.pk]]


def test_a_batch_created_in_the_console_while_the_broker_is_down_is_created(monkeypatch, console_client_factory,
                                                                            files_bucket):
    tenant = new_tenant()
    client = console_client_factory(tenant.org, Role.MEMBER)
    _break(monkeypatch, "broker")
    line = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}
    upload = SimpleUploadedFile("in.jsonl", json.dumps(line).encode() + b"\n", content_type="application/jsonl")
    response = client.post(reverse("console:batches"), {"file": upload, "endpoint": "/v1/chat/completions"})

    [batch] = Batch.objects.filter(organization_id=tenant.org.pk)
    assert response.status_code == 302 and response.url == reverse("console:batch", args=[batch.pk])


def test_a_broker_that_cannot_be_reached_is_an_outage():
    assert errors.is_outage(kombu.exceptions.OperationalError("Error 111 connecting to the broker."))
