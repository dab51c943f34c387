from datetime import timedelta

import pytest
from django.db import connection
from django.test import Client
from django.utils import timezone

from controlplane.accounts.models import AuditEvent, Membership, Role
from endpoints.models import ENGINE_FIELDS, Endpoint, EndpointEvent, Replica
from endpoints.nodes.models import Node
from endpoints.replicas import place_replica
from gpu_agent.protocol import ReplicaState
from tests.factories import EndpointFactory, make_credential
from tests.test_placement import make_node

pytestmark = pytest.mark.django_db

VALID = {"name": "llama-chat", "model_source": "hf:meta-llama/Llama-3.1-8B-Instruct", "gpu_type": "l4"}


def test_creates_lists_retrieves_updates_and_deletes_an_endpoint(owner_client):
    created = owner_client.post("/api/v1/endpoints/", VALID, format="json")
    assert created.status_code == 201, created.json()
    body = created.json()
    assert body["name"] == "llama-chat"
    assert body["state"] == "SCALED_TO_ZERO"
    assert body["replicas"] == []
    assert body["quantization"] == "none"
    assert body["price_output_per_million"] == "0.300000"

    listed = owner_client.get("/api/v1/endpoints/").json()
    assert [e["name"] for e in listed["results"]] == ["llama-chat"]

    endpoint_url = f"/api/v1/endpoints/{body['id']}/"
    assert owner_client.get(endpoint_url).json()["model_source"] == VALID["model_source"]

    patched = owner_client.patch(endpoint_url, {"max_replicas": 4, "idle_timeout_s": 600}, format="json")
    assert patched.status_code == 200, patched.json()
    assert (patched.json()["max_replicas"], patched.json()["idle_timeout_s"]) == (4, 600)

    assert owner_client.delete(endpoint_url).status_code == 204
    assert owner_client.get(endpoint_url).status_code == 404
    assert owner_client.get("/api/v1/endpoints/").json()["results"] == []
    # Soft-deleted: usage and invoices keep their endpoint; the name is free again.
    assert Endpoint.objects.filter(pk=body["id"], deleted_at__isnull=False).exists()
    assert owner_client.post("/api/v1/endpoints/", VALID, format="json").status_code == 201


def test_pause_and_resume_change_the_state_and_log_events(owner_client):
    endpoint_id = owner_client.post("/api/v1/endpoints/", VALID, format="json").json()["id"]
    paused = owner_client.post(f"/api/v1/endpoints/{endpoint_id}/pause/")
    assert paused.status_code == 200
    assert paused.json()["state"] == "PAUSED"
    resumed = owner_client.post(f"/api/v1/endpoints/{endpoint_id}/resume/")
    assert resumed.json()["state"] == "SCALED_TO_ZERO"
    messages = list(EndpointEvent.objects.filter(endpoint_id=endpoint_id).values_list("message", flat=True))
    assert any("paused" in m for m in messages) and any("resumed" in m for m in messages)
    events = owner_client.get(f"/api/v1/endpoints/{endpoint_id}/events/").json()["results"]
    assert events[0]["message"] == "Endpoint resumed"


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"name": "Bad Name"}, "name"),
        ({"name": "-leading-hyphen"}, "name"),
        ({"name": "x" * 64}, "name"),
        ({"model_source": "ftp://models/llama"}, "model_source"),
        ({"model_source": "hf:no-slash"}, "model_source"),
        ({"model_source": "s3://A_BAD_BUCKET/x"}, "model_source"),
        ({"model_source": "/models/../etc"}, "model_source"),
        # an escape sequence the agent's log wrote into an operator's terminal (a window title; 0x9b is C1's CSI)
        ({"model_source": "s3://models-bucket/a\x1b]0;pwned\x07b"}, "model_source"),
        ({"model_source": "s3://models-bucket/a\x9b2Jb"}, "model_source"),
        ({"model_source": "/models/a\x1b[2Jb"}, "model_source"),
        ({"gpu_type": "tpu-v5"}, "gpu_type"),
        ({"quantization": "magic"}, "quantization"),
        ({"gpu_type": "cpu", "quantization": "awq"}, "quantization"),
        ({"min_replicas": -1}, "min_replicas"),
        ({"min_replicas": 101}, "min_replicas"),
        ({"max_replicas": 0}, "max_replicas"),
        ({"min_replicas": 3, "max_replicas": 2}, "max_replicas"),
        ({"idle_timeout_s": 29}, "idle_timeout_s"),
        ({"idle_timeout_s": 86_401}, "idle_timeout_s"),
        ({"target_concurrency": 0}, "target_concurrency"),
        ({"max_model_len": 8}, "max_model_len"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_seqs": 64, "max_num_batched_tokens": 32}, "max_num_batched_tokens"),
        ({"cold_start_timeout_s": 5}, "cold_start_timeout_s"),
        ({"min_replicas": "two"}, "min_replicas"),
        ({"surprise": 1}, "surprise"),
        ({"state": "READY"}, "state"),
        ({"price_output_per_million": "0"}, "price_output_per_million"),
    ],
)
def test_rejects_each_invalid_spec_with_a_field_error_and_writes_nothing(owner_client, changes, field):
    response = owner_client.post("/api/v1/endpoints/", VALID | changes, format="json")
    assert response.status_code == 400, response.json()
    assert field in response.json(), response.json()
    assert Endpoint.objects.count() == 0
    assert not AuditEvent.objects.filter(action="endpoint.create").exists()


