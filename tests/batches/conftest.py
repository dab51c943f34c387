"""Batch fixtures: an S3 store (moto's standalone server, one per package, a fresh bucket per test)
whose address every child process (web server, Celery worker) inherits, and the gateway's fixtures."""

from __future__ import annotations

import contextlib
import io
import json
import signal
import sys
import threading
import tracemalloc
import uuid

import boto3
import httpx
import pytest
from django.db import connections

from controlplane.accounts.models import Role
from endpoints.batches import services, storage
from tests.conftest import ChildProcess, child_env, free_port, start_web_server, wait_until
from tests.console.conftest import console_client_factory  # noqa: F401 - a fixture this package uses

# NOTE: `vllm_engine` is tests/conftest.py's (one engine for the session's users), never re-imported here:
# an import would make it this package's own, a second engine start.
from tests.factories import MembershipFactory, UserFactory
from tests.gateway.conftest import (  # noqa: F401 - fixtures this package uses
    start_mock_upstream,
    tenant,
)

S3_KEY, S3_SECRET = "testing", "testing"


@pytest.fixture(scope="package")
def s3_child(tmp_path_factory) -> ChildProcess:
    """moto's S3 server (its address `url`), one per package."""
    port = free_port()
    log_dir = tmp_path_factory.mktemp("moto")
    child = ChildProcess([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], child_env(),
                         log_dir / "moto.log")
    child.url = url = f"http://127.0.0.1:{port}"

    def up():
        try:
            return httpx.get(f"{url}/moto-api/", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(up, 60, message="moto's S3 server")
    yield child
    child.stop()


@pytest.fixture(scope="package")
def s3_server(s3_child) -> str:
    return s3_child.url


@contextlib.contextmanager
def s3_stalled(s3_child: ChildProcess):
    """S3 answering nothing (moto's server stopped, SIGSTOP: it takes connections, and a request waits) until the
    block ends."""
    s3_child.kill(signal.SIGSTOP)
    try:
        yield
    finally:
        s3_child.kill(signal.SIGCONT)


@pytest.fixture(scope="package")
def files_bucket_name() -> str:
    return f"files-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def files_bucket(s3_server, files_bucket_name, monkeypatch, settings) -> str:
    """A fresh bucket for this test, named in the settings and in the environment of every child started after.
    Its name is the package's (moto's every bucket and object removed first): the web servers of the package's
    tests then share an environment, and a zygote (`WebZygote.for_env`)."""
    httpx.post(f"{s3_server}/moto-api/reset", timeout=30).raise_for_status()
    bucket = files_bucket_name
    env = {"INFERPLANE_FILES_S3_BUCKET": bucket, "INFERPLANE_FILES_S3_ENDPOINT_URL": s3_server,
           "AWS_ACCESS_KEY_ID": S3_KEY, "AWS_SECRET_ACCESS_KEY": S3_SECRET, "AWS_DEFAULT_REGION": "us-east-1"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings.FILES_S3_BUCKET, settings.FILES_S3_ENDPOINT_URL = bucket, s3_server
    storage.forget_clients()
    boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1", aws_access_key_id=S3_KEY,
                 aws_secret_access_key=S3_SECRET).create_bucket(Bucket=bucket)
    yield bucket
    storage.forget_clients()


@pytest.fixture
def gateway(files_bucket, transactional_db, tmp_path, web_zygote):
    """The web server (gateway and Django), started after the bucket so that it reads from it."""
    child, base_url = start_web_server(tmp_path, name="gateway", zygote=web_zygote)
    yield base_url
    child.stop()


def new_batch(endpoint, data: bytes, *, request_path: str = "/v1/chat/completions"):
    """A batch of the endpoint's organisation over `data` (its input file, uploaded), created by a member
    through the services as the API does: `validating`, with no run of it queued yet but its dispatch."""
    input_file = services.create_file(organization_id=endpoint.organization_id, purpose="batch", filename="in.jsonl",
                                      stream=io.BytesIO(data), size=len(data))
    member = UserFactory()
    MembershipFactory(organization=endpoint.organization, user=member, role=Role.MEMBER)
    return services.create_batch(organization_id=endpoint.organization_id, api_key_id=None, user_id=member.pk,
                                 input_file_id=input_file.pk, request_path=request_path,
                                 completion_window="24h", metadata=None)


def run_in_a_thread(batch_id: str) -> tuple[threading.Thread, list[object]]:
    """`services.run_batch(batch_id)` started in a thread of its own, as a worker's task: the thread, and a list that
    holds what the run returned (or raised) once it has ended. The thread's connection is closed as it ends."""
    runs: list[object] = []

    def run() -> None:
        try:
            runs.append(services.run_batch(batch_id))
        except Exception as exc:  # noqa: BLE001 - what the task would have raised
            runs.append(exc)
        finally:
            connections.close_all()  # this thread's own, as a worker's task ends

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    return worker, runs


def one_chat_line(endpoint, max_tokens: int = 8) -> bytes:
    """A batch input of one chat line ("only") to `endpoint`."""
    line = {"custom_id": "only", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": endpoint.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}}
    return json.dumps(line).encode() + b"\n"


def lose_a_result_once(monkeypatch, index: int) -> list[int]:
    """S3 refuses the put of line `index`'s result once, after the line ran and was billed (a worker that died between
    its usage row and its result): that run raises. The list returned holds `index` once it was lost."""
    put_result, lost = storage.put_result, []

    def loses_one(organization_id, batch_id, line_index, row, *, ok):
        if line_index == index and not lost:
            lost.append(line_index)
            raise RuntimeError("the worker died here")
        return put_result(organization_id, batch_id, line_index, row, ok=ok)

    monkeypatch.setattr(storage, "put_result", loses_one)
    return lost


# OpenAI's statuses of a batch that has ended.
ENDED_STATUSES = ("completed", "failed", "expired", "cancelled")


def ended_batch(client, batch_id: str, timeout_s: float = 300):
    """The batch, read with the `openai` `client`, once it has ended."""
    wait_until(lambda: client.batches.retrieve(batch_id).status in ENDED_STATUSES, timeout_s, interval_s=0.2,
               message="the batch to end")
    return client.batches.retrieve(batch_id)


def logprob_lines(model: str, num: int) -> bytes:
    """An input of `num` chat lines for `model` that ask for logprobs (the mock pads its answers with them)."""
    return b"".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": model, "messages": [{"role": "user", "content": "hi"}],
                                         "max_tokens": 4, "logprobs": True}}).encode() + b"\n" for i in range(num))


