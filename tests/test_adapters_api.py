"""LoRA adapters through `/api/v1/endpoints/{id}/adapters/`: created with field errors for what the
endpoint cannot serve, listed with the `model` calls name, deleted; another organisation's endpoint
is a 404; the replica spec carries them to the agent, and an agent's reports show on the adapter."""

import threading
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.utils import timezone

from controlplane.accounts.services import SYSTEM
from endpoints import adapters, services
from endpoints import serializers as endpoint_serializers
from endpoints.adapters import record_replica_adapters, want_adapter
from endpoints.fleet.services import desired_replicas, replica_spec
from endpoints.models import Adapter, ModelCredential, ModelFacts, Replica
from endpoints.nodes.models import Node
from gpu_agent.protocol import ReplicaState, ReplicaStatus
from tests.conftest import wait_until
from tests.factories import EndpointFactory, OrganizationFactory, make_credential
from tests.test_roles import _waiting_on_a_lock

pytestmark = pytest.mark.django_db

ADAPTER = {"name": "support-tone", "source": "s3://tuned-adapters/support", "rank": 8}


def url(endpoint) -> str:
    return f"/api/v1/endpoints/{endpoint.pk}/adapters/"


@pytest.fixture
def lora_endpoint(org):
    return EndpointFactory(organization=org, name="llama", max_loras=2, max_lora_rank=16)


def test_an_adapter_created_through_the_api_is_listed_with_the_model_name_calls_use(owner_client, lora_endpoint):
    created = owner_client.post(url(lora_endpoint), ADAPTER, format="json")
    assert created.status_code == 201, created.json()
    assert created.json()["model"] == "llama:support-tone" and created.json()["state"] == "PENDING"
    listed = owner_client.get(url(lora_endpoint)).json()
    assert [row["model"] for row in listed["results"]] == ["llama:support-tone"]
    deleted = owner_client.delete(f"{url(lora_endpoint)}{created.json()['id']}/")
    assert deleted.status_code == 204 and not Adapter.objects.exists()


def test_an_adapter_cannot_bear_its_endpoints_name_nor_an_endpoint_one_of_its_adapters(owner_client, lora_endpoint):
    # The endpoint's name is its engines' served model name: vLLM refuses an adapter so named ("conflicts with a served
    # base model"), so it could never load. Before, the API answered 201.
    refused = owner_client.post(url(lora_endpoint), ADAPTER | {"name": lora_endpoint.name}, format="json")
    assert refused.status_code == 400 and "endpoint's name" in refused.json()["name"][0]
    assert owner_client.post(url(lora_endpoint), ADAPTER, format="json").status_code == 201
    renamed = owner_client.patch(f"/api/v1/endpoints/{lora_endpoint.pk}/", {"name": ADAPTER["name"]}, format="json")
    assert renamed.status_code == 400 and "adapter with this name" in renamed.json()["name"][0]
    assert not Adapter.objects.filter(name=lora_endpoint.name).exists()


def test_an_adapter_above_the_endpoints_rank_limit_is_refused_with_a_field_error(owner_client, lora_endpoint):
    refused = owner_client.post(url(lora_endpoint), ADAPTER | {"rank": 64}, format="json")
    assert refused.status_code == 400
    assert "up to rank 16" in refused.json()["rank"][0]


def test_an_endpoint_without_adapter_slots_refuses_adapters(owner_client, org):
    endpoint = EndpointFactory(organization=org, name="plain")
    refused = owner_client.post(url(endpoint), ADAPTER, format="json")
    assert refused.status_code == 400 and "max_loras" in refused.json()["endpoint"][0]


def test_an_endpoint_keeps_at_most_its_cap_of_adapters(owner_client, lora_endpoint, monkeypatch):
    # Nothing bounded them: thousands, each in every replica's spec on every heartbeat (credentials decrypted), made
    # a heartbeat's answer megabytes, past the agent's timeout: the node went OFFLINE with every tenant's replica.
    Adapter.objects.bulk_create(Adapter(endpoint=lora_endpoint, name=f"a{i}", source="s3://tuned-adapters/a")
                                for i in range(adapters.MAX_ADAPTERS))

    refused = owner_client.post(url(lora_endpoint), ADAPTER, format="json")
    assert refused.status_code == 400 and "at most 256 adapters" in refused.json()["endpoint"][0]

    # Two creations at once both pass the serializer's count: the service counts again under the endpoint's lock.
    monkeypatch.setattr(endpoint_serializers, "MAX_ADAPTERS", adapters.MAX_ADAPTERS + 1)
    raced = owner_client.post(url(lora_endpoint), ADAPTER, format="json")
    assert raced.status_code == 400 and "at most 256 adapters" in raced.json()["endpoint"][0]
    assert Adapter.objects.filter(endpoint=lora_endpoint).count() == adapters.MAX_ADAPTERS


