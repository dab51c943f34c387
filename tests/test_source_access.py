"""Who reads a model source with what: an organisation's credential, the fleet's own (public catalogue
only), or nobody's (anonymous); and the credentials reach only the node running that replica."""

import logging

import pytest
from cryptography.fernet import Fernet

from controlplane import secrets
from controlplane.accounts.models import AuditEvent
from controlplane.accounts.services import SYSTEM
from endpoints.credentials import source_access
from endpoints.fleet.services import create_join_token
from endpoints.gateway import directory
from endpoints.models import Adapter, AllowedSource, ModelCredential, Replica, organization_scope
from endpoints.nodes.models import Node
from endpoints.replicas import record_chat_template_tokens
from gpu_agent.protocol import ChatTemplateTokens, Heartbeat, HeartbeatResponse, ReplicaState, ReplicaStatus
from tests.factories import (
    AWS_SECRET,
    HF_SECRET,
    EndpointFactory,
    OrganizationFactory,
    make_credential,
    sign_in_staff,
)

pytestmark = pytest.mark.django_db

PUBLIC_BUCKET = "s3://inferplane-public-models/"
PUBLIC_REPO = "hf:meta-llama/Llama-3.1-8B-Instruct"
NODE_ID = "9b1f0c1e-0000-4000-8000-000000000001"  # the node whose engine counted a chat template
REPLICA_ID = "5c7e0a2d-0000-4000-8000-000000000001"  # its replica (a shared copy's claims are by node)


@pytest.fixture(autouse=True)
def catalogue(db):
    AllowedSource.objects.create(pattern=PUBLIC_BUCKET)
    AllowedSource.objects.create(pattern=PUBLIC_REPO)


def access(source, credential=None, organization=None):
    organization = organization or (credential.organization if credential else OrganizationFactory())
    return source_access(EndpointFactory(organization=organization, model_source=source, credential=credential))


@pytest.mark.parametrize("source", [
    PUBLIC_REPO, PUBLIC_REPO + "@main", PUBLIC_BUCKET + "llama-3.1-8b", PUBLIC_BUCKET + "qwen/2.5/",
])
def test_a_catalogue_source_without_credential_uses_the_fleets_access_and_a_shared_cache(source):
    answer = access(source)
    assert answer.credentials is None and answer.use_fleet_credentials is True and answer.weights_scope == ""


@pytest.mark.parametrize("source", [
    "hf:meta-llama/Llama-3.1-8B-Instruct-private",     # an exact entry is no prefix
    "hf:someone/private-model",
    "s3://inferplane-public-models-secret/llama",       # a bucket whose name starts like a listed one
    "s3://inferplane-public-models",                    # the bucket, not the listed folder
    "s3://inferplane-public-models//etc/passwd",        # empty segments
    "s3://inferplane-public-models/a/../../other",      # dot segments
    "s3://inferplane-public-models/%2e%2e/other",       # encoded ones
    "s3://another-tenants-bucket/weights",
    "/models/tiny",
])
def test_anything_else_without_credential_is_read_anonymously_and_cached_for_the_organisation_only(source):
    organization = OrganizationFactory()
    answer = access(source, organization=organization)
    assert answer.credentials is None and answer.use_fleet_credentials is False
    assert answer.weights_scope == organization_scope(organization.pk) != ""


@pytest.mark.parametrize("source", ["s3://our-bucket/llama", PUBLIC_BUCKET + "llama-3.1-8b"])
def test_an_endpoint_with_a_credential_uses_it_never_the_fleets(source):
    credential = make_credential(OrganizationFactory(), session_token="tok")
    answer = access(source, credential)
    assert answer.use_fleet_credentials is False
    assert answer.weights_scope == organization_scope(credential.organization_id)
    assert answer.credentials.kind == "s3" and answer.credentials.secret_access_key == AWS_SECRET
    assert answer.credentials.access_key_id == "AKIAEXAMPLEKEY000001" and answer.credentials.session_token == "tok"
    assert answer.credentials.external_id == credential.external_id
    assert AWS_SECRET not in repr(answer) and AWS_SECRET not in repr(answer.credentials)