def peak_bytes_while(work) -> int:
    """The most memory (Python's allocations, `tracemalloc`) held at once while `work()` ran."""
    tracemalloc.start()
    try:
        work()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def bucket_objects(bucket: str, prefix: str = "") -> dict[str, bytes]:
    client = storage._client()
    listed = client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    return {item["Key"]: client.get_object(Bucket=bucket, Key=item["Key"])["Body"].read() for item in listed}


# Children run batches in short slices and take a dead worker's batch over within seconds. The test
# nodes send no heartbeats: the worker's beat must not take them (and their replicas) offline.
BATCH_ENV = {"INFERPLANE_BATCH_LEASE_S": "3", "INFERPLANE_BATCH_RUN_SLICE_S": "20", "INFERPLANE_BATCH_TICK_S": "0.5",
             "INFERPLANE_NODE_HEARTBEAT_GRACE_S": "3600"}


def start_batch_worker(tmp_path, *, name: str = "batch-worker", concurrency: int = 2) -> ChildProcess:
    """A prefork Celery worker with its own beat (`-B`: the batch tick), with `BATCH_ENV`."""
    return ChildProcess(
        [sys.executable, "-m", "celery", "-A", "controlplane", "worker", "-B", "--pool=prefork",
         f"--concurrency={concurrency}", "--loglevel=INFO", "--without-gossip", "--without-mingle",
         "--schedule", str(tmp_path / f"{name}-beat"), "-n", f"{name}-{uuid.uuid4().hex[:6]}@%h"],
        child_env() | BATCH_ENV, tmp_path / f"{name}.log",
    )


@pytest.fixture
def batch_worker(transactional_db, files_bucket, tmp_path):
    child = start_batch_worker(tmp_path)
    yield child
    child.stop(timeout_s=0)  # no grace at the test's end, as `celery_worker` (tests/conftest.py)