def test_bad_sources_names_and_credentials_are_field_errors(owner_client, org, lora_endpoint):
    hf_token = make_credential(org, name="hub", kind="hf", hf_token="hf_x")
    refused = owner_client.post(
        url(lora_endpoint), {"name": "Bad Name", "source": "ftp://x", "credential": str(hf_token.pk)}, format="json")
    assert refused.status_code == 400 and {"name", "source"} <= refused.json().keys()
    wrong_kind = owner_client.post(url(lora_endpoint), ADAPTER | {"credential": str(hf_token.pk)}, format="json")
    assert wrong_kind.status_code == 400 and "S3" in wrong_kind.json()["credential"][0]
    owner_client.post(url(lora_endpoint), ADAPTER, format="json")
    twice = owner_client.post(url(lora_endpoint), ADAPTER, format="json")
    assert twice.status_code == 400 and "already" in twice.json()["name"][0]


def test_another_organisations_endpoint_and_credential_are_not_found(owner_client, lora_endpoint):
    other = OrganizationFactory()
    foreign = EndpointFactory(organization=other, name="theirs", max_loras=2)
    assert owner_client.get(url(foreign)).status_code == 404
    assert owner_client.post(url(foreign), ADAPTER, format="json").status_code == 404
    their_credential = make_credential(other, name="theirs")
    refused = owner_client.post(url(lora_endpoint), ADAPTER | {"credential": str(their_credential.pk)}, format="json")
    assert refused.status_code == 400 and "credential" in refused.json()


def test_the_replica_spec_carries_lora_slots_and_the_adapters_callers_want(org, lora_endpoint):
    credential = make_credential(org, name="bucket")
    adapter = Adapter.objects.create(endpoint=lora_endpoint, name="tone", source="s3://tuned/tone", credential=credential)
    spec = replica_spec(Replica.objects.create(endpoint=lora_endpoint))
    assert (spec.max_loras, spec.max_lora_rank) == (2, 16)
    assert [(a.name, a.wanted_at) for a in spec.adapters] == [("tone", 0.0)]
    assert spec.adapters[0].credentials is not None and spec.without_secrets().adapters[0].credentials is None
    want_adapter(adapter.pk)
    assert replica_spec(Replica.objects.create(endpoint=lora_endpoint)).adapters[0].wanted_at > 0


def test_a_replicas_spec_carries_at_most_the_cap_of_adapters_the_latest_wanted_first(lora_endpoint):
    # Stored before the cap: every one was in every replica's spec on every heartbeat.
    Adapter.objects.bulk_create(Adapter(endpoint=lora_endpoint, name=f"a{i}", source="s3://tuned-adapters/a")
                                for i in range(adapters.MAX_ADAPTERS + 44))
    wanted = Adapter.objects.get(endpoint=lora_endpoint, name="a299")
    want_adapter(wanted.pk)

    spec = replica_spec(Replica.objects.create(endpoint=lora_endpoint))

    assert len(spec.adapters) == adapters.MAX_ADAPTERS and spec.adapters[0].name == "a299"


def test_the_adapter_wanted_last_comes_first_whatever_the_clock_of_the_gateway_that_wanted_the_other(
        lora_endpoint, monkeypatch):
    """Which adapters a replica holds, and which its agent lets go first, follow when calls last wanted them
    (`Adapter.last_requested_at`); each gateway stamped it by its own clock: one 10 minutes ahead put an adapter
    wanted once before the one every call now names, for 10 minutes (past the cap, the one in use left out)."""
    earlier = Adapter.objects.create(endpoint=lora_endpoint, name="earlier", source="s3://tuned-adapters/a")
    later = Adapter.objects.create(endpoint=lora_endpoint, name="later", source="s3://tuned-adapters/b")
    real_now = timezone.now
    with monkeypatch.context() as gateway_ahead:
        gateway_ahead.setattr(timezone, "now", lambda: real_now() + timedelta(minutes=10))
        want_adapter(earlier.pk)
    want_adapter(later.pk)  # through a gateway whose clock is right

    spec = replica_spec(Replica.objects.create(endpoint=lora_endpoint))

    assert [adapter.name for adapter in spec.adapters] == ["later", "earlier"]