def test_requires_name_source_and_gpu_type(owner_client):
    response = owner_client.post("/api/v1/endpoints/", {}, format="json")
    assert response.status_code == 400
    assert set(response.json()) == {"name", "model_source", "gpu_type"}


def test_rejects_a_duplicate_name_in_the_same_organisation_only(owner_client, member_client_factory):
    assert owner_client.post("/api/v1/endpoints/", VALID, format="json").status_code == 201
    duplicate = owner_client.post("/api/v1/endpoints/", VALID, format="json")
    assert duplicate.status_code == 400 and "name" in duplicate.json()
    from tests.factories import OrganizationFactory

    other = member_client_factory(OrganizationFactory())
    assert other.post("/api/v1/endpoints/", VALID, format="json").status_code == 201


def test_patch_validates_against_the_stored_spec(owner_client):
    endpoint = owner_client.post("/api/v1/endpoints/", VALID | {"min_replicas": 0, "max_replicas": 2}, format="json").json()
    response = owner_client.patch(f"/api/v1/endpoints/{endpoint['id']}/", {"min_replicas": 3}, format="json")
    assert response.status_code == 400 and "max_replicas" in response.json()
    assert Endpoint.objects.get(pk=endpoint["id"]).min_replicas == 0


def test_local_paths_follow_the_setting(owner_client, settings):
    settings.ALLOW_LOCAL_MODEL_PATHS = False
    refused = owner_client.post("/api/v1/endpoints/", VALID | {"model_source": "/models/tiny"}, format="json")
    assert refused.status_code == 400 and "disabled" in refused.json()["model_source"][0]
    settings.ALLOW_LOCAL_MODEL_PATHS = True
    assert owner_client.post("/api/v1/endpoints/", VALID | {"model_source": "/models/tiny"}, format="json").status_code == 201


def test_malformed_json_is_a_400(owner_client):
    response = owner_client.generic("POST", "/api/v1/endpoints/", "{not json", content_type="application/json")
    assert response.status_code == 400


def test_openapi_schema_describes_the_endpoints_api(owner_client):
    response = owner_client.get("/api/schema/", HTTP_ACCEPT="application/json")
    assert response.status_code == 200
    schema = response.json()
    assert "/api/v1/endpoints/" in schema["paths"]
    assert "/api/v1/endpoints/{id}/pause/" in schema["paths"]


