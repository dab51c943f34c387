"""GPUs as units: placement gives each replica specific GPUs of one node, and the agent's engine sees only those.

From the node's reported GPUs through `place_replica` and the replica spec the agent receives, to the
engine's command line and environment (`build_engine_command`), for 1-, 2- and 8-GPU nodes.
"""

import time

import pytest
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.accounts.models import Plan
from controlplane.accounts.services import SYSTEM, save_plan, set_organization_plan
from endpoints import scheduler
from endpoints.autoscaler import Load
from endpoints.fleet.services import create_join_token, replica_spec
from endpoints.models import Replica
from endpoints.nodes.models import Node
from endpoints.placement import WHOLE_GPU_MEMORY_FRACTION
from endpoints.replicas import place_replica
from gpu_agent.protocol import GpuStatus, Heartbeat
from gpu_agent.runtime.engine import build_engine_command
from tests.factories import EndpointFactory, OrganizationFactory

pytestmark = pytest.mark.django_db

H100_MB = 81_559
_counter = iter(range(10**9))


def gpu_list(num_gpus, memory_mb=H100_MB, mig=()):
    return [{"index": index, "uuid": f"GPU-{index:04d}-node", "name": "NVIDIA H100 80GB HBM3", "memory_mb": memory_mb,
             "mig_slices": [{"uuid": f"MIG-{index}", "profile": "3g.40gb", "memory_mb": 40960}] if index in mig else []}
            for index in range(num_gpus)]


def make_gpu_node(num_gpus, memory_mb=H100_MB, gpu_type="h100-80gb", **extra):
    n = next(_counter)
    return Node.objects.create(name=f"gpu-node-{n:05d}", gpu_type=gpu_type, num_gpus=num_gpus, gpu_memory_mb=memory_mb,
                               secret_lookup=f"g{n:011d}", secret_digest="x", quantizations=["none", "fp8"],
                               last_heartbeat_at=timezone.now(), gpus=gpu_list(num_gpus, memory_mb, **extra))


def engine_of(replica):
    """The command line and environment the agent starts this replica's engine with."""
    replica = Replica.objects.select_related("endpoint", "node").get(pk=replica.pk)
    return build_engine_command(replica_spec(replica), "/models/m", port=20001, device="cuda")


def flag(argv, name):
    return argv[argv.index(name) + 1]


def small_endpoint(**fields):
    return EndpointFactory(model_source="hf:org/model-1B", gpu_type="h100-80gb", max_model_len=4096, **fields)


def test_eight_one_gpu_replicas_on_an_eight_gpu_node_each_run_on_their_own_gpu_and_a_ninth_waits_saying_why(caplog):
    node = make_gpu_node(8)
    organization = OrganizationFactory()
    replicas = [place_replica(small_endpoint(organization=organization))[0] for _ in range(8)]
    assert all(replica is not None and replica.node == node for replica in replicas)
    engines = [engine_of(replica) for replica in replicas]
    assert sorted(engine.env["CUDA_VISIBLE_DEVICES"] for engine in engines) == [str(index) for index in range(8)]
    assert all(flag(engine.argv, "--gpu-memory-utilization") == str(WHOLE_GPU_MEMORY_FRACTION) for engine in engines)

    with caplog.at_level("INFO", logger="endpoints.replicas"):
        ninth, reason = place_replica(small_endpoint(organization=organization))
    assert ninth is None
    # The tenant reads what its replica needs; staff's log, what the fleet has free.
    assert reason.startswith("no h100-80gb node has a free GPU with ") and reason.endswith(" MB each now")
    assert "the most on one h100-80gb node is 0 free GPUs" in caplog.text


def test_a_two_gpu_replica_on_a_two_gpu_node_runs_tensor_parallel_over_both():
    make_gpu_node(2)
    replica, reason = place_replica(small_endpoint(gpus_per_replica=2))
    assert replica.gpu_indices == [0, 1] and "GPU 0,1" in reason
    engine = engine_of(replica)
    assert engine.env["CUDA_VISIBLE_DEVICES"] == "0,1" and flag(engine.argv, "--tensor-parallel-size") == "2"
    assert place_replica(small_endpoint())[0] is None  # both GPUs are taken whole