def test_an_adapter_whose_credential_cannot_be_read_fails_alone_and_the_heartbeat_is_answered(lora_endpoint):
    # Its credential encrypted with a key since dropped raised out of the node's heartbeat: a 500 for every tenant's
    # replica on the node, until it went OFFLINE.
    credential = make_credential(lora_endpoint.organization)
    Adapter.objects.create(endpoint=lora_endpoint, name="locked", source="s3://tuned-adapters/locked",
                           credential=credential)
    Adapter.objects.create(endpoint=lora_endpoint, name="open", source="s3://tuned-adapters/open")
    ModelCredential.objects.filter(pk=credential.pk).update(encrypted_secrets="gAAAAABnot-a-token-any-key-reads")
    node = Node.objects.create(name="gpu-1", state="READY")
    replica = Replica.objects.create(endpoint=lora_endpoint, node=node, state=ReplicaState.READY)

    [spec] = desired_replicas(node)

    assert [adapter.name for adapter in spec.adapters] == ["open"] and spec.replica_id == str(replica.pk)
    locked = Adapter.objects.get(name="locked")
    assert locked.state == "FAILED" and "cannot be used" in locked.status_message
    assert Replica.objects.get(pk=replica.pk).state == ReplicaState.READY


def test_the_adapters_of_an_endpoint_whose_model_turns_out_to_embed_fail_saying_so_and_reach_no_engine(lora_endpoint):
    # An "auto" endpoint takes adapters while its model is unread; an embedding model's engine runs without LoRA. The
    # agent was sent them anyway and asked the engine to load each one a call named: the engine has no such route, and
    # the adapter failed as "Not Found", the reason every call naming it was answered.
    Adapter.objects.create(endpoint=lora_endpoint, name="tone", source="s3://tuned-adapters/tone")
    ModelFacts.objects.create(source=lora_endpoint.model_source, architecture="BertModel", max_model_len=512)

    spec = replica_spec(Replica.objects.create(endpoint=lora_endpoint))

    assert spec.adapters == []
    tone = Adapter.objects.get(name="tone")
    assert tone.state == "FAILED" and not tone.failure_retried
    assert tone.status_message == adapters.EMBEDDING_SERVES_NO_ADAPTERS
    assert lora_endpoint.events.filter(message__contains="serves no LoRA adapters").count() == 1
    replica_spec(Replica.objects.create(endpoint=lora_endpoint))  # the next heartbeat writes nothing again
    assert lora_endpoint.events.filter(message__contains="serves no LoRA adapters").count() == 1


def test_the_adapters_failed_for_an_embedding_model_load_again_once_the_endpoint_serves_a_generating_one(
        owner_client, lora_endpoint):
    # Failed "for good" (not retried), the gateway answered every call naming them 400 `adapter_failed` ("its
    # endpoint's model is an embedding model") before marking them wanted, and the agent loads only wanted ones:
    # after the owner replaced the model by a generating one, they stayed refused for good with a reason untrue.
    Adapter.objects.create(endpoint=lora_endpoint, name="tone", source="s3://tuned-adapters/tone")
    ModelFacts.objects.create(source=lora_endpoint.model_source, architecture="BertModel", max_model_len=512)
    replica_spec(Replica.objects.create(endpoint=lora_endpoint))
    assert Adapter.objects.get(name="tone").state == "FAILED"
    ModelFacts.objects.create(source="hf:Qwen/Qwen2.5-0.5B-Instruct", architecture="Qwen2ForCausalLM",
                              max_model_len=8192)

    edited = owner_client.patch(f"/api/v1/endpoints/{lora_endpoint.pk}/",
                                {"model_source": "hf:Qwen/Qwen2.5-0.5B-Instruct"}, format="json")

    assert edited.status_code == 200, edited.content
    [tone] = owner_client.get(url(lora_endpoint)).json()["results"]
    assert (tone["state"], tone["status_message"]) == ("PENDING", "")
    lora_endpoint.refresh_from_db()
    spec = replica_spec(Replica.objects.create(endpoint=lora_endpoint))
    assert [adapter.name for adapter in spec.adapters] == ["tone"]