def test_viewers_read_but_cannot_write(org, member_client_factory):
    owner = member_client_factory(org, Role.OWNER)
    viewer = member_client_factory(org, Role.VIEWER)
    endpoint = owner.post("/api/v1/endpoints/", VALID, format="json").json()
    assert viewer.get(f"/api/v1/endpoints/{endpoint['id']}/").status_code == 200
    assert viewer.post("/api/v1/endpoints/", VALID | {"name": "other"}, format="json").status_code == 403
    assert viewer.patch(f"/api/v1/endpoints/{endpoint['id']}/", {"max_replicas": 3}, format="json").status_code == 403
    assert viewer.post(f"/api/v1/endpoints/{endpoint['id']}/pause/").status_code == 403
    assert viewer.delete(f"/api/v1/endpoints/{endpoint['id']}/").status_code == 403
    member = member_client_factory(org, Role.MEMBER)
    assert member.patch(f"/api/v1/endpoints/{endpoint['id']}/", {"max_replicas": 3}, format="json").status_code == 200


def test_a_replicas_node_is_shown_to_owners_and_admins_only_and_its_engine_address_to_nobody(org, member_client_factory):
    """Before, every role, viewers included, was shown each replica's engine address (a node's host and port) and its
    node's name and id."""
    endpoint = EndpointFactory(organization=org, min_replicas=1)
    node = make_node(memory_mb=80_000)
    Replica.objects.create(endpoint=endpoint, node=node, state=ReplicaState.READY, address="http://10.20.30.40:8101")
    for role, shows_node in ((Role.OWNER, True), (Role.ADMIN, True), (Role.MEMBER, False), (Role.VIEWER, False)):
        detail = member_client_factory(org, role).get(f"/api/v1/endpoints/{endpoint.pk}/")
        (replica,) = detail.json()["replicas"]
        assert "address" not in replica and "10.20.30.40" not in detail.content.decode(), role
        assert (replica["node"], replica["node_id"]) == ((node.name, str(node.pk)) if shows_node else (None, None)), role


def test_no_text_a_member_reads_names_the_node_a_replica_ran_on(org, member_client_factory, settings):
    """Before, the placement event said "placed on <node>" and a silent node's replicas failed with "node <node> stopped
    sending heartbeats": node names (host names of the fleet) reached members and viewers, past the rule above."""
    from endpoints.scheduler import reconcile_endpoint, sweep_stuck

    settings.NODE_HEARTBEAT_GRACE_S = 30
    endpoint = EndpointFactory(organization=org, min_replicas=1, model_source="hf:org/tiny-model", gpu_type="l4")
    node = make_node(memory_mb=80_000)
    reconcile_endpoint(str(endpoint.pk))
    Replica.objects.filter(endpoint=endpoint).update(state=ReplicaState.READY)
    Node.objects.filter(pk=node.pk).update(last_heartbeat_at=timezone.now() - timedelta(seconds=31))
    sweep_stuck()
    assert Replica.objects.get(endpoint=endpoint).state == ReplicaState.FAILED
    for role in (Role.MEMBER, Role.VIEWER):
        client = member_client_factory(org, role)
        detail = client.get(f"/api/v1/endpoints/{endpoint.pk}/").content.decode()
        events = client.get(f"/api/v1/endpoints/{endpoint.pk}/events/").content.decode()
        assert "placed (" in events and "its node stopped sending heartbeats" in detail, role
        assert node.name not in detail and node.name not in events, role
    console = Client()
    console.force_login(Membership.objects.filter(organization=org, role=Role.VIEWER).first().user)
    page = console.get(f"/console/endpoints/{endpoint.pk}/").content.decode()
    assert "placed (" in page and node.name not in page