def test_an_eight_gpu_replica_takes_the_whole_node():
    make_gpu_node(8)
    replica, _ = place_replica(EndpointFactory(model_source="hf:org/big-405B", gpu_type="h100-80gb", quantization="fp8",
                                               max_model_len=4096, max_num_seqs=8, gpus_per_replica=8))
    engine = engine_of(replica)
    assert engine.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7" and flag(engine.argv, "--tensor-parallel-size") == "8"


def test_a_tensor_parallel_replica_never_spans_nodes(caplog):
    first, second = make_gpu_node(2), make_gpu_node(2)
    spread = small_endpoint(max_replicas=2)
    for _ in (first, second):  # one GPU of each node taken: one endpoint's replicas spread over nodes
        assert place_replica(spread)[0] is not None
    assert sorted(Replica.objects.values_list("node", flat=True)) == sorted([first.pk, second.pk])
    with caplog.at_level("INFO", logger="endpoints.replicas"):
        replica, reason = place_replica(small_endpoint(gpus_per_replica=2))
    assert replica is None
    assert reason.startswith("no h100-80gb node has 2 free GPUs with ") and reason.endswith(" MB each now")
    assert "needs 2 free GPUs on one node" in caplog.text and "the most on one h100-80gb node is 1 free GPU" in caplog.text


def test_replicas_that_allow_sharing_share_one_gpu_with_fractions_that_sum_to_at_most_one():
    node = make_gpu_node(1)
    endpoint = small_endpoint(allow_gpu_sharing=True, max_replicas=10)
    placed = []
    while (replica := place_replica(endpoint)[0]) is not None:
        placed.append(replica)
    assert len(placed) >= 2 and all(replica.node == node and replica.gpu_indices == [0] for replica in placed)
    fractions = [float(flag(engine_of(replica).argv, "--gpu-memory-utilization")) for replica in placed]
    assert sum(fractions) <= WHOLE_GPU_MEMORY_FRACTION <= 1
    assert all(engine_of(replica).env["CUDA_VISIBLE_DEVICES"] == "0" for replica in placed)
    assert place_replica(small_endpoint())[0] is None  # a replica that does not share never joins them


def test_a_sharing_replica_never_joins_a_gpu_held_whole_and_best_fit_fills_shared_gpus_first():
    make_gpu_node(2)
    whole, _ = place_replica(small_endpoint())
    sharing = small_endpoint(allow_gpu_sharing=True, max_replicas=3)
    first, _ = place_replica(sharing)
    second, _ = place_replica(sharing)
    assert whole.gpu_indices == [0]
    assert first.gpu_indices == second.gpu_indices == [1]


def test_best_fit_sends_a_one_gpu_replica_to_the_node_with_the_fewest_free_gpus():
    roomy, snug = make_gpu_node(8), make_gpu_node(2)
    place_replica(small_endpoint())  # lands on the snug node: it leaves the least free
    replica, _ = place_replica(small_endpoint())
    assert replica.node == snug and replica.gpu_indices == [1]
    assert place_replica(small_endpoint())[0].node == roomy


def test_mig_partitioned_gpus_are_not_placed_on():
    make_gpu_node(2, mig=(0,))
    replica, _ = place_replica(small_endpoint())
    assert replica.gpu_indices == [1]
    assert place_replica(small_endpoint())[0] is None


def test_a_node_without_a_gpu_list_keeps_pooled_placement_and_its_engines_see_every_gpu():
    n = next(_counter)
    Node.objects.create(name=f"old-agent-{n}", gpu_type="h100-80gb", num_gpus=2, gpu_memory_mb=H100_MB,
                        secret_lookup=f"o{n:011d}", secret_digest="x", quantizations=["none"], last_heartbeat_at=timezone.now())
    organization = OrganizationFactory()
    replicas = [place_replica(small_endpoint(organization=organization))[0] for _ in range(3)]
    assert all(replica is not None and replica.gpu_indices == [] for replica in replicas)
    assert all("CUDA_VISIBLE_DEVICES" not in engine_of(replica).env for replica in replicas)


