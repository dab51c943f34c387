"""Engine limits from the model, failures that stop instead of looping, and states that tell the truth (rows, no processes)."""

from datetime import timedelta

import pytest
from django.test import override_settings
from django.utils import timezone

from controlplane import tasks as controlplane_tasks
from controlplane.accounts.services import SYSTEM
from endpoints import scheduler
from endpoints.autoscaler import Load
from endpoints.fleet import services
from endpoints.fleet.services import create_join_token, desired_replicas
from endpoints.models import Endpoint, ModelFacts, Replica
from endpoints.replicas import RECONCILE_TASK, failure_signature
from gpu_agent.protocol import Heartbeat, ModelInfo, ReplicaState, ReplicaStatus, WeightsStatus
from tests.factories import EndpointFactory
from tests.test_agent_api import register
from tests.test_placement import make_node

pytestmark = pytest.mark.django_db

TINY = "/models/tiny-llama"
FIRST_USE = {"name": "tiny", "model_source": TINY, "gpu_type": "cpu"}
TOO_LONG = (
    "max_model_len 4096 is above this model's context of 2048 tokens (its config.json); "
    "lower max_model_len or leave it unset to use the model's own"
)
IDLE = Load(0, 0, None, 0)


@pytest.fixture
def node_secret(client):
    token = create_join_token(SYSTEM, name="test").plain
    return register(client, token, gpu_memory_mb=16_000).json()["node_secret"]