def test_lists_and_pages_read_the_live_replicas_and_the_latest_ended_not_every_one_ever(owner_client, org):
    # Rows are kept: an endpoint scaling up and down for months had tens of thousands of ended replicas, all read with
    # their nodes by every list, detail and console poll (every 3 s).
    endpoint = EndpointFactory(organization=org, min_replicas=1)
    node = make_node(memory_mb=80_000)
    now = timezone.now()
    Replica.objects.bulk_create(Replica(endpoint=endpoint, node=node, state=ReplicaState.STOPPED,
                                        state_changed_at=now - timedelta(minutes=i)) for i in range(1, 301))
    failed = Replica.objects.create(endpoint=endpoint, node=node, state=ReplicaState.FAILED, state_changed_at=now,
                                    failure_reason="out of memory")
    ready = Replica.objects.create(endpoint=endpoint, node=node, state=ReplicaState.READY, address="http://127.0.0.1:9")
    read = []

    def count_replica_rows(execute, sql, params, many, context):
        result = execute(sql, params, many, context)
        if '"endpoints_replica"' in sql.split(" FROM ", 1)[-1][:40]:
            read.append(context["cursor"].rowcount)
        return result

    with connection.execute_wrapper(count_replica_rows):
        detail = owner_client.get(f"/api/v1/endpoints/{endpoint.pk}/").json()
        listed = owner_client.get("/api/v1/endpoints/").json()
        console = Client()
        console.force_login(owner_client.user)
        page = console.get(f"/console/endpoints/{endpoint.pk}/")

    assert [r["id"] for r in detail["replicas"]][0] == str(ready.pk) and str(failed.pk) == detail["replicas"][-1]["id"]
    assert len(detail["replicas"]) == 1 + 5 and detail["state"] == listed["results"][0]["state"] == "READY"
    assert page.status_code == 200 and "out of memory" in page.content.decode()
    assert sum(read) <= 3 * (1 + 5), read


def test_a_change_to_what_the_engine_starts_with_replaces_the_replicas_and_a_scaling_change_does_not(owner_client, org):
    # A replica keeps the configuration it started with for as long as it runs, while calls were checked, reserved
    # and billed by the new one: a max_model_len lowered to 16 reserved a 30k-token prompt on a 32k engine as 16
    # tokens, and an H200 replica of an endpoint moved to "l4" served at an L4's prices.
    endpoint = EndpointFactory(organization=org, min_replicas=1, max_replicas=2, gpu_type="h200", max_model_len=8192)
    node = make_node(gpu_type="h200", memory_mb=141_000)
    ready = Replica.objects.create(endpoint=endpoint, node=node, state=ReplicaState.READY, address="http://127.0.0.1:9")

    assert owner_client.patch(f"/api/v1/endpoints/{endpoint.pk}/", {"max_replicas": 3}, format="json").status_code == 200
    ready.refresh_from_db()
    assert ready.state == ReplicaState.READY  # scaling is read live: nothing restarts

    answer = owner_client.patch(f"/api/v1/endpoints/{endpoint.pk}/", {"max_model_len": 1024}, format="json")
    assert answer.status_code == 200, answer.json()
    ready.refresh_from_db()
    assert ready.state == ReplicaState.DRAINING
    assert endpoint.events.filter(message__contains="previous max_model_len; replaced").exists()
    endpoint.refresh_from_db()
    assert (endpoint.engine_generation, ready.engine_generation) == (1, 0)  # the gateway sends it no call
    replacement, _ = place_replica(endpoint)
    assert replacement.node == node and replacement.engine_generation == 1


@pytest.mark.parametrize("field", sorted(ENGINE_FIELDS))
def test_every_engine_field_is_an_endpoint_field_the_replica_spec_reads(field):
    import inspect

    from endpoints.fleet import services as fleet_services
    from endpoints.speculative import speculative_spec

    Endpoint._meta.get_field(field)
    read = inspect.getsource(fleet_services.replica_spec) + inspect.getsource(speculative_spec)
    # placement's, not the spec's; the credential is the spec's source access (`source_access(endpoint)`)
    assert f"endpoint.{field}" in read or field in ("gpu_type", "allow_gpu_sharing", "credential")


def test_another_credential_replaces_the_replicas(owner_client, org):
    # Another credential is another copy of the weights (its own scope, its own facts): the replicas read the old one.
    endpoint = EndpointFactory(organization=org, min_replicas=1)
    ready = Replica.objects.create(endpoint=endpoint, node=make_node(), state=ReplicaState.READY, address="http://127.0.0.1:9")
    credential = make_credential(org, kind="hf")
    answer = owner_client.patch(f"/api/v1/endpoints/{endpoint.pk}/", {"credential": str(credential.pk)}, format="json")
    assert answer.status_code == 200, answer.json()
    ready.refresh_from_db()
    endpoint.refresh_from_db()
    assert ready.state == ReplicaState.DRAINING and endpoint.engine_generation == 1