def test_a_registered_node_keeps_its_gpus_and_a_heartbeat_naming_new_ones_replaces_them(client):
    token = create_join_token(SYSTEM, name="gpus").plain
    gpus = [GpuStatus(index=index, uuid=f"GPU-{index}-aaaa", name="NVIDIA L4", utilization_percent=0.0, memory_used_mb=0,
                      memory_total_mb=23_034).to_dict() for index in range(2)]
    answer = client.post("/agent/v1/register", {
        "join_token": token, "name": "l4-pair", "gpu_type": "l4", "num_gpus": 2, "gpu_memory_mb": 23_034, "num_cpus": 8,
        "memory_mb": 64_000, "agent_version": "0.2.0", "gpus": gpus,
    }, content_type="application/json").json()
    node = Node.objects.get(pk=answer["node_id"])
    assert [(gpu["index"], gpu["uuid"], gpu["memory_mb"]) for gpu in node.gpus] == [(0, "GPU-0-aaaa", 23_034), (1, "GPU-1-aaaa", 23_034)]
    swapped = [GpuStatus.from_dict(dict(gpus[0], uuid="GPU-0-bbbb")), GpuStatus.from_dict(gpus[1])]
    body = Heartbeat(agent_version="0.2.0", num_cpus=8, memory_mb=64_000, memory_used_mb=1, gpus=swapped).to_dict()
    assert client.post("/agent/v1/heartbeat", body, content_type="application/json",
                       HTTP_AUTHORIZATION=f"Bearer {answer['node_secret']}").status_code == 200
    node.refresh_from_db()
    assert node.gpus[0]["uuid"] == "GPU-0-bbbb"


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    node_sizes=st.lists(st.sampled_from([1, 2, 4, 8]), min_size=1, max_size=4),
    asks=st.lists(st.tuples(st.sampled_from(["hf:o/m-1B", "hf:o/m-7B", "hf:o/m-13B"]), st.sampled_from([1, 2, 4]),
                            st.booleans()), min_size=1, max_size=16),
)
def test_no_gpu_is_ever_held_whole_by_two_replicas_or_over_committed_by_sharing_ones(node_sizes, asks):
    Replica.objects.all().delete()
    Node.objects.all().delete()
    organization = OrganizationFactory()
    nodes = [make_gpu_node(size) for size in node_sizes]
    for source, num_gpus, share in asks:
        place_replica(EndpointFactory(organization=organization, model_source=source, gpu_type="h100-80gb",
                                      max_model_len=4096, gpus_per_replica=num_gpus, allow_gpu_sharing=share and num_gpus == 1))
    for node in nodes:
        holders: dict[int, list[Replica]] = {}
        for replica in Replica.objects.filter(node=node):
            assert len(replica.gpu_indices) == replica.endpoint.gpus_per_replica  # all its GPUs on this one node
            for index in replica.gpu_indices:
                holders.setdefault(index, []).append(replica)
        for index, replicas in holders.items():
            if len(replicas) > 1:
                assert all(replica.gpu_memory_fraction is not None for replica in replicas), f"GPU {index} held whole twice"
                assert sum(replica.gpu_memory_fraction for replica in replicas) <= WHOLE_GPU_MEMORY_FRACTION
                assert sum(replica.reserved_memory_mb for replica in replicas) <= H100_MB * WHOLE_GPU_MEMORY_FRACTION


def test_the_gpu_quota_counts_the_gpus_of_tensor_parallel_replicas_not_the_replicas():
    organization = OrganizationFactory()
    plan = save_plan(SYSTEM, Plan(name="three-h100s", max_replicas=8, max_gpus_by_type={"h100-80gb": 3}))
    set_organization_plan(SYSTEM, organization, plan)
    make_gpu_node(8)
    endpoint = small_endpoint(organization=organization, gpus_per_replica=2, max_replicas=3, target_concurrency=1)

    scheduler.reconcile_endpoint(str(endpoint.pk), Load(5, 0, time.time(), 5))

    endpoint.refresh_from_db()
    assert endpoint.replicas.count() == 1  # a second would hold 4 GPUs
    assert endpoint.status_message == "waiting for quota: your plan allows 3 h100-80gb GPUs at once and your endpoints hold 2"
