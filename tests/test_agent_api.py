"""The fleet side of the agent protocol, spoken by hand (the real agent process is tested in tests/agent/)."""

import json
import uuid

import pytest

from controlplane.accounts.models import AuditEvent
from controlplane.accounts.services import SYSTEM
from endpoints.fleet.services import authenticate_node, create_join_token, record_heartbeat, retire_node
from endpoints.models import EndpointEvent, Replica
from endpoints.nodes.models import JoinToken, Node
from endpoints.scheduler import reconcile_endpoint
from gpu_agent.protocol import (
    MAX_MEASURED_S,
    MAX_REPLICA_REPORTS,
    MAX_TOKENS_PER_S,
    MAX_WEIGHTS_REPORTS,
    Heartbeat,
    NodeState,
    ReplicaState,
    ReplicaStatus,
)
from tests.factories import EndpointFactory, sign_in_staff

pytestmark = pytest.mark.django_db

REGISTRATION = {
    "name": "gpu-1", "gpu_type": "cpu", "num_gpus": 0, "gpu_memory_mb": 8192, "num_cpus": 2, "memory_mb": 24000,
    "agent_version": "0.1.0", "supported_quantizations": ["none", "fp8_per_channel"],
}


def register(client, token, **changes):
    return client.post("/agent/v1/register", REGISTRATION | {"join_token": token} | changes, content_type="application/json")


