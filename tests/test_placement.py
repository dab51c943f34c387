"""Placement over many simulated nodes (rows), and from several processes at once."""

import subprocess
import sys
import textwrap

import pytest
from django.db.models import Sum
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from endpoints.models import Endpoint, Replica
from endpoints.nodes.models import Node
from endpoints.placement import memory_needed_mb, weights_size_mb
from endpoints.replicas import fail_replica, place_replica, record_replica_failure, record_replica_ready
from gpu_agent.protocol import NodeState, ReplicaState
from tests.conftest import REPO_ROOT, child_env, wait_until
from tests.factories import EndpointFactory, OrganizationFactory

pytestmark = pytest.mark.django_db

_counter = iter(range(10**9))


def make_node(gpu_type="l4", memory_mb=24_000, num_gpus=1, state=NodeState.READY, quantizations=("none", "fp8"), **extra):
    n = next(_counter)
    return Node.objects.create(name=f"node-{n:05d}", gpu_type=gpu_type, num_gpus=num_gpus, gpu_memory_mb=memory_mb,
                               secret_lookup=f"{n:012d}", secret_digest="x", state=state, quantizations=list(quantizations),
                               last_heartbeat_at=timezone.now(), **extra)


def test_needs_are_estimated_from_the_model_name_and_quantization():
    small = EndpointFactory(model_source="hf:org/tiny-model", gpu_type="l4")
    eight_b = EndpointFactory(model_source="hf:meta-llama/Llama-3.1-8B-Instruct", gpu_type="l4", max_model_len=4096, max_num_seqs=8)
    fp8 = EndpointFactory(model_source="hf:meta-llama/Llama-3.1-8B-Instruct", gpu_type="l4", quantization="fp8", max_model_len=4096, max_num_seqs=8)
    assert memory_needed_mb(small) < 3_000
    assert 15_000 < memory_needed_mb(eight_b) < 24_000
    assert memory_needed_mb(fp8) < memory_needed_mb(eight_b) * 0.7


def test_prefers_spreading_then_nodes_holding_the_weights_then_best_fit():
    endpoint = EndpointFactory(model_source="hf:org/model-1B", gpu_type="l4", max_replicas=3)
    roomy = make_node(memory_mb=80_000)
    snug = make_node(memory_mb=24_000)
    warm = make_node(memory_mb=24_000, last_status={"weights": [{"source": "hf:org/model-1B", "complete": True}]})
    Replica.objects.create(endpoint=endpoint, node=warm, state=ReplicaState.STOPPED)  # where its weights came from
    first, _ = place_replica(endpoint)
    assert first.node == warm  # holds the weights
    second, _ = place_replica(endpoint)
    assert second.node == snug  # spread first; then best fit leaves the big node free
    third, _ = place_replica(endpoint)
    assert third.node == roomy


NODE_FAULTS = ["RuntimeError: CUDA error: uncorrectable ECC error encountered",
               "engine exited with code -6 3 times in a row",
               "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB",
               "did not become READY within 900 s"]


def broken_node_and_healthy_node(endpoint):
    """A node that held the endpoint's weights (it served there yesterday) and now fails every replica, and an empty
    healthy one."""
    healthy = make_node(memory_mb=24_000)
    broken = make_node(memory_mb=24_000, last_status={"weights": [{"source": endpoint.model_source, "complete": True}]})
    Replica.objects.create(endpoint=endpoint, node=broken, state=ReplicaState.STOPPED)
    return broken, healthy


def fail_on_its_node(replica, attempt):
    assert fail_replica(replica, NODE_FAULTS[attempt % len(NODE_FAULTS)])
    record_replica_failure(replica.endpoint_id, NODE_FAULTS[attempt % len(NODE_FAULTS)])
    Endpoint.objects.filter(pk=replica.endpoint_id).update(next_attempt_at=None)  # its back-off passed


def test_the_retry_of_a_replica_that_failed_goes_to_another_node_before_the_one_holding_its_weights():
    endpoint = EndpointFactory(model_source="hf:org/model-1B", gpu_type="l4", min_replicas=1, max_replicas=1)
    broken, healthy = broken_node_and_healthy_node(endpoint)
    nodes = []
    for attempt in range(8):
        endpoint.refresh_from_db()
        assert endpoint.failed_at is None, f"FAILED after placements on {nodes}: {endpoint.status_message}"
        replica, _ = place_replica(endpoint)
        nodes.append(replica.node)
        if replica.node == healthy:
            break
        fail_on_its_node(replica, attempt)
    assert nodes == [broken, healthy]  # the weights first; after its failure there, elsewhere