def test_a_hugging_face_credential_carries_its_token():
    credential = make_credential(OrganizationFactory(), kind="hf", name="hub")
    answer = access("hf:our-org/gated-model", credential)
    assert answer.credentials.kind == "hf" and answer.credentials.hf_token == HF_SECRET


def test_two_organisations_reading_the_same_private_source_never_share_a_cache():
    first, second = access("hf:someone/model"), access("hf:someone/model")
    assert first.weights_scope != second.weights_scope


def test_using_a_credential_marks_it_used():
    credential = make_credential(OrganizationFactory())
    access("s3://our-bucket/llama", credential)
    assert ModelCredential.objects.get(pk=credential.pk).last_used_at is not None


def test_a_credential_unreadable_with_the_configured_keys_is_sent_as_none(settings, caplog):
    credential = make_credential(OrganizationFactory())
    original = list(settings.ENCRYPTION_KEYS)
    settings.ENCRYPTION_KEYS = [Fernet.generate_key().decode()]
    secrets.reset_keys()
    try:
        answer = access("s3://our-bucket/llama", credential)
    finally:
        settings.ENCRYPTION_KEYS = original
        secrets.reset_keys()
    assert answer.credentials is None and answer.use_fleet_credentials is False
    assert "cannot be read" in caplog.text


# --- over the agent channel ---------------------------------------------------------------------

REGISTRATION = {"gpu_type": "cpu", "num_gpus": 0, "gpu_memory_mb": 8192, "num_cpus": 2, "memory_mb": 24000,
                "agent_version": "0.1.0", "supported_quantizations": ["none"]}


def register(client, name):
    token = create_join_token(SYSTEM, name=name).plain
    answer = client.post("/agent/v1/register", REGISTRATION | {"name": name, "join_token": token},
                         content_type="application/json").json()
    return Node.objects.get(pk=answer["node_id"]), answer["node_secret"]