def beat(client, secret, replicas=(), weights=()):
    body = Heartbeat(agent_version="0.1.0", num_cpus=2, memory_mb=24000, memory_used_mb=1000,
                     replicas=list(replicas), weights=list(weights)).to_dict()
    response = client.post("/agent/v1/heartbeat", body, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {secret}")
    assert response.status_code == 200, response.content
    return response.json()


def tiny_weights(source=TINY, max_model_len=2048):
    return WeightsStatus(source=source, cache_key="local-x", size_bytes=1_000_000, downloaded_bytes=1_000_000, complete=True,
                         model_info=ModelInfo(max_model_len=max_model_len, architecture="LlamaForCausalLM", num_params=400_000))


def failed(replica, reason=TOO_LONG, *, permanent=False):
    return ReplicaStatus(replica_id=str(replica.pk), state=ReplicaState.FAILED, failure_reason=reason, failure_permanent=permanent)


def created_via_api(owner_client, **extra) -> dict:
    response = owner_client.post("/api/v1/endpoints/", FIRST_USE | extra, format="json")
    assert response.status_code == 201, response.json()
    return response.json()


def test_an_endpoint_made_with_the_apis_defaults_leaves_the_context_length_to_the_model(owner_client, client, node_secret):
    body = created_via_api(owner_client, min_replicas=1)
    assert body["max_model_len"] is None and body["context_length"] == 4096  # not known yet: a cautious estimate
    scheduler.reconcile_endpoint(body["id"], IDLE)
    [spec] = beat(client, node_secret)["desired"]
    assert spec["max_model_len"] is None  # the agent launches its engine with the context it describes


def test_what_an_agent_reads_from_the_model_becomes_its_limit_at_create_and_update(owner_client, client, node_secret):
    body = created_via_api(owner_client, min_replicas=1)
    scheduler.reconcile_endpoint(body["id"], IDLE)
    beat(client, node_secret, weights=[tiny_weights()])
    facts = ModelFacts.objects.get(source=TINY)
    assert (facts.max_model_len, facts.architecture, facts.num_params) == (2048, "LlamaForCausalLM", 400_000)
    assert owner_client.get(f"/api/v1/endpoints/{body['id']}/").json()["context_length"] == 2048

    refused = owner_client.post("/api/v1/endpoints/", FIRST_USE | {"name": "tiny-long", "max_model_len": 4096}, format="json")
    assert refused.status_code == 400
    assert refused.json()["max_model_len"] == [
        "This model's context is 2048 tokens (from its config.json); choose at most 2048, or leave it empty for the model's own."
    ]
    patched = owner_client.patch(f"/api/v1/endpoints/{body['id']}/", {"max_model_len": 8192}, format="json")
    assert patched.status_code == 400 and "max_model_len" in patched.json()
    assert owner_client.patch(f"/api/v1/endpoints/{body['id']}/", {"max_model_len": 1024}, format="json").status_code == 200


def test_a_node_cannot_set_the_limits_of_a_model_it_was_never_asked_to_run(client, node_secret):
    beat(client, node_secret, weights=[tiny_weights(source="hf:meta-llama/Llama-3.1-8B-Instruct", max_model_len=16)])
    assert not ModelFacts.objects.exists()


def test_a_spec_the_model_cannot_run_fails_the_endpoint_at_once_with_the_reason_and_places_nothing_more(
    owner_client, client, node_secret,
):
    body = created_via_api(owner_client, min_replicas=1, max_model_len=4096)  # the model is not known yet
    scheduler.reconcile_endpoint(body["id"], IDLE)
    [replica] = Replica.objects.filter(endpoint_id=body["id"])
    beat(client, node_secret, replicas=[failed(replica, permanent=True)], weights=[tiny_weights()])

    shown = owner_client.get(f"/api/v1/endpoints/{body['id']}/").json()
    assert shown["state"] == "FAILED"
    assert shown["status_message"] == f"failed: {TOO_LONG}"
    for _ in range(5):  # ticks and wakes keep coming: none places a replica
        scheduler.reconcile_endpoint(body["id"], Load(0, 3, timezone.now().timestamp(), 3))
        scheduler.autoscale_tick()
    assert Replica.objects.filter(endpoint_id=body["id"]).count() == 1
    assert owner_client.get(f"/api/v1/endpoints/{body['id']}/").json()["status_message"] == f"failed: {TOO_LONG}"


@override_settings(REPLICA_MAX_IDENTICAL_FAILURES=3, REPLICA_RETRY_BASE_S=30)
def test_identical_engine_failures_back_off_then_stop_the_endpoint(client, node_secret):
    endpoint = EndpointFactory(model_source=TINY, gpu_type="cpu", min_replicas=1)
    delays = []
    for attempt in range(1, 10):
        scheduler.reconcile_endpoint(str(endpoint.pk), IDLE)
        placed = Replica.objects.filter(endpoint=endpoint, state=ReplicaState.PENDING).first()
        if placed is None:
            break
        beat(client, node_secret, replicas=[failed(placed, f"engine exited with code 1 (pid {4000 + attempt})")])
        endpoint.refresh_from_db()
        if endpoint.next_attempt_at is not None:
            delays.append(round((endpoint.next_attempt_at - timezone.now()).total_seconds() / 10) * 10)
            scheduler.reconcile_endpoint(str(endpoint.pk), IDLE)  # still backing off: nothing placed
            assert not Replica.objects.filter(endpoint=endpoint, state=ReplicaState.PENDING).exists()
            Endpoint.objects.filter(pk=endpoint.pk).update(next_attempt_at=timezone.now() - timedelta(seconds=1))
    endpoint.refresh_from_db()
    assert Replica.objects.filter(endpoint=endpoint).count() == 3
    assert delays == [30, 60]
    assert endpoint.state == "FAILED"
    assert endpoint.status_message == "failed: engine exited with code 1 (pid 4003)"


def fail_in_turn(client, node_secret, endpoint, reasons) -> list[int]:
    """Each reason fails the replica the scheduler places next (each backoff skipped); the delays, in seconds."""
    delays = []
    for reason in reasons:
        scheduler.reconcile_endpoint(str(endpoint.pk), IDLE)
        placed = Replica.objects.filter(endpoint=endpoint, state=ReplicaState.PENDING).first()
        if placed is None:
            break
        beat(client, node_secret, replicas=[failed(placed, reason)])
        endpoint.refresh_from_db()
        if endpoint.next_attempt_at is not None:
            delays.append(round((endpoint.next_attempt_at - timezone.now()).total_seconds() / 10) * 10)
            Endpoint.objects.filter(pk=endpoint.pk).update(next_attempt_at=timezone.now() - timedelta(seconds=1))
    endpoint.refresh_from_db()
    return delays


@override_settings(REPLICA_MAX_IDENTICAL_FAILURES=3, REPLICA_RETRY_BASE_S=30)
def test_a_crash_whose_last_line_carries_a_hex_address_counts_as_the_same_failure(client, node_secret):
    """Before: the address's letters survived the blanking (`#x#fab#cd`), each crash was a new reason, and
    8 replicas were placed, 30 s apart, the endpoint never FAILED."""
    endpoint = EndpointFactory(model_source=TINY, gpu_type="cpu", min_replicas=1)
    reasons = [f"RuntimeError: <vllm.engine.AsyncLLM object at 0x7f{h}> in /tmp/tmp{h}_q/model"
               for h in ("ab12cd", "ef34ab", "cd56ef", "ba78dc", "fe90ba", "dcabef", "aabbcc", "ccddee")]
    delays = fail_in_turn(client, node_secret, endpoint, reasons)
    assert Replica.objects.filter(endpoint=endpoint).count() == 3
    assert delays == [30, 60]
    assert endpoint.state == "FAILED" and endpoint.num_identical_failures == 3
    assert endpoint.status_message == f"failed: {reasons[2]}"


@pytest.mark.parametrize(("first", "second"), [
    ("<AsyncLLM object at 0x7fab12cd>", "<AsyncLLM object at 0x7fef34ab>"),
    ("OSError: /tmp/tmpk3j_x9z2/config.json", "OSError: /tmp/tmpq8wm_ab1/config.json"),
    ("shard 9f86d081884c7d65 is corrupt", "shard e3b0c44298fc1c14 is corrupt"),
    ("request 3f2a9c1e-77ab-4c2d-9e0f-1a2b3c4d5e6f died", "request 8d1e2f3a-1bcd-4ef0-8a9b-0c1d2e3f4a5b died"),
])
def test_reasons_that_differ_only_in_addresses_temp_names_and_ids_are_the_same_failure(first, second):
    assert failure_signature(first) == failure_signature(second)
    assert failure_signature("OSError: config.json not found") != failure_signature("ValueError: bad safetensors header")


@override_settings(REPLICA_MAX_IDENTICAL_FAILURES=3, REPLICA_RETRY_BASE_S=30)
def test_failures_whose_reasons_alternate_back_off_then_stop_the_endpoint(client, node_secret):
    """Before: two broken weight versions swapped in turn reset the count at each failure: a replica every
    30 s for ever (8 placed for 8 failures, delays all 30 s), the endpoint never FAILED."""
    endpoint = EndpointFactory(model_source=TINY, gpu_type="cpu", min_replicas=1)
    reasons = ["OSError: config.json not found", "ValueError: bad safetensors header"] * 5
    delays = fail_in_turn(client, node_secret, endpoint, reasons)
    assert Replica.objects.filter(endpoint=endpoint).count() == 6  # 2 x REPLICA_MAX_IDENTICAL_FAILURES
    assert delays == [30, 60, 120, 240, 480]
    assert endpoint.state == "FAILED" and endpoint.failed_at is not None
    assert endpoint.status_message == "failed: ValueError: bad safetensors header"
    for _ in range(3):  # ticks and calls keep coming: nothing more is placed
        scheduler.reconcile_endpoint(str(endpoint.pk), Load(0, 3, timezone.now().timestamp(), 3))
    assert Replica.objects.filter(endpoint=endpoint).count() == 6


@override_settings(REPLICA_MAX_IDENTICAL_FAILURES=50, REPLICA_RETRY_BASE_S=30)
def test_the_backoff_between_failures_is_capped(client, node_secret):
    endpoint = EndpointFactory(model_source=TINY, gpu_type="cpu", min_replicas=1)
    delays = fail_in_turn(client, node_secret, endpoint, ["engine exited"] * 9)
    assert delays == [30, 60, 120, 240, 480, 960, 1920, 3600, 3600]


@override_settings(REPLICA_MAX_IDENTICAL_FAILURES=2)
def test_a_replica_that_serves_starts_the_count_of_varied_failures_again(client, node_secret):
    endpoint = EndpointFactory(model_source=TINY, gpu_type="cpu", min_replicas=1)
    for state, reason in ((ReplicaState.FAILED, "out of memory"), (ReplicaState.FAILED, "bad header"),
                          (ReplicaState.FAILED, "out of memory"), (ReplicaState.READY, "")):
        Endpoint.objects.filter(pk=endpoint.pk).update(next_attempt_at=None)
        scheduler.reconcile_endpoint(str(endpoint.pk), IDLE)
        replica = Replica.objects.get(endpoint=endpoint, state=ReplicaState.PENDING)
        report = failed(replica, reason) if state == ReplicaState.FAILED else ReplicaStatus(
            replica_id=str(replica.pk), state=ReplicaState.READY, address="http://127.0.0.1:20001")
        beat(client, node_secret, replicas=[report])
        if state == ReplicaState.READY:
            break
        endpoint.refresh_from_db()
        assert endpoint.failed_at is None
    endpoint.refresh_from_db()
    assert (endpoint.num_failures_since_ready, endpoint.num_identical_failures, endpoint.next_attempt_at) == (0, 0, None)


@override_settings(REPLICA_MAX_IDENTICAL_FAILURES=2)
def test_a_replica_that_serves_starts_the_count_again(client, node_secret):
    endpoint = EndpointFactory(model_source=TINY, gpu_type="cpu", min_replicas=1)
    for state in (ReplicaState.FAILED, ReplicaState.READY):
        Endpoint.objects.filter(pk=endpoint.pk).update(next_attempt_at=None)
        scheduler.reconcile_endpoint(str(endpoint.pk), IDLE)
        replica = Replica.objects.get(endpoint=endpoint, state=ReplicaState.PENDING)
        report = failed(replica, "out of memory") if state == ReplicaState.FAILED else ReplicaStatus(
            replica_id=str(replica.pk), state=ReplicaState.READY, address="http://127.0.0.1:20001")
        beat(client, node_secret, replicas=[report])
    endpoint.refresh_from_db()
    assert endpoint.num_identical_failures == 0 and endpoint.next_attempt_at is None and endpoint.state == "READY"


@pytest.mark.parametrize("retry", ["update", "resume"])
def test_a_spec_change_or_a_resume_clears_the_failure_and_tries_again(owner_client, client, node_secret, retry):
    body = created_via_api(owner_client, min_replicas=1, max_model_len=4096)
    scheduler.reconcile_endpoint(body["id"], IDLE)
    [replica] = Replica.objects.filter(endpoint_id=body["id"])
    beat(client, node_secret, replicas=[failed(replica, permanent=True)])
    assert owner_client.get(f"/api/v1/endpoints/{body['id']}/").json()["state"] == "FAILED"

    if retry == "update":
        answer = owner_client.patch(f"/api/v1/endpoints/{body['id']}/", {"max_model_len": None}, format="json")
    else:
        answer = owner_client.post(f"/api/v1/endpoints/{body['id']}/resume/")
    assert answer.status_code == 200, answer.json()
    assert answer.json()["status_message"] == "" and answer.json()["failed_at"] is None
    scheduler.reconcile_endpoint(body["id"], IDLE)
    assert Replica.objects.filter(endpoint_id=body["id"], state=ReplicaState.PENDING).count() == 1
    assert owner_client.get(f"/api/v1/endpoints/{body['id']}/").json()["state"] == "STARTING"


def test_an_endpoint_that_cannot_be_placed_says_it_waits_for_capacity(owner_client):
    body = created_via_api(owner_client, min_replicas=1)
    scheduler.reconcile_endpoint(body["id"], IDLE)
    shown = owner_client.get(f"/api/v1/endpoints/{body['id']}/").json()
    assert shown["state"] == "WAITING_FOR_CAPACITY"
    assert shown["status_message"] == "waiting for capacity: no READY node of GPU type cpu"


def test_desired_replicas_of_a_node_carry_an_explicit_limit_when_the_endpoint_sets_one(client, node_secret):
    endpoint = EndpointFactory(model_source=TINY, gpu_type="cpu", min_replicas=1, max_model_len=1024)
    scheduler.reconcile_endpoint(str(endpoint.pk), IDLE)
    [spec] = desired_replicas(Replica.objects.get(endpoint=endpoint).node)
    assert spec.max_model_len == 1024


@pytest.mark.django_db(transaction=True)
def test_a_replica_whose_spec_cannot_be_built_fails_its_endpoint_before_its_reconcile_runs(monkeypatch):
    # Before: the replica was failed, its reconcile sent at once (no transaction), and only then the failure counted
    # (permanent): a worker taking the reconcile at once placed a new replica on the endpoint about to be FAILED.
    monkeypatch.setattr(controlplane_tasks.current_app, "send_task", lambda name, **kwargs: None)
    endpoint = EndpointFactory(gpu_type="l4", min_replicas=1, max_replicas=1)
    node = make_node(memory_mb=80_000)
    scheduler.reconcile_endpoint(str(endpoint.pk), IDLE)
    replica = Replica.objects.get(endpoint=endpoint)
    reconciled = []

    def a_worker_takes_it_at_once(name, **kwargs):
        if name == RECONCILE_TASK:
            reconciled.append(scheduler.reconcile_endpoint(*kwargs["args"], IDLE))

    def unbuildable(replica, model_contexts=None):
        raise ValueError("a field the protocol refuses")

    monkeypatch.setattr(controlplane_tasks.current_app, "send_task", a_worker_takes_it_at_once)
    monkeypatch.setattr(services, "replica_spec", unbuildable)
    assert desired_replicas(node) == []
    replica.refresh_from_db()
    endpoint.refresh_from_db()
    assert replica.state == ReplicaState.FAILED and endpoint.failed_at is not None
    assert reconciled and list(Replica.objects.filter(endpoint=endpoint).exclude(pk=replica.pk)) == []