def beat(client, secret, replicas=()):
    body = Heartbeat(agent_version="0.1.0", num_cpus=2, memory_mb=24000, memory_used_mb=1000, replicas=list(replicas)).to_dict()
    return client.post("/agent/v1/heartbeat", body, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {secret}")


@pytest.fixture
def agent(client):
    token = create_join_token(SYSTEM, name="test").plain
    answer = register(client, token).json()
    return answer


def test_a_join_token_admits_a_node_whose_secret_is_stored_hashed(client):
    created = create_join_token(SYSTEM, name="rack-1", max_uses=1)
    response = register(client, created.plain)
    assert response.status_code == 201
    answer = response.json()
    node = Node.objects.get(pk=answer["node_id"])
    assert node.quantizations == ["none", "fp8_per_channel"] and node.state == "READY"
    assert answer["node_secret"] not in str(Node.objects.values().get(pk=node.pk))
    # max_uses=1: the token is spent.
    assert register(client, created.plain, name="gpu-2").status_code == 401
    assert JoinToken.objects.get(pk=created.join_token.pk).num_uses == 1
    assert AuditEvent.objects.filter(action="node.register").count() == 1


def test_bad_join_tokens_and_node_secrets_are_401(client, agent):
    assert register(client, "jt_000000000000_nope").status_code == 401
    assert register(client, "garbage").status_code == 401
    assert beat(client, "nd_000000000000_nope").status_code == 401
    assert beat(client, agent["node_secret"] + "x").status_code == 401
    assert beat(client, agent["node_secret"]).status_code == 200


def test_malformed_messages_are_400(client, agent):
    response = client.post("/agent/v1/register", {"name": "x"}, content_type="application/json")
    assert response.status_code == 400
    response = client.post("/agent/v1/heartbeat", "{bad", content_type="application/json",
                           HTTP_AUTHORIZATION=f"Bearer {agent['node_secret']}")
    assert response.status_code == 400


def test_heartbeat_answers_with_desired_replicas_and_moves_their_state(client, agent, django_capture_on_commit_callbacks):
    endpoint = EndpointFactory(gpu_type="cpu", min_replicas=1, model_source="/models/tiny", max_model_len=1024, max_num_seqs=4)
    reconcile_endpoint(str(endpoint.pk))
    replica = Replica.objects.get(endpoint=endpoint)
    assert replica.state == "PENDING" and str(replica.node_id) == agent["node_id"]

    desired = beat(client, agent["node_secret"]).json()["desired"]
    assert len(desired) == 1
    spec = desired[0]
    assert spec["replica_id"] == str(replica.pk) and spec["served_model_name"] == endpoint.name
    assert (spec["model_source"], spec["max_model_len"], spec["max_num_seqs"], spec["action"]) == ("/models/tiny", 1024, 4, "RUN")

    beat(client, agent["node_secret"], [ReplicaStatus(str(replica.pk), ReplicaState.STARTING, progress="loading weights 40%", progress_percent=40)])
    replica.refresh_from_db()
    assert (replica.state, replica.progress) == ("STARTING", "loading weights 40%")
    beat(client, agent["node_secret"], [ReplicaStatus(str(replica.pk), ReplicaState.READY, address="http://127.0.0.1:20000")])
    replica.refresh_from_db()
    assert replica.state == "READY" and replica.address == "http://127.0.0.1:20000" and replica.ready_at
    beat(client, agent["node_secret"], [ReplicaStatus(str(replica.pk), ReplicaState.READY, num_restarts=1, failure_reason="segfault")])
    messages = list(EndpointEvent.objects.filter(replica=replica).values_list("message", flat=True))
    assert any("READY after" in m for m in messages)
    assert any("crashed and was restarted (restart 1)" in m for m in messages)

    # Paused: the replica drains; the agent is told DRAIN, and a READY report cannot revive it.
    from endpoints.services import pause_endpoint

    pause_endpoint(SYSTEM, endpoint)
    desired = beat(client, agent["node_secret"], [ReplicaStatus(str(replica.pk), ReplicaState.READY)]).json()["desired"]
    assert desired[0]["action"] == "DRAIN"
    replica.refresh_from_db()
    assert replica.state == "DRAINING"
    beat(client, agent["node_secret"], [ReplicaStatus(str(replica.pk), ReplicaState.STOPPED)])
    replica.refresh_from_db()
    assert replica.state == "STOPPED" and replica.stopped_at
    assert beat(client, agent["node_secret"]).json()["desired"] == []


def test_a_replica_the_agent_reports_failed_is_marked_with_its_reason(client, agent, django_capture_on_commit_callbacks):
    endpoint = EndpointFactory(gpu_type="cpu", min_replicas=1, model_source="/models/tiny")
    reconcile_endpoint(str(endpoint.pk))
    replica = Replica.objects.get(endpoint=endpoint)
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        beat(client, agent["node_secret"], [ReplicaStatus(str(replica.pk), ReplicaState.FAILED, failure_reason="CUDA out of memory")])
    replica.refresh_from_db()
    assert replica.state == "FAILED" and "out of memory" in replica.failure_reason
    assert callbacks, "a failed replica schedules a reconcile that replaces it"


def test_an_agent_cannot_report_on_another_nodes_replica(client, agent):
    other = register(client, create_join_token(SYSTEM, name="x").plain, name="gpu-2").json()
    endpoint = EndpointFactory(gpu_type="cpu", min_replicas=1, model_source="/models/tiny")
    reconcile_endpoint(str(endpoint.pk))
    replica = Replica.objects.get(endpoint=endpoint)
    intruder = other if str(replica.node_id) == agent["node_id"] else agent
    beat(client, intruder["node_secret"], [ReplicaStatus(str(replica.pk), ReplicaState.FAILED)])
    replica.refresh_from_db()
    assert replica.state == "PENDING"


def test_a_heartbeat_in_flight_while_its_node_is_retired_leaves_it_retired_and_is_told_to_run_nothing(client, agent):
    endpoint = EndpointFactory(gpu_type="cpu", min_replicas=1, model_source="/models/tiny")
    reconcile_endpoint(str(endpoint.pk))
    replica = Replica.objects.get(endpoint=endpoint)
    in_flight = authenticate_node(agent["node_secret"])  # its secret checked, its row lock not yet taken
    retire_node(SYSTEM, Node.objects.get(pk=agent["node_id"]), reason="stolen machine")

    answer = record_heartbeat(in_flight, Heartbeat(
        agent_version="0.1.0", num_cpus=2, memory_mb=24000, memory_used_mb=1000,
        replicas=[ReplicaStatus(str(replica.pk), ReplicaState.READY, address="http://127.0.0.1:20000")]))

    node = Node.objects.get(pk=agent["node_id"])
    assert node.state == NodeState.OFFLINE and node.secret_digest == "", "it stays retired"
    assert answer.node_state == NodeState.OFFLINE and answer.desired == []
    assert Replica.objects.get(pk=replica.pk).state == ReplicaState.FAILED
    assert not AuditEvent.objects.filter(action="node.online").exists()
    assert beat(client, agent["node_secret"]).status_code == 401


@pytest.mark.parametrize("address, why", [
    ("http://169.254.169.254:20000", "registered host"),  # a stolen node secret aims the gateway elsewhere
    ("http://evil.example:20000", "registered host"),
    ("http://127.0.0.1:6379", "engine ports"),  # the node's own Redis, outside its engine range
    ("http://127.0.0.1:20000/v1/../admin", "http://host:port"),
    ("http://user:pw@127.0.0.1:20000", "http://host:port"),
    ("https://127.0.0.1:20000", "http://host:port"),
    ("not a url at all", "http://host:port"),
])
def test_an_engine_address_off_the_nodes_host_or_port_range_is_refused_and_the_replica_fails(
    client, agent, address, why, django_capture_on_commit_callbacks
):
    endpoint = EndpointFactory(gpu_type="cpu", min_replicas=1, model_source="/models/tiny")
    reconcile_endpoint(str(endpoint.pk))
    replica = Replica.objects.get(endpoint=endpoint)
    beat(client, agent["node_secret"], [ReplicaStatus(str(replica.pk), ReplicaState.READY, address=address)])
    replica.refresh_from_db()
    assert replica.state == "FAILED" and replica.address == ""
    assert why in replica.failure_reason and "refused" in replica.failure_reason
    # Shown to every member: it names neither the address reported nor where the node's engines listen.
    node = Replica.objects.select_related("node").get(pk=replica.pk).node
    assert address not in replica.failure_reason and node.advertise_host not in replica.failure_reason
    assert str(node.engine_port_min) not in replica.failure_reason
    assert EndpointEvent.objects.filter(replica=replica, kind="failure", message__contains=why).exists()


def test_a_node_registers_its_engine_host_and_port_range_and_bad_ones_are_400(client):
    token = create_join_token(SYSTEM, name="t").plain
    answer = register(client, token, advertise_host="10.0.3.7", engine_port_min=31000, engine_port_max=31099).json()
    node = Node.objects.get(pk=answer["node_id"])
    assert (node.advertise_host, node.engine_port_min, node.engine_port_max) == ("10.0.3.7", 31000, 31099)
    assert node.engine_address_problem("http://10.0.3.7:31050") == ""
    assert node.engine_address_problem("http://10.0.3.7:31100")
    assert node.engine_address_problem("http://10.0.3.8:31050")
    for bad in ({"engine_port_min": 80, "engine_port_max": 90}, {"engine_port_min": 30000, "engine_port_max": 20000},
                {"advertise_host": "a b/c"}, {"advertise_host": ""}):
        assert register(client, token, name="bad", **bad).status_code == 400, bad


@pytest.mark.parametrize("figure", ["num_gpus", "gpu_memory_mb", "num_cpus", "memory_mb"])
def test_a_registration_whose_figure_is_past_what_a_node_can_have_is_a_400_naming_it_and_spends_no_use(client, figure):
    """Before, a holder of a join token registering 2**40 of any of these was a 500 (PostgreSQL's integer out of
    range), and 65 to 2**31 - 1 GPUs past the 64 a node may list were taken."""
    created = create_join_token(SYSTEM, name="t", max_uses=1)
    for value in (2**40, 65) if figure == "num_gpus" else (2**40,):
        response = register(client, created.plain, **{figure: value})
        assert response.status_code == 400, (value, response.content)
        assert figure in response.json()["error"]["message"]
    assert not Node.objects.exists() and JoinToken.objects.get(pk=created.join_token.pk).num_uses == 0
    assert register(client, created.plain, num_gpus=64, gpu_memory_mb=81_920).status_code == 201


UNREACHABLE_HOSTS = ["127.0.0.1", "127.8.9.10", "::1", "[::1]", "::ffff:127.0.0.1", "0.0.0.0", "::", "169.254.169.254",
                     "fe80::1", "224.0.0.251", "ff02::1", "localhost", "gateway.example"]


def test_a_node_whose_host_is_the_gateways_own_or_link_local_is_400_and_spends_no_use_of_its_token(client, settings):
    # Production: any holder of a shared join token could otherwise aim the gateway (and prompts) at its loopback
    # or the cloud's metadata service; a host name may resolve to either, later.
    settings.ALLOW_LOOPBACK_NODES = False
    created = create_join_token(SYSTEM, name="rack", max_uses=2)
    for host in UNREACHABLE_HOSTS:
        response = register(client, created.plain, name="minted", advertise_host=host)
        assert response.status_code == 400, host
        assert "advertise_host" in response.json()["error"]["message"], host
    assert JoinToken.objects.get(pk=created.join_token.pk).num_uses == 0 and not Node.objects.exists()
    # A VPC's private addresses are where fleet nodes live.
    for host in ("10.0.3.7", "fd00:1::7"):
        assert register(client, created.plain, name=host, advertise_host=host).status_code == 201, host


def test_the_local_stack_admits_loopback_nodes_but_never_link_local_ones(client, settings):
    settings.ALLOW_LOOPBACK_NODES = True
    token = create_join_token(SYSTEM, name="local").plain
    for host in ("127.0.0.1", "::1", "localhost"):
        assert register(client, token, name=host, advertise_host=host).status_code == 201, host
    for host in ("169.254.169.254", "fe80::1", "0.0.0.0", "224.0.0.251"):
        assert register(client, token, name=host, advertise_host=host).status_code == 400, host


def test_the_gateway_stops_routing_to_a_loopback_node_once_the_deployment_refuses_them(
        client, agent, settings, django_capture_on_commit_callbacks):
    from endpoints.gateway.directory import _load_replicas

    endpoint = EndpointFactory(gpu_type="cpu", min_replicas=1, model_source="/models/tiny")
    reconcile_endpoint(str(endpoint.pk))
    replica = Replica.objects.get(endpoint=endpoint)
    beat(client, agent["node_secret"], [ReplicaStatus(str(replica.pk), ReplicaState.READY, address="http://127.0.0.1:20001")])
    assert [info.id for info in _load_replicas(str(endpoint.pk))] == [str(replica.pk)]
    # Registered on loopback where it was allowed (or before the rule): the gateway checks the host again.
    settings.ALLOW_LOOPBACK_NODES = False
    assert _load_replicas(str(endpoint.pk)) == []


def test_a_node_registers_what_confines_its_engines_and_staff_see_it(client, django_user_model):
    token = create_join_token(SYSTEM, name="t").plain
    answer = register(client, token, engine_sandbox="landlock abi 7").json()
    assert Node.objects.get(pk=answer["node_id"]).engine_sandbox == "landlock abi 7"
    unconfined = register(client, token, name="old-kernel", engine_sandbox="none: the kernel has no Landlock").json()
    assert Node.objects.get(pk=unconfined["node_id"]).engine_sandbox == "none: the kernel has no Landlock"
    assert register(client, token, name="bad", engine_sandbox=["landlock"]).status_code == 400
    sign_in_staff(client, django_user_model.objects.create_superuser("ops@example.test", "ops@example.test", "pw"))
    assert "none: the kernel has no Landlock" in client.get("/django-admin/gpu_agent/node/").content.decode()


def test_each_replica_gets_its_own_engine_key_only_in_its_nodes_desired_spec(client, agent):
    endpoint = EndpointFactory(gpu_type="cpu", min_replicas=2, max_replicas=2, model_source="/models/tiny")
    reconcile_endpoint(str(endpoint.pk))
    desired = beat(client, agent["node_secret"]).json()["desired"]
    keys = {spec["replica_id"]: spec["engine_api_key"] for spec in desired}
    assert len(keys) == 2 and len(set(keys.values())) == 2 and all(len(key) >= 32 for key in keys.values())
    for replica in Replica.objects.filter(endpoint=endpoint):
        # Encrypted at rest: the database never holds the key itself.
        assert keys[str(replica.pk)] not in replica.encrypted_engine_key
        assert replica.engine_api_key == keys[str(replica.pk)]
    other = register(client, create_join_token(SYSTEM, name="x").plain, name="gpu-2").json()
    assert beat(client, other["node_secret"]).json()["desired"] == []


def test_staff_see_a_replica_in_the_admin_without_its_engine_key(client, agent, django_user_model):
    endpoint = EndpointFactory(gpu_type="cpu", min_replicas=1, model_source="/models/tiny")
    reconcile_endpoint(str(endpoint.pk))
    replica = Replica.objects.get(endpoint=endpoint)
    sign_in_staff(client, django_user_model.objects.create_superuser("ops@example.test", "ops@example.test", "pw"))
    page = client.get(f"/django-admin/endpoints/replica/{replica.pk}/change/").content.decode()
    assert str(replica.pk) in page
    assert replica.engine_api_key not in page and replica.encrypted_engine_key not in page


def test_a_heartbeat_with_model_figures_past_the_columns_is_taken_with_its_replica_reports(client, agent):
    # Figures an agent read from a tenant's own files (config.json, safetensors headers, its store's listing),
    # as an agent that does not bound them reports them: each once made the heartbeat a 500 (an integer out of
    # range, a NUL in text), its replica reports were never applied and the node went OFFLINE.
    from endpoints.models import ModelFacts

    endpoint = EndpointFactory(gpu_type="cpu", min_replicas=1, model_source="/models/tenant")
    reconcile_endpoint(str(endpoint.pk))
    replica = Replica.objects.get(endpoint=endpoint)
    body = Heartbeat(agent_version="0.1.0", num_cpus=2, memory_mb=24000, memory_used_mb=1000,
                     replicas=[ReplicaStatus(str(replica.pk), ReplicaState.STARTING, progress="starting engine")]).to_dict()
    body["weights"] = [{
        "source": "/models/tenant", "cache_key": "k", "size_bytes": 2**70, "downloaded_bytes": 2**70, "complete": True,
        "model_info": {"max_model_len": 3_000_000_000, "architecture": "Llama\u0000ForCausalLM", "num_params": 2**70,
                       "quantization": {"quant_method": "awq\u0000", "bits": 4}},
    }]
    response = client.post("/agent/v1/heartbeat", body, content_type="application/json",
                           HTTP_AUTHORIZATION=f"Bearer {agent['node_secret']}")
    assert response.status_code == 200
    replica.refresh_from_db()
    assert (replica.state, replica.progress) == ("STARTING", "starting engine")
    # Past what any model can be, the figures are not kept (`ModelFacts.learn`); text is kept without its NULs.
    assert not ModelFacts.objects.filter(source="/models/tenant").exists()
    body["weights"][0] |= {"size_bytes": 2**30, "downloaded_bytes": 2**30}
    body["weights"][0]["model_info"] |= {"max_model_len": 4096, "num_params": 10**9}
    response = client.post("/agent/v1/heartbeat", body, content_type="application/json",
                           HTTP_AUTHORIZATION=f"Bearer {agent['node_secret']}")
    assert response.status_code == 200
    facts = ModelFacts.objects.get(source="/models/tenant")
    assert (facts.max_model_len, facts.num_params, facts.weights_bytes) == (4096, 10**9, 2**30)
    assert facts.architecture == "LlamaForCausalLM" and facts.checkpoint_quantization["quant_method"] == "awq"


def test_a_chat_template_count_past_what_a_template_can_add_is_not_kept(client, agent):
    """An engine's count of its chat template is what the node says; 2^31 tokens per conversation would make
    every call to the model reserve a whole context's price (before, it was kept: calls refused for their caps)."""
    from gpu_agent.protocol import ChatTemplateTokens

    endpoint = EndpointFactory(gpu_type="cpu", min_replicas=1, model_source="/models/tenant")
    reconcile_endpoint(str(endpoint.pk))
    replica = Replica.objects.get(endpoint=endpoint)
    node = replica.node

    def report(per_conversation, per_message):
        template = ChatTemplateTokens(per_conversation, per_message, model_source=endpoint.model_source,
                                      weights_scope=endpoint.weights_scope)
        status = ReplicaStatus(str(replica.pk), ReplicaState.READY, address=f"http://{node.advertise_host}:{node.engine_port_min}",
                               chat_template_tokens=template)
        assert beat(client, agent["node_secret"], [status]).status_code == 200

    report(2**31 - 1, 2**31 - 1)
    assert Replica.objects.get(pk=replica.pk).state == ReplicaState.READY and endpoint.chat_template_tokens == (0, 0)
    report(300, 5)
    assert endpoint.chat_template_tokens == (300, 5)


def test_an_endpoint_whose_spec_cannot_be_built_fails_alone_and_the_nodes_heartbeat_is_answered(client, agent):
    # Its row held what the protocol refuses (two PATCHes at once, each valid alone): every heartbeat of the node was
    # a 500, the node went OFFLINE with every other tenant's replica on it, and the endpoint moved to the next node.
    broken = EndpointFactory(gpu_type="cpu", min_replicas=1, max_replicas=1, model_source="/models/tiny",
                             speculative_method="ngram")
    other = EndpointFactory(gpu_type="cpu", min_replicas=1, max_replicas=1, model_source="/models/tiny")
    reconcile_endpoint(str(broken.pk))
    reconcile_endpoint(str(other.pk))
    type(broken).objects.filter(pk=broken.pk).update(prompt_lookup_min=3, prompt_lookup_max=1)

    response = beat(client, agent["node_secret"])

    assert response.status_code == 200
    assert [spec["endpoint_id"] for spec in response.json()["desired"]] == [str(other.pk)]
    [replica] = Replica.objects.filter(endpoint=broken)
    assert replica.state == ReplicaState.FAILED and "cannot run" in replica.failure_reason
    broken.refresh_from_db()
    assert broken.failed_at is not None and "cannot run" in broken.status_message
    assert Node.objects.get(pk=agent["node_id"]).state == NodeState.READY


def test_reports_on_a_stopped_replica_write_no_event_and_set_no_adapter(client, agent):
    from endpoints.models import Adapter
    from endpoints.replicas import drain_replica

    endpoint = EndpointFactory(gpu_type="cpu", min_replicas=1, model_source="/models/tiny", max_loras=2,
                                max_lora_rank=16)
    Adapter.objects.create(endpoint=endpoint, name="tone", source="/a/tone")
    reconcile_endpoint(str(endpoint.pk))
    replica = Replica.objects.get(endpoint=endpoint)
    drain_replica(replica, reason="scaled down")  # PENDING: STOPPED at once
    replica.refresh_from_db()
    assert replica.state == "STOPPED"
    before = EndpointEvent.objects.filter(endpoint=endpoint).count()
    for num_restarts in range(1, 4):
        response = beat(client, agent["node_secret"], [ReplicaStatus(
            str(replica.pk), ReplicaState.READY, num_restarts=num_restarts, num_running=3,
            failure_reason="Security notice: your key leaked, sign in at https://evil.example",
            adapters=["tone"], adapter_failures={"tone": "see https://evil.example"})])
        assert response.status_code == 200
    assert EndpointEvent.objects.filter(endpoint=endpoint).count() == before
    replica.refresh_from_db()
    assert (replica.state, replica.num_restarts, replica.num_running, replica.adapters) == ("STOPPED", 0, 0, [])
    assert Adapter.objects.get(endpoint=endpoint, name="tone").status_message == ""


def test_a_replica_report_with_a_non_finite_figure_is_400_and_nothing_of_it_is_kept(client, agent):
    endpoint = EndpointFactory(gpu_type="cpu", min_replicas=1, model_source="/models/tiny")
    reconcile_endpoint(str(endpoint.pk))
    replica = Replica.objects.get(endpoint=endpoint)
    base = {"agent_version": "x", "num_cpus": 2, "memory_mb": 24000, "memory_used_mb": 1}
    for figure in ({"tokens_per_s": float("inf")}, {"download_s": float("nan")}, {"engine_start_s": float("-inf")},
                   {"progress_percent": float("nan")}, {"kv_cache_usage": float("nan")}):
        body = base | {"replicas": [{"replica_id": str(replica.pk), "state": "STARTING"} | figure]}
        response = client.post("/agent/v1/heartbeat", json.dumps(body), content_type="application/json",
                               HTTP_AUTHORIZATION=f"Bearer {agent['node_secret']}")
        assert response.status_code == 400, figure
        assert next(iter(figure)) in response.json()["error"]["message"]
    for figure in ({"cpu_percent": float("nan")},
                   {"gpus": [{"index": 0, "name": "x", "utilization_percent": float("inf"), "memory_used_mb": 0,
                              "memory_total_mb": 1}]}):
        response = client.post("/agent/v1/heartbeat", json.dumps(base | figure), content_type="application/json",
                               HTTP_AUTHORIZATION=f"Bearer {agent['node_secret']}")
        assert response.status_code == 400, figure  # kept in the node's jsonb status, which has no NaN
    # Finite but absurd: clamped to what a measure can mean.
    beat(client, agent["node_secret"], [ReplicaStatus(str(replica.pk), ReplicaState.STARTING, download_s=-1e308,
                                                      engine_start_s=1e308, progress_percent=1e9, tokens_per_s=1e300,
                                                      num_waiting=2**40)])
    replica.refresh_from_db()
    assert (replica.state, replica.download_s, replica.engine_start_s, replica.progress_percent) == (
        "STARTING", 0.0, MAX_MEASURED_S, 100.0)
    assert replica.tokens_per_s == MAX_TOKENS_PER_S and replica.num_waiting == 2**31 - 1


def test_a_made_up_replica_id_or_json_nested_past_the_parser_is_400(client, agent):
    assert beat(client, agent["node_secret"], [ReplicaStatus("not-a-uuid", ReplicaState.READY)]).status_code == 400
    nested = '{"agent_version": "x", "num_cpus": 2, "memory_mb": 1, "memory_used_mb": 1, "labels": ' + "[" * 100_000
    for path, headers in (("/agent/v1/heartbeat", {"HTTP_AUTHORIZATION": f"Bearer {agent['node_secret']}"}),
                          ("/agent/v1/register", {})):
        response = client.post(path, nested + "]" * 100_000 + "}", content_type="application/json", **headers)
        assert response.status_code == 400, path


def test_a_heartbeat_reads_its_nodes_replicas_in_one_query_and_past_its_cap_is_refused_whole(
        client, agent, django_assert_max_num_queries):
    base = {"agent_version": "x", "num_cpus": 2, "memory_mb": 24000, "memory_used_mb": 1}
    made_up = [{"replica_id": str(uuid.uuid4()), "state": "READY", "num_restarts": 1, "failure_reason": "x"}
               for _ in range(MAX_REPLICA_REPORTS)]
    with django_assert_max_num_queries(20):  # one per report before: a transaction and a row lock each
        response = client.post("/agent/v1/heartbeat", json.dumps(base | {"replicas": made_up}),
                               content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {agent['node_secret']}")
    assert response.status_code == 200
    too_many = made_up + [{"replica_id": str(uuid.uuid4()), "state": "READY"}]
    response = client.post("/agent/v1/heartbeat", json.dumps(base | {"replicas": too_many}),
                           content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {agent['node_secret']}")
    assert response.status_code == 400 and str(MAX_REPLICA_REPORTS) in response.json()["error"]["message"]


def test_a_heartbeat_past_its_weights_reports_cap_is_taken_with_its_first_reports_only(client, agent):
    # Each report was parsed, kept in the node's last_status and read by every placement: 80,000 fit in a body. The
    # cap was a 400 at first, which took an honest node of an agent from before it (every cached copy reported,
    # adapters included) OFFLINE (found by the review of the cap).
    base = {"agent_version": "x", "num_cpus": 2, "memory_mb": 24000, "memory_used_mb": 1}
    weights = [{"source": f"hf:org/m-{i}", "cache_key": f"{i:032x}"} for i in range(MAX_WEIGHTS_REPORTS + 500)]
    response = client.post("/agent/v1/heartbeat", json.dumps(base | {"weights": weights}),
                           content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {agent['node_secret']}")
    assert response.status_code == 200
    kept = Node.objects.get(pk=agent["node_id"]).last_status["weights"]
    assert [report["source"] for report in kept] == [report["source"] for report in weights[:MAX_WEIGHTS_REPORTS]]


_HOT_GPU = {"index": 0, "name": "g", "memory_total_mb": 1, "memory_used_mb": 0, "utilization_percent": 0}


@pytest.mark.parametrize("changes", [{"cpu_percent": 10**400}, {"gpus": [_HOT_GPU | {"temperature_c": 10**400}]}])
def test_a_heartbeats_integer_past_a_floats_range_is_a_400_not_a_500(client, agent, changes):
    # math.isfinite(10**400) raised OverflowError: a 500 (found by the review of this stop's protocol checks).
    client.raise_request_exception = False
    assert beat_raw(client, agent, changes).status_code == 400


def test_a_registrations_integer_past_a_floats_range_is_a_400_before_its_token_is_checked(client):
    client.raise_request_exception = False
    answer = register(client, "ipj_000000000000_bogus", num_gpus=1, gpus=[_HOT_GPU | {"utilization_percent": 10**400}])
    assert answer.status_code == 400, answer.content[:300]


def beat_raw(client, agent, changes):
    body = {"agent_version": "x", "num_cpus": 2, "memory_mb": 24000, "memory_used_mb": 1} | changes
    return client.post("/agent/v1/heartbeat", json.dumps(body), content_type="application/json",
                       HTTP_AUTHORIZATION=f"Bearer {agent['node_secret']}")


def _replica_report(client, agent, **fields):
    endpoint = EndpointFactory(gpu_type="cpu", min_replicas=1, model_source="/models/tiny")
    reconcile_endpoint(str(endpoint.pk))
    return {"replica_id": str(Replica.objects.get(endpoint=endpoint).pk), "state": "STARTING"} | fields


HOSTILE_HEARTBEATS = {
    "a version past its column (a 500 before)": ({"agent_version": "v" * 65}, "agent_version must be at most 64 characters"),
    "a number for text": ({"agent_version": 5}, "agent_version: must be a string"),
    "text for a number (kept in the node's status before)": ({"memory_used_mb": "lots"}, "memory_used_mb: must be an integer"),
    "a negative figure": ({"memory_used_mb": -5}, "memory and disk figures must be >= 0"),
    "text for a weights report's flag": ({"weights": [{"source": "s", "cache_key": "k", "complete": "yes"}]}, "complete: must be true or false"),
    "a weights source past a model source's": ({"weights": [{"source": "s" * 501, "cache_key": "k"}]}, "source must be at most 500"),
    "a weights cache key past a content address": ({"weights": [{"source": "s", "cache_key": "k" * 65}]}, "cache_key must be at most 64"),
    "a weights scope past an organisation's": ({"weights": [{"source": "s", "cache_key": "k", "scope": "o" * 65}]}, "scope must be at most 64"),
    "a replica's engine address past its column": ("address", "address must be at most 200 characters"),
    "an adapter name past its column": ("adapters", "each adapter's name must be at most 63 characters"),
    "more adapters than an endpoint holds": ("many adapters", "at most 256 adapters"),
    "a failure reason that is an object": ("failure_reason", "failure_reason: must be a string"),
    "a chat template count's source past a model source's": ("chat_template_tokens", "model_source must be at most 500"),
}


@pytest.mark.parametrize("case", HOSTILE_HEARTBEATS)
def test_a_heartbeat_with_text_past_its_bound_or_of_the_wrong_shape_is_a_clear_400(client, agent, case):
    changes, message = HOSTILE_HEARTBEATS[case]
    if isinstance(changes, str):
        report = {"address": {"address": "http://127.0.0.1:20000/" + "a" * 200}, "adapters": {"adapters": ["a" * 64]},
                  "many adapters": {"adapters": [f"a{i}" for i in range(257)]}, "failure_reason": {"failure_reason": {"a": 1}},
                  "chat_template_tokens": {"chat_template_tokens": {"model_source": "s" * 501}}}[changes]
        changes = {"replicas": [_replica_report(client, agent, **report)]}
    response = beat_raw(client, agent, changes)
    assert response.status_code == 400 and message in response.json()["error"]["message"], response.content[:300]


HOSTILE_REGISTRATIONS = {
    "agent_version": ({"agent_version": "a" * 65}, "agent_version must be at most 64 characters"),  # a 500 before
    "engine_version": ({"engine_version": "e" * 65}, "engine_version must be at most 64 characters"),  # a 500 before
    "gpu_type": ({"gpu_type": "g" * 33}, "gpu_type must be at most 32 characters"),  # a 500 before
    "a long quantization": ({"supported_quantizations": ["q" * 33]}, "each supported quantization must be at most 32"),
    "many quantizations": ({"supported_quantizations": ["none"] * 33}, "supported_quantizations lists at most 32"),
    "many labels": ({"labels": {f"k{i}": "v" for i in range(65)}}, "labels holds at most 64"),
    "a long label": ({"labels": {"k": "v" * 257}}, "each label's value must be at most 256"),
    "a nested label": ({"labels": {"k": {"nested": ["x"]}}}, "labels: must be a string"),
    "a name that is a number": ({"name": 5}, "name: must be a string"),
}


@pytest.mark.parametrize("case", HOSTILE_REGISTRATIONS)
def test_a_registration_with_text_past_its_bound_or_of_the_wrong_shape_is_a_clear_400(client, case):
    changes, message = HOSTILE_REGISTRATIONS[case]
    created = create_join_token(SYSTEM, name="rack", max_uses=1)
    response = register(client, created.plain, **changes)
    assert response.status_code == 400 and message in response.json()["error"]["message"], response.content[:300]
    assert not Node.objects.exists() and JoinToken.objects.get(pk=created.join_token.pk).num_uses == 0


def test_free_text_an_agent_reports_is_kept_cut_not_refused(client, agent):
    report = _replica_report(client, agent, state="FAILED", failure_reason="x" * 100_000 + "the last line",
                             progress="p" * 1_000)
    assert beat_raw(client, agent, {"replicas": [report]}).status_code == 200
    replica = Replica.objects.get(pk=report["replica_id"])
    assert replica.state == "FAILED" and replica.failure_reason.endswith("the last line")
    assert len(replica.failure_reason) <= 2000


def test_a_heartbeats_unknown_fields_are_ignored_and_never_reach_the_nodes_status(client, agent):
    """What the fleet page reads of a node (`last_status`) is the protocol's fields alone: a field the control plane
    writes there itself (`gpus_ignored`) or any other made up is dropped, the heartbeat taken (guard: passes before
    and after)."""
    answer = beat_raw(client, agent, {"gpus_ignored": "nothing, trust me", "evil": {"x": ["y"] * 1000}})

    assert answer.status_code == 200
    status = Node.objects.get(pk=agent["node_id"]).last_status
    assert "gpus_ignored" not in status and "evil" not in status


def test_a_node_registering_with_another_nodes_name_and_host_gets_a_node_of_its_own(client, agent):
    """A machine holding a join token cannot take over a node by its name or address: it is a new node, with its own
    secret and no replica of the first; the first node's secret and replicas are untouched (guard: passes before and
    after)."""
    endpoint = EndpointFactory(gpu_type="cpu", min_replicas=1, model_source="/models/tiny")
    reconcile_endpoint(str(endpoint.pk))
    replica = Replica.objects.get(endpoint=endpoint)

    impostor = register(client, create_join_token(SYSTEM, name="other").plain).json()

    assert impostor["node_id"] != agent["node_id"] and impostor["node_secret"] != agent["node_secret"]
    assert beat(client, impostor["node_secret"]).json()["desired"] == []
    beat(client, impostor["node_secret"], [ReplicaStatus(str(replica.pk), ReplicaState.FAILED)])
    assert Replica.objects.get(pk=replica.pk).state == ReplicaState.PENDING
    assert [spec["replica_id"] for spec in beat(client, agent["node_secret"]).json()["desired"]] == [str(replica.pk)]


@pytest.mark.parametrize("field, changes", [
    ("name", {"name": "gpu\x001"}), ("name", {"name": "gpu\n1"}), ("agent_version", {"agent_version": "0.1\x00"}),
    ("engine_version", {"engine_version": "\x000.32"}), ("gpu_type", {"gpu_type": "h1\x0000"}),
    ("quantization", {"supported_quantizations": ["none\x00"]}), ("label", {"labels": {"zone": "a\x00"}}),
])
def test_a_control_character_in_a_registrations_text_is_a_400_naming_the_field(client, settings, field, changes):
    """Before: a NUL in the name (or the versions, GPU type, labels) was a 500 (PostgreSQL's text refuses it), on the
    node's insert or, for a refused host, on the refusal's audit."""
    token = create_join_token(SYSTEM, name="t").plain
    response = register(client, token, **changes)
    assert response.status_code == 400 and field in response.json()["error"]["message"], response.content[:300]
    assert not Node.objects.exists()


def test_a_control_character_in_a_heartbeats_agent_version_is_a_400_naming_it(client, agent):
    response = beat_raw(client, agent, {"agent_version": "0.1\x00"})
    assert response.status_code == 400 and "agent_version" in response.json()["error"]["message"]


def test_a_nul_in_what_an_engine_or_its_adapter_said_is_dropped_and_the_heartbeat_taken(client, agent):
    """A replica's failure reason is the end of its engine's log, and an adapter's failure the engine's own answer: text
    a tenant's files choose (transformers' error for a config.json whose `model_type` holds a NUL quotes it raw).
    Before, PostgreSQL refused the NUL: every heartbeat of the node was a 500 while the agent reported that replica, and
    the node went OFFLINE with every other tenant's replica on it."""
    from endpoints.models import Adapter, EndpointEvent

    crashed = _replica_report(client, agent, state="FAILED",
                              failure_reason="ValueError: model type `llama\x00x` is not recognised\nthe last line")
    restarted = _replica_report(client, agent, num_restarts=1, failure_reason="crash\x00", progress="loading\x00 40%",
                                adapter_failures={"a": "the engine: bad\x00 module"})
    replica = Replica.objects.get(pk=restarted["replica_id"])
    Adapter.objects.create(endpoint=replica.endpoint, name="a", source="s3://bucket/a")

    response = beat_raw(client, agent, {"replicas": [crashed, restarted]})

    assert response.status_code == 200, response.content[:300]
    failed = Replica.objects.get(pk=crashed["replica_id"])
    assert failed.state == "FAILED" and failed.failure_reason.endswith("`llamax` is not recognised\nthe last line")
    assert Replica.objects.get(pk=restarted["replica_id"]).progress == "loading 40%"
    assert EndpointEvent.objects.get(replica_id=restarted["replica_id"], kind="failure").details["reason"] == "crash"
    assert Adapter.objects.get(endpoint=replica.endpoint, name="a").status_message == "the engine: bad module"


@pytest.mark.parametrize("case", ["weights source", "weights cache key", "weights scope", "GPU name", "adapter name",
                                  "failed adapter name", "MIG profile"])
def test_a_nul_in_a_name_a_forged_heartbeat_carries_is_a_clear_400(client, agent, case):
    """Names an agent only repeats (its spec's source and adapters, its cache's keys, its GPUs' names) never hold a NUL:
    one that does is a made-up heartbeat, refused with the field's name. Before, each was a 500 (PostgreSQL's jsonb of
    the node's status, or a query, refused it)."""
    weights = {"source": "/models/tiny", "cache_key": "k", "scope": "", "complete": True, "size_bytes": 5}
    gpu = {"index": 0, "name": "L4", "utilization_percent": 0, "memory_used_mb": 0, "memory_total_mb": 1}
    changes = {
        "weights source": {"weights": [weights | {"source": "/models/tiny\x00"}]},
        "weights cache key": {"weights": [weights | {"cache_key": "k\x00"}]},
        "weights scope": {"weights": [weights | {"scope": "\x00"}]},
        "GPU name": {"gpus": [gpu | {"name": "L4\x00"}]},
        "MIG profile": {"gpus": [gpu | {"uuid": "GPU-1", "mig_slices": [{"uuid": "MIG-1", "profile": "1g\x00", "memory_mb": 1}]}]},
        "adapter name": "adapters",
        "failed adapter name": "adapter_failures",
    }[case]
    if isinstance(changes, str):
        report = {"adapters": {"adapters": ["a\x00"]}, "adapter_failures": {"adapter_failures": {"a\x00": "x"}}}[changes]
        changes = {"replicas": [_replica_report(client, agent, state="READY", **report)]}
    response = beat_raw(client, agent, changes)
    assert response.status_code == 400 and "NUL" in response.json()["error"]["message"], response.content[:300]