def test_a_node_where_the_endpoint_failed_less_is_preferred_and_one_that_failed_is_still_used_when_alone():
    endpoint = EndpointFactory(model_source="hf:org/model-1B", gpu_type="l4", min_replicas=1, max_replicas=1)
    broken, healthy = broken_node_and_healthy_node(endpoint)
    nodes = []
    for attempt in range(4):  # both fail (the tenant's model, say): the retries take turns, fewest failures first
        replica, _ = place_replica(endpoint)
        nodes.append(replica.node)
        fail_on_its_node(replica, attempt)
    assert nodes == [broken, healthy, broken, healthy]
    Node.objects.filter(pk=healthy.pk).update(state=NodeState.CORDONED)
    replica, _ = place_replica(endpoint)
    assert replica.node == broken  # the only node: still placed on


def test_failures_before_the_endpoint_was_last_ready_no_longer_steer_placement():
    endpoint = EndpointFactory(model_source="hf:org/model-1B", gpu_type="l4", min_replicas=1, max_replicas=2)
    broken, healthy = broken_node_and_healthy_node(endpoint)
    failed, _ = place_replica(endpoint)
    fail_on_its_node(failed, 0)
    served, _ = place_replica(endpoint)
    assert served.node == healthy
    Replica.objects.filter(pk=served.pk).update(state=ReplicaState.STOPPED, ready_at=timezone.now(),
                                                stopped_at=timezone.now())
    record_replica_ready(endpoint.pk)
    again, _ = place_replica(endpoint)
    assert again.node == broken  # repaired since, as far as anyone knows: it holds the weights


def test_refuses_wrong_gpu_type_cordoned_offline_and_unsupported_quantization_with_a_reason():
    endpoint = EndpointFactory(gpu_type="h100-80gb", quantization="awq")
    assert place_replica(endpoint) == (None, "no READY node of GPU type h100-80gb")
    make_node(gpu_type="h100-80gb", memory_mb=80_000, state=NodeState.CORDONED, quantizations=("none", "awq"))
    make_node(gpu_type="h100-80gb", memory_mb=80_000, state=NodeState.OFFLINE, quantizations=("none", "awq"))
    assert place_replica(endpoint)[0] is None
    make_node(gpu_type="h100-80gb", memory_mb=80_000, quantizations=("none", "fp8"))
    assert place_replica(endpoint) == (None, "no h100-80gb node supports quantization awq")


def test_skips_a_node_whose_registered_host_the_gateway_refuses(settings):
    settings.ALLOW_LOOPBACK_NODES = False  # registered on loopback before the deployment refused it
    endpoint = EndpointFactory(gpu_type="l4")
    make_node(memory_mb=40_000, advertise_host="127.0.0.1")
    assert place_replica(endpoint) == (None, "no READY node of GPU type l4 the gateway may reach")
    reachable = make_node(memory_mb=80_000, advertise_host="10.0.3.7")  # a looser fit than the refused one
    assert place_replica(endpoint)[0].node == reachable


def test_says_how_much_memory_it_needs_and_logs_what_the_fleet_has_free_for_staff(caplog):
    endpoint = EndpointFactory(model_source="hf:org/big-70B", gpu_type="l4")
    make_node(memory_mb=24_000)
    with caplog.at_level("INFO", logger="endpoints.replicas"):
        replica, reason = place_replica(endpoint)
    assert replica is None and reason == f"no l4 node has {memory_needed_mb(endpoint)} MB of GPU memory free now"
    assert "the most free on a l4 node is 24000 MB" in caplog.text


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    node_memory=st.lists(st.sampled_from([16_000, 24_000, 40_000, 80_000]), min_size=1, max_size=12),
    models=st.lists(st.sampled_from(["hf:o/m-1B", "hf:o/m-3B", "hf:o/m-7B", "hf:o/m-13B", "hf:o/unknown"]), min_size=1, max_size=30),
)
def test_no_gpu_is_ever_over_committed_by_placements_one_after_another(node_memory, models):
    Replica.objects.all().delete()
    Node.objects.all().delete()
    organization = OrganizationFactory()
    nodes = [make_node(memory_mb=memory) for memory in node_memory]
    for index, source in enumerate(models):
        endpoint = EndpointFactory(organization=organization, model_source=source, gpu_type="l4", max_replicas=5)
        for _ in range(1 + index % 3):
            place_replica(endpoint)
    for node in nodes:
        used = Replica.objects.filter(node=node).aggregate(total=Sum("reserved_memory_mb"))["total"] or 0
        assert used <= node.total_gpu_memory_mb