def test_an_agents_report_marks_adapters_loaded_or_refused_with_the_engines_reason(lora_endpoint):
    node = Node.objects.create(name="gpu-1")
    replica = Replica.objects.create(endpoint=lora_endpoint, node=node)
    Adapter.objects.create(endpoint=lora_endpoint, name="good", source="/a/good")
    Adapter.objects.create(endpoint=lora_endpoint, name="big", source="/a/big")
    record_replica_adapters(node, ReplicaStatus(
        replica_id=str(replica.pk), state=ReplicaState.READY, adapters=["good"],
        adapter_failures={"big": "LoRA rank 64 is greater than max_lora_rank 16."},
    ))
    replica.refresh_from_db()
    assert replica.adapters == ["good"]
    states = dict(Adapter.objects.values_list("name", "state"))
    assert states == {"good": "READY", "big": "FAILED"}
    assert "greater than max_lora_rank" in Adapter.objects.get(name="big").status_message



def test_a_tenant_cannot_price_its_own_adapter_and_the_endpoint_takes_only_vllms_lora_ranks(owner_client, lora_endpoint):
    # A price is what the platform charges: an adapter priced at zero by its tenant was free inference.
    for prices in ({"price_output_per_million": "0"}, {"price_input_per_million": "0", "price_output_per_million": "0"},
                   {"price_input_per_million": "3.5"}):
        refused = owner_client.post(url(lora_endpoint), ADAPTER | prices, format="json")
        assert refused.status_code == 400 and set(refused.json()) == set(prices)
        assert "read-only" in refused.json()[next(iter(prices))][0]
    created = owner_client.post(url(lora_endpoint), ADAPTER, format="json")
    assert created.status_code == 201
    assert (created.json()["price_input_per_million"], created.json()["price_output_per_million"]) == (None, None)
    bad_rank = owner_client.patch(f"/api/v1/endpoints/{lora_endpoint.pk}/", {"max_lora_rank": 7}, format="json")
    assert bad_rank.status_code == 400 and "max_lora_rank" in bad_rank.json()
    slots = owner_client.patch(f"/api/v1/endpoints/{lora_endpoint.pk}/", {"max_loras": 4, "max_lora_rank": 32}, format="json")
    assert slots.status_code == 200 and (slots.json()["max_loras"], slots.json()["max_lora_rank"]) == (4, 32)


def test_the_migration_clears_the_prices_tenants_had_set_on_their_adapters(owner_client, lora_endpoint):
    import importlib

    from django.apps import apps

    from endpoints.models import Adapter

    created = owner_client.post(url(lora_endpoint), ADAPTER, format="json").json()
    Adapter.objects.filter(pk=created["id"]).update(price_input_per_million=0, price_output_per_million=0)
    migration = importlib.import_module("endpoints.migrations.0017_adapter_prices_are_staffs")
    migration.clear_tenant_prices(apps, None)
    adapter = Adapter.objects.get(pk=created["id"])
    assert (adapter.price_input_per_million, adapter.price_output_per_million) == (None, None)


@pytest.mark.django_db(transaction=True)
def test_an_adapter_added_while_its_endpoint_is_deleted_is_a_404_and_leaves_no_row(owner_client, lora_endpoint):
    """Before, the adapter's create read the endpoint live, then waited on its row for the deletion and, once it
    committed, added the adapter to the deleted endpoint anyway: a 201, and an adapter, event and audit row on it."""
    deleted, done = threading.Event(), threading.Event()

    def delete_and_hold():
        try:
            with transaction.atomic():
                services.delete_endpoint(SYSTEM, lora_endpoint)
                deleted.set()
                wait_until(_waiting_on_a_lock, 60, message="the adapter's create to wait on the endpoint")
        finally:
            connection.close()
            done.set()

    threading.Thread(target=delete_and_hold).start()
    assert deleted.wait(30)
    created = owner_client.post(url(lora_endpoint), ADAPTER, format="json")
    assert done.wait(60)

    assert created.status_code == 404, created.content
    assert not Adapter.objects.exists()
    assert owner_client.get(url(lora_endpoint)).status_code == 404