def beat(client, secret):
    body = Heartbeat(agent_version="0.1.0", num_cpus=2, memory_mb=24000, memory_used_mb=1000).to_dict()
    response = client.post("/agent/v1/heartbeat", body, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {secret}")
    assert response.status_code == 200
    return response


def test_a_replicas_credentials_go_only_to_the_node_that_runs_it(client, caplog):
    caplog.set_level(logging.DEBUG)
    ours, ours_secret = register(client, "gpu-ours")
    other, other_secret = register(client, "gpu-other")
    credential = make_credential(OrganizationFactory())
    private = EndpointFactory(organization=credential.organization, model_source="s3://our-bucket/llama", credential=credential)
    public = EndpointFactory(model_source=PUBLIC_REPO)
    replica = Replica.objects.create(endpoint=private, node=ours, state=ReplicaState.STARTING)
    Replica.objects.create(endpoint=public, node=other, state=ReplicaState.STARTING)

    answer = beat(client, ours_secret)
    [spec] = HeartbeatResponse.from_dict(answer.json()).desired
    assert spec.replica_id == str(replica.pk)
    assert spec.credentials.secret_access_key == AWS_SECRET and spec.use_fleet_credentials is False
    assert spec.weights_scope == organization_scope(credential.organization_id)

    elsewhere = beat(client, other_secret)
    [other_spec] = HeartbeatResponse.from_dict(elsewhere.json()).desired
    assert other_spec.credentials is None and other_spec.use_fleet_credentials is True
    assert AWS_SECRET not in elsewhere.content.decode() and "AKIAEXAMPLEKEY" not in elsewhere.content.decode()

    # Nothing the control plane keeps or logs holds the secret.
    assert AWS_SECRET not in str(Node.objects.filter(pk__in=[ours.pk, other.pk]).values_list("last_status", flat=True))
    assert AWS_SECRET not in caplog.text


def test_a_stopped_replicas_credentials_are_not_sent_again(client):
    node, secret = register(client, "gpu-1")
    credential = make_credential(OrganizationFactory())
    endpoint = EndpointFactory(organization=credential.organization, model_source="s3://our-bucket/llama", credential=credential)
    Replica.objects.create(endpoint=endpoint, node=node, state=ReplicaState.STOPPED)
    assert AWS_SECRET not in beat(client, secret).content.decode()


def test_a_stored_role_in_the_platforms_account_fails_its_replica_with_the_reason_and_is_never_sent(client, settings):
    # Stored before the platform's accounts were refused: the node was told to assume a role in the platform's own
    # account with its own credentials, for a tenant.
    node, secret = register(client, "gpu-1")
    organization = OrganizationFactory()
    platform_role = "arn:aws:iam::111122223333:role/inferplane-node"
    stored = make_credential(organization, name="stored", access_key_id="", secret_access_key="",
                             role_arn="arn:aws:iam::123456789012:role/reader")
    ModelCredential.objects.filter(pk=stored.pk).update(role_arn=platform_role)
    elsewhere = make_credential(organization, name="elsewhere", access_key_id="", secret_access_key="",
                                role_arn="arn:aws:iam::123456789012:role/reader")
    broken = EndpointFactory(organization=organization, name="broken", model_source="s3://b/m", credential=stored,
                             max_loras=2, max_lora_rank=16)
    working = EndpointFactory(organization=organization, name="working", model_source="s3://b/m", credential=elsewhere,
                              max_loras=2, max_lora_rank=16)
    Adapter.objects.create(endpoint=working, name="tuned", source="s3://b/tuned", credential=stored)
    failing = Replica.objects.create(endpoint=broken, node=node, state=ReplicaState.STARTING)
    Replica.objects.create(endpoint=working, node=node, state=ReplicaState.STARTING)
    settings.PLATFORM_AWS_ACCOUNT_IDS = frozenset({"111122223333"})

    answer = beat(client, secret)

    assert platform_role not in answer.content.decode()
    [spec] = HeartbeatResponse.from_dict(answer.json()).desired
    assert spec.endpoint_id == str(working.pk) and spec.credentials.role_arn == "arn:aws:iam::123456789012:role/reader"
    assert spec.adapters == []
    failing.refresh_from_db()
    broken.refresh_from_db()
    assert failing.state == ReplicaState.FAILED and "platform's own AWS accounts" in failing.failure_reason
    assert broken.failed_at is not None and "platform's own AWS accounts" in broken.status_message
    adapter = Adapter.objects.get(name="tuned")
    assert adapter.state == "FAILED" and "platform's own AWS accounts" in adapter.status_message


def test_staff_manage_the_catalogue_in_the_admin_and_each_change_is_audited(client, admin_user):
    sign_in_staff(client, admin_user)
    added = client.post("/django-admin/endpoints/allowedsource/add/", {"pattern": "hf:Qwen/", "description": "Qwen models"})
    assert added.status_code == 302
    assert access("hf:Qwen/Qwen2.5-7B-Instruct").use_fleet_credentials is True
    refused = client.post("/django-admin/endpoints/allowedsource/add/", {"pattern": "file:///etc/", "description": ""})
    assert refused.status_code == 200 and not AllowedSource.objects.filter(pattern="file:///etc/").exists()
    assert AuditEvent.objects.filter(action="catalogue.add", target_repr="hf:Qwen/").exists()


def test_a_tenants_own_copy_of_a_catalogue_models_name_never_sets_another_tenants_facts():
    """Tenant A names a catalogue model but reads it with its own credential from its own store, which
    serves a config of its choosing. What A's node reads is A's fact: the other tenants on that name keep
    the catalogue copy's (before, one row per name: A turned their chat endpoints into embedding ones
    and their context into a million tokens)."""
    from endpoints.fleet.services import record_model_facts
    from gpu_agent.protocol import ModelInfo, WeightsStatus
    from tests.test_placement import make_node

    source = PUBLIC_BUCKET + "llama-8b/"
    shared = EndpointFactory(model_source=source)
    hostile_org = OrganizationFactory()
    hostile = EndpointFactory(organization=hostile_org, model_source=source,
                              credential=make_credential(hostile_org, endpoint_url="https://store.attacker.example"))
    assert (shared.weights_scope, hostile.weights_scope) == ("", organization_scope(hostile_org.pk))

    def report(endpoint, info):
        node = make_node(gpu_type=endpoint.gpu_type)
        Replica.objects.create(endpoint=endpoint, node=node, state=ReplicaState.STARTING)
        record_model_facts(node, [WeightsStatus(source=source, cache_key="k", complete=True, model_info=info)])

    report(shared, ModelInfo(max_model_len=8192, architecture="LlamaForCausalLM"))
    report(hostile, ModelInfo(max_model_len=1_048_576, architecture="BertModel"))
    for endpoint in (shared, hostile):
        endpoint.refresh_from_db()
    assert (shared.serving_task, shared.context_length) == ("generate", 8192)
    assert (hostile.serving_task, hostile.context_length) == ("embed", 1_048_576)
    # A tenant's endpoint that reads the name in its own scope, with nothing read there yet, sees the
    # catalogue copy's facts: never another organisation's.
    other_org = OrganizationFactory()
    other = EndpointFactory(organization=other_org, model_source=source, credential=make_credential(other_org))
    assert (other.serving_task, other.context_length) == ("generate", 8192)


@pytest.mark.parametrize(("source", "listed"), [
    (PUBLIC_REPO, True), (PUBLIC_REPO + "@main", True), (PUBLIC_REPO + "@" + "a" * 40, True),
    (PUBLIC_REPO + "@v1.0", True), (PUBLIC_REPO + "@" + "b" * 40, True),  # the owners' tags and commits, as before
    (PUBLIC_REPO + "@refs/pr/42", False), ("hf:inferplane-models/qwen", True),
    ("hf:inferplane-models/qwen@refs/pr/1", False), (PUBLIC_REPO + "@refs/convert/parquet", False),
])
def test_a_catalogue_repo_is_its_owners_revisions_not_a_pull_request(source, listed):
    """A Hub pull request (`refs/pr/N`) of a catalogue repo holds what anyone pushed and nobody reviewed: it
    is read as the tenant's own (its scope, never the fleet's token), not shared with every tenant. The
    owners' branches, tags and commits stay catalogue (endpoints pinned to them read gated repos with the
    fleet's token)."""
    from endpoints.models import is_catalogue_source

    AllowedSource.objects.create(pattern=PUBLIC_REPO + "@" + "a" * 40)
    AllowedSource.objects.create(pattern="hf:inferplane-models/")
    assert is_catalogue_source(source) is listed
    answer = access(source)
    assert (answer.use_fleet_credentials, answer.weights_scope == "") == (listed, listed)


def test_a_tenants_draft_naming_a_catalogue_source_never_sets_the_catalogue_models_facts():
    """A tenant's draft reads a catalogue name from the tenant's own store (its credential, its endpoint
    URL), which serves an embedding config with a 16-token context and a 10 TB listing. The node, which runs
    a catalogue replica of that name, reports both copies; only the one read in the catalogue's scope sets
    the catalogue's facts (before, the last copy reported did: every tenant's calls to it were refused)."""
    from endpoints.fleet.services import record_model_facts
    from endpoints.models import ModelFacts
    from gpu_agent.protocol import ModelInfo, WeightsStatus
    from tests.test_placement import make_node

    source = PUBLIC_BUCKET + "llama-8b/"
    shared = EndpointFactory(model_source=source)
    tenant = OrganizationFactory()
    drafting = EndpointFactory(organization=tenant, model_source=PUBLIC_BUCKET + "llama-70b/", draft_model_source=source,
                               credential=make_credential(tenant, endpoint_url="https://store.attacker.example"))
    node = make_node(gpu_type=shared.gpu_type)
    for endpoint in (shared, drafting):
        Replica.objects.create(endpoint=endpoint, node=node, state=ReplicaState.STARTING)
    real = WeightsStatus(source=source, cache_key="real", size_bytes=16 << 30, complete=True, scope="",
                         model_info=ModelInfo(max_model_len=8192, architecture="LlamaForCausalLM"))
    poisoned = WeightsStatus(source=source, cache_key="draft", size_bytes=10 * 10**12, complete=True,
                             scope=organization_scope(tenant.pk), last_used_at=2e9,
                             model_info=ModelInfo(max_model_len=16, architecture="BertModel"))
    record_model_facts(node, [real, poisoned])
    record_model_facts(node, [poisoned])
    facts = ModelFacts.objects.get(source=source, scope="")
    assert (facts.max_model_len, facts.architecture, facts.weights_bytes) == (8192, "LlamaForCausalLM", 16 << 30)
    shared.refresh_from_db()
    assert (shared.serving_task, shared.context_length) == ("generate", 8192)


def test_a_node_running_one_source_in_two_scopes_sets_neither():
    from endpoints.fleet.services import record_model_facts
    from endpoints.models import ModelFacts
    from gpu_agent.protocol import ModelInfo, WeightsStatus
    from tests.test_placement import make_node

    source = PUBLIC_BUCKET + "llama-8b/"
    node = make_node()
    for endpoint in (EndpointFactory(model_source=source, gpu_type="l4"),
                     EndpointFactory(model_source=source, gpu_type="l4", credential=make_credential(OrganizationFactory()))):
        Replica.objects.create(endpoint=endpoint, node=node, state=ReplicaState.STARTING)
    record_model_facts(node, [WeightsStatus(source=source, cache_key="k", complete=True,
                                            model_info=ModelInfo(max_model_len=2048, architecture="BertModel"))])
    assert not ModelFacts.objects.filter(source=source).exists()


def test_a_copy_still_downloading_in_its_own_scope_does_not_hide_the_catalogue_copys_facts():
    from endpoints.models import ModelFacts

    source = PUBLIC_BUCKET + "llama-8b/"
    ModelFacts.objects.create(source=source, scope="", max_model_len=8192, architecture="LlamaForCausalLM",
                              checkpoint_quantization={"quant_method": ""})
    organization = OrganizationFactory()
    own = EndpointFactory(organization=organization, model_source=source, credential=make_credential(organization))
    ModelFacts.objects.create(source=source, scope=own.weights_scope, weights_bytes=16 << 30)  # its size only, so far
    assert (own.context_length, own.serving_task) == (8192, "generate")
    assert ModelFacts.quantization_of(source, own.weights_scope) is not None


def test_what_an_engine_counts_of_a_chat_template_is_kept_in_the_scope_its_endpoint_reads_the_model_in():
    # A tenant serving a catalogue model's name from its own store (its credential) runs its own copy's template:
    # its count never stands for the catalogue copy's, which every other tenant's reservations read.
    catalogue = EndpointFactory(model_source=PUBLIC_REPO)
    own_copy = EndpointFactory(model_source=PUBLIC_REPO, credential=make_credential(OrganizationFactory(), kind="hf"))
    own_scope = own_copy.weights_scope
    record_chat_template_tokens(catalogue, ChatTemplateTokens(300, 5, model_source=PUBLIC_REPO, weights_scope=""),
                                node_id=NODE_ID, replica_id=REPLICA_ID)
    record_chat_template_tokens(own_copy, ChatTemplateTokens(2, 0, model_source=PUBLIC_REPO, weights_scope=own_scope),
                                node_id=NODE_ID, replica_id=REPLICA_ID)
    assert catalogue.chat_template_tokens == (300, 5)
    assert own_copy.chat_template_tokens == (2, 0)
    assert EndpointFactory(model_source=PUBLIC_REPO).chat_template_tokens == (300, 5)  # any tenant's, no credential
    assert EndpointFactory(model_source="s3://our-bucket/llama").chat_template_tokens == (0, 0)  # not measured

    # The tenant drops its credential: the endpoint now reads the catalogue's copy, while the engine started on its
    # own copy (its own template) is still running; that engine's count, heard READY again (a wake, a restart),
    # is not the catalogue's.
    own_copy.credential = None
    own_copy.save(update_fields=["credential"])
    assert own_copy.weights_scope == ""
    # (Another node already disputes the catalogue's count with the same figures: were the old engine's count taken
    # as the catalogue's, the two would agree and replace it.)
    record_chat_template_tokens(catalogue, ChatTemplateTokens(1000, 0, model_source=PUBLIC_REPO, weights_scope=""),
                                node_id="9b1f0c1e-0000-4000-8000-000000000002",
                                replica_id=REPLICA_ID)
    record_chat_template_tokens(own_copy, ChatTemplateTokens(1000, 0, model_source=PUBLIC_REPO, weights_scope=own_scope),
                                node_id=NODE_ID, replica_id=REPLICA_ID)
    assert catalogue.chat_template_tokens == (300, 5)


def test_what_a_template_adds_with_a_flag_set_is_kept_beside_its_count_and_reaches_the_gateway():
    # A request that sets a flag the engine measured is bounded by that measure; one an older agent never measured
    # reserves the context (None).
    endpoint, older = EndpointFactory(model_source=PUBLIC_REPO), EndpointFactory(model_source="s3://our-bucket/older")
    record_chat_template_tokens(endpoint, ChatTemplateTokens(300, 5, flagged_per_conversation=900, flagged_per_message=7,
                                                             model_source=PUBLIC_REPO, weights_scope=""), node_id=NODE_ID, replica_id=REPLICA_ID)
    record_chat_template_tokens(older, ChatTemplateTokens(300, 5, model_source=older.model_source,
                                                          weights_scope=older.weights_scope),
                                node_id=NODE_ID, replica_id=REPLICA_ID)
    assert endpoint.chat_template_tokens == (300, 5)
    info = directory._endpoint_info(endpoint)
    assert (info.template_tokens, info.template_flag_tokens) == ((300, 5), (900, 7))
    assert older.chat_template_measures == ((300, 5), None)


def test_a_chat_template_count_that_comes_after_the_heartbeat_that_said_ready_is_kept(client):
    # The agent measures on a thread once the engine is READY and its heartbeat says READY at once: the count
    # comes with a later report. Only the report that first said READY was read for it: it was never kept.
    node, secret = register(client, "gpu-template")
    endpoint = EndpointFactory(model_source=PUBLIC_REPO)
    replica = Replica.objects.create(endpoint=endpoint, node=node, state=ReplicaState.STARTING)
    address = f"http://{node.advertise_host}:{node.engine_port_min}"

    def report(template):
        status = ReplicaStatus(replica_id=str(replica.pk), state=ReplicaState.READY, address=address,
                               chat_template_tokens=template)
        body = Heartbeat(agent_version="0.1.0", num_cpus=2, memory_mb=24000, memory_used_mb=1000,
                         replicas=[status]).to_dict()
        answer = client.post("/agent/v1/heartbeat", body, content_type="application/json",
                             HTTP_AUTHORIZATION=f"Bearer {secret}")
        assert answer.status_code == 200

    report(None)
    assert Replica.objects.get(pk=replica.pk).state == ReplicaState.READY and endpoint.chat_template_tokens == (0, 0)
    report(ChatTemplateTokens(300, 5, model_source=PUBLIC_REPO, weights_scope=""))
    assert endpoint.chat_template_tokens == (300, 5)
    report(ChatTemplateTokens(300, 5, model_source=PUBLIC_REPO, weights_scope=""))  # kept once, read again for nothing
    assert endpoint.chat_template_tokens == (300, 5)