# One placer process: waits for the start signal (a file), then places one replica for each endpoint id it
# was given, as fast as it can, and prints how many it placed.
PLACER = textwrap.dedent("""
    import os, sys, time
    import django

    django.setup()
    from endpoints.models import Endpoint
    from endpoints.replicas import place_replica

    ready_path, go_path, *endpoint_ids = sys.argv[1:]
    endpoints = list(Endpoint.objects.filter(pk__in=endpoint_ids))
    open(ready_path, "w").close()
    while not os.path.exists(go_path):
        time.sleep(0.01)
    print(sum(place_replica(endpoint)[0] is not None for endpoint in endpoints))
""")


@pytest.mark.django_db(transaction=True)
def test_no_gpu_is_ever_over_committed_by_placements_from_several_processes_at_once(tmp_path):
    """Four processes place replicas at the same moment. Best fit sends them all to the fullest node
    that still has room, so they race for the same last slots; the node lock makes them queue."""
    num_processes, endpoints_per_process, num_nodes = 4, 12, 4
    organization = OrganizationFactory()
    endpoints = [EndpointFactory(organization=organization, model_source="hf:o/m-1B", gpu_type="l4", max_model_len=2048)
                 for _ in range(num_processes * endpoints_per_process)]
    needed_mb = memory_needed_mb(endpoints[0])
    slots_per_node = 3
    nodes = [make_node(memory_mb=needed_mb * slots_per_node + needed_mb // 2) for _ in range(num_nodes)]

    go_path = tmp_path / "go"
    placers = []
    for index in range(num_processes):
        mine = endpoints[index * endpoints_per_process:(index + 1) * endpoints_per_process]
        placers.append(subprocess.Popen(
            [sys.executable, "-c", PLACER, str(tmp_path / f"ready-{index}"), str(go_path), *[str(e.pk) for e in mine]],
            cwd=REPO_ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        ))
    wait_until(lambda: all((tmp_path / f"ready-{index}").exists() for index in range(num_processes)), 120,
               message="every placer to be ready")
    go_path.touch()
    outputs = [placer.communicate(timeout=120) for placer in placers]
    assert all(placer.returncode == 0 for placer in placers), [stderr[-2000:] for _, stderr in outputs]

    assert sum(int(stdout) for stdout, _ in outputs) == Replica.objects.count() > 0
    for node in nodes:
        used = Replica.objects.filter(node=node).aggregate(total=Sum("reserved_memory_mb"))["total"] or 0
        assert used <= node.total_gpu_memory_mb, f"{node.name}: {used} MB reserved of {node.total_gpu_memory_mb} MB"
    assert Replica.objects.count() == num_nodes * slots_per_node  # every slot taken, none twice


def test_a_reported_weights_size_replaces_the_estimate_from_the_name():
    from endpoints.fleet.services import record_model_facts
    from gpu_agent.protocol import WeightsStatus

    endpoint = EndpointFactory(model_source="hf:org/model-8B", gpu_type="l4")
    guessed = weights_size_mb(endpoint)
    make_node(memory_mb=24_000)
    running = make_node(memory_mb=24_000)
    Replica.objects.create(endpoint=endpoint, node=running, state=ReplicaState.STARTING)
    record_model_facts(running, [WeightsStatus(source="hf:org/other", cache_key="o", size_bytes=9 * 2**30),
                                 WeightsStatus(source="hf:org/model-8B", cache_key="m", size_bytes=2 * 2**30)])
    assert guessed != 2048 and weights_size_mb(endpoint) == 2048


def test_a_node_not_running_a_source_cannot_make_it_unplaceable():
    """Sizes come only from nodes given replicas of the source: a node listing a petabyte for a model it
    does not run (hostile, or its cache stale) changes no endpoint's placement."""
    from endpoints.fleet.services import record_heartbeat
    from gpu_agent.protocol import Heartbeat, WeightsStatus

    endpoint = EndpointFactory(model_source="hf:org/model-8B", gpu_type="l4")
    guessed = weights_size_mb(endpoint)
    liar = make_node(memory_mb=24_000)
    record_heartbeat(liar, Heartbeat(agent_version="0.1.0", num_cpus=2, memory_mb=24_000, memory_used_mb=1_000, weights=[
        WeightsStatus(source="hf:org/model-8B", cache_key="m", size_bytes=10**15, complete=True)]))
    assert weights_size_mb(endpoint) == guessed


def _gpu(index, memory_mb):
    from gpu_agent.protocol import GpuStatus

    return GpuStatus(index=index, name="NVIDIA L4", utilization_percent=0.0, memory_used_mb=0, memory_total_mb=memory_mb,
                     uuid=f"GPU-{index:04d}")


def _beat(node, gpus=(), weights=()):
    from endpoints.fleet.services import record_heartbeat
    from gpu_agent.protocol import Heartbeat

    record_heartbeat(node, Heartbeat(agent_version="0.1.0", num_cpus=2, memory_mb=24_000, memory_used_mb=1_000,
                                     gpus=list(gpus), weights=list(weights)))
    node.refresh_from_db()


def test_a_heartbeat_cannot_give_a_node_more_gpus_or_memory_than_it_registered():
    """A machine holding one node's secret lists 64 GPUs of a terabyte each: placement still sees the one L4 it
    registered, and staff see what was ignored (before, the heartbeat's list replaced the node's, and the machine
    won replicas, their specs and prompts, that no honest node could hold)."""
    from controlplane.accounts.models import AuditEvent

    node = make_node(memory_mb=23_034, gpus=[{"index": 0, "uuid": "GPU-0000", "name": "NVIDIA L4", "memory_mb": 23_034,
                                              "mig_slices": []}])
    _beat(node, gpus=[_gpu(0, 23_034)])
    assert "gpus_ignored" not in node.last_status  # the honest report: nothing ignored
    seventy_b = EndpointFactory(model_source="hf:org/model-70B", gpu_type="l4", gpus_per_replica=8)
    for _ in range(2):
        _beat(node, gpus=[_gpu(index, 10**9) for index in range(64)])
    assert [(gpu["index"], gpu["memory_mb"]) for gpu in node.gpus] == [(0, 23_034)]
    assert node.last_status["gpus_ignored"] == "63 GPU(s) past the 1 it may have; memory past 23034 MiB per GPU"
    assert AuditEvent.objects.filter(action="node.gpus_ignored", target_id=str(node.pk)).count() == 1  # once, not per beat
    replica, reason = place_replica(seventy_b)
    assert replica is None and reason.startswith("no l4 node has 8 free GPUs with ")


def test_a_pool_nodes_gpus_are_bounded_by_its_pools_shape():
    """A pool's machine is what staff made the pool: one L4, whatever its agent registered or reports."""
    from endpoints.nodes.models import LaunchState, NodeLaunch, NodePool

    pool = NodePool.objects.create(name="l4s", gpu_type="l4", provider="local", gpus_per_node=1, gpu_memory_mb=23_034)
    node = make_node(num_gpus=4, memory_mb=81_920)
    NodeLaunch.objects.create(pool=pool, node=node, state=LaunchState.JOINED, deadline_at=timezone.now())
    _beat(node, gpus=[_gpu(index, 81_920) for index in range(4)])
    assert [(gpu["index"], gpu["memory_mb"]) for gpu in node.gpus] == [(0, 23_034)]


def test_a_nodes_claim_to_hold_weights_counts_only_for_a_copy_it_was_given():
    """A node that claims a complete copy of a tenant's private model it was never given is not preferred for it:
    best fit places the replica (before, the claim won the first replica of any endpoint, and with it the spec's
    credentials and the prompts). A copy of that name it was given for another tenant does not count either; one
    it was given for this tenant's endpoint does."""
    from gpu_agent.protocol import WeightsStatus

    source = "hf:tenant-a/private-1B"
    endpoint = EndpointFactory(model_source=source, gpu_type="l4", max_replicas=3)
    claim = WeightsStatus(source=source, cache_key="k", size_bytes=2 << 30, downloaded_bytes=2 << 30, complete=True)
    snug = make_node(memory_mb=24_000)
    liar = make_node(memory_mb=80_000)
    _beat(liar, weights=[claim])

    def first_placement():
        replica, _ = place_replica(endpoint)
        Replica.objects.filter(endpoint=endpoint).delete()
        return replica.node

    assert first_placement() == snug
    Replica.objects.create(endpoint=EndpointFactory(model_source=source, gpu_type="l4"), node=liar, state=ReplicaState.STOPPED)
    assert first_placement() == snug  # another tenant's copy of that name is not this one
    Replica.objects.create(endpoint=endpoint, node=liar, state=ReplicaState.STOPPED)
    assert place_replica(endpoint)[0].node == liar  # the copy it was given: its cache is worth a preference


def _live_replica(source, node, **endpoint_fields):
    endpoint = EndpointFactory(model_source=source, gpu_type=node.gpu_type, **endpoint_fields)
    Replica.objects.create(endpoint=endpoint, node=node, state=ReplicaState.READY)
    return endpoint


def _facts(size_bytes=16 << 30, context=8192, architecture="LlamaForCausalLM", source="hf:org/model-8B", scope=None):
    from gpu_agent.protocol import ModelInfo, WeightsStatus

    return WeightsStatus(source=source, cache_key="k", size_bytes=size_bytes, downloaded_bytes=size_bytes, complete=True,
                         scope=scope, model_info=ModelInfo(max_model_len=context, architecture=architecture))


def test_a_node_that_no_longer_runs_a_source_cannot_change_its_facts():
    """Replica rows are kept for ever: a node that ran a model once is not one that runs it now."""
    from endpoints.fleet.services import record_model_facts

    endpoint = EndpointFactory(model_source="hf:org/model-8B", gpu_type="l4")
    guessed = weights_size_mb(endpoint)
    node = make_node(memory_mb=24_000)
    Replica.objects.create(endpoint=endpoint, node=node, state=ReplicaState.STOPPED)
    record_model_facts(node, [_facts(size_bytes=20 << 30, source=endpoint.model_source)])
    assert weights_size_mb(endpoint) == guessed


def test_a_model_fact_past_what_a_model_can_be_is_not_kept():
    """A node running a model reports a context of one token and 4 EiB of weights: neither is kept (before, the
    size made the model unplaceable for every endpoint of it, the context refused every call)."""
    from endpoints.fleet.services import record_model_facts
    from endpoints.models import UNKNOWN_CONTEXT_LENGTH

    node = make_node(memory_mb=24_000)
    endpoint = _live_replica("hf:org/model-8B", node)
    guessed = weights_size_mb(endpoint)
    record_model_facts(node, [_facts(size_bytes=2**62, context=1)])
    endpoint.refresh_from_db()
    assert (weights_size_mb(endpoint), endpoint.context_length) == (guessed, UNKNOWN_CONTEXT_LENGTH)
    record_model_facts(node, [_facts(size_bytes=16 << 30, context=1)])  # one figure out of bounds: the report is refused whole
    assert weights_size_mb(endpoint) == guessed
    record_model_facts(node, [_facts(size_bytes=16 << 30, context=8192)])
    endpoint.refresh_from_db()
    assert (weights_size_mb(endpoint), endpoint.context_length) == (16 << 10, 8192)


def test_a_size_past_what_its_node_could_hold_leaves_out_the_size_not_the_rest_of_the_report():
    """An agent's size is every file of the repository, and some hold the weights twice (a `.pth` beside the
    safetensors: 32 GB for an 8B model on one 24 GB L4). The whole report was refused, and its context never learned."""
    from endpoints.fleet.services import record_model_facts

    node = make_node(memory_mb=24_000)
    endpoint = _live_replica("hf:org/model-8B", node)
    guessed = weights_size_mb(endpoint)
    record_model_facts(node, [_facts(size_bytes=32 << 30, context=8192)])
    endpoint.refresh_from_db()
    assert (weights_size_mb(endpoint), endpoint.context_length) == (guessed, 8192)


def test_one_node_cannot_change_a_shared_models_facts_but_two_agreeing_nodes_can():
    """A catalogue model's facts are every tenant's. One node running a replica of it (another tenant's) reports a
    larger size, a shorter context and another architecture: every tenant's endpoints keep what was learned (before,
    the last report stood). A second node reporting the same (the model changed upstream, read afresh) changes it."""
    from endpoints.fleet.services import record_model_facts
    from endpoints.models import AllowedSource

    AllowedSource.objects.create(pattern="hf:org/")
    honest, liar, second = (make_node(memory_mb=24_000) for _ in range(3))
    endpoint = _live_replica("hf:org/model-8B", honest)
    assert endpoint.weights_scope == ""
    record_model_facts(honest, [_facts(scope="")])
    _live_replica("hf:org/model-8B", liar)
    changed = _facts(size_bytes=20 << 30, context=512, architecture="BertModel", scope="")
    for _ in range(2):
        record_model_facts(liar, [changed])
    endpoint.refresh_from_db()
    assert (weights_size_mb(endpoint), endpoint.context_length, endpoint.serving_task) == (16 << 10, 8192, "generate")
    _live_replica("hf:org/model-8B", second)
    record_model_facts(second, [changed])
    endpoint.refresh_from_db()
    assert (weights_size_mb(endpoint), endpoint.context_length, endpoint.serving_task) == (20 << 10, 512, "embed")
