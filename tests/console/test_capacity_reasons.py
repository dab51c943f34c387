"""What a tenant reads of an endpoint waiting for capacity says what its replica needs, never what the fleet's nodes
have free (other tenants' use of them); staff's log keeps that figure. Before, the endpoint's status, its events (API
and console) read "the most free on a l4 node is 3500 MB", and a sleeper that could not wake "its node has N MB of GPU
memory free": any tenant could watch the fleet's free memory, and so its neighbours' load."""

import contextlib
import importlib
import threading

import pytest
from django.apps import apps
from django.db import OperationalError, connection, transaction
from django.utils import timezone

from controlplane.management.commands.migrate import LockTimeout
from endpoints import scheduler
from endpoints.autoscaler import Load
from endpoints.events import record_event
from endpoints.fleet.pool_demand import PROVISIONING_MESSAGE
from endpoints.models import Endpoint, EventKind, Replica
from endpoints.nodes.models import NodePool
from endpoints.placement import GpuHold, choose_node, memory_needed_mb, room_to_wake
from endpoints.replicas import place_replica
from gpu_agent.protocol import ReplicaState
from tests.factories import EndpointFactory
from tests.test_gpu_placement import make_gpu_node, small_endpoint
from tests.test_placement import make_node

pytestmark = pytest.mark.django_db

SCRUB = importlib.import_module("endpoints.migrations.0028_scrub_fleet_memory_from_tenant_reasons")

NODE_MB, NEIGHBOUR_MB = 24_000, 20_500
FREE_MB = NODE_MB - NEIGHBOUR_MB  # 3500: what the fleet has free, staff's


def _waiting_endpoint(org, caplog):
    node = make_node(memory_mb=NODE_MB)
    neighbour = EndpointFactory(gpu_type="l4", model_source="hf:org/model-1B")  # another organisation's
    Replica.objects.create(endpoint=neighbour, node=node, state=ReplicaState.READY, reserved_memory_mb=NEIGHBOUR_MB,
                           ready_at=timezone.now())
    endpoint = EndpointFactory(organization=org, gpu_type="l4", model_source="hf:org/model-7B", min_replicas=1)
    with caplog.at_level("INFO", logger="endpoints.replicas"):
        scheduler.reconcile_endpoint(str(endpoint.pk), Load(0, 0, None, 0))
    endpoint.refresh_from_db()
    return endpoint


def test_a_tenant_reads_what_its_replica_needs_and_no_node_memory_figure(owner, org, caplog):
    endpoint = _waiting_endpoint(org, caplog)
    needed_mb = memory_needed_mb(endpoint)
    assert str(FREE_MB) not in str(needed_mb) and str(NODE_MB) not in str(needed_mb)
    assert endpoint.status_message == f"waiting for capacity: no l4 node has {needed_mb} MB of GPU memory free now"

    seen = {
        "endpoint API": owner.get(f"/api/v1/endpoints/{endpoint.pk}/").content.decode(),
        "events API": owner.get(f"/api/v1/endpoints/{endpoint.pk}/events/").content.decode(),
        "endpoints list API": owner.get("/api/v1/endpoints/").content.decode(),
        "console page": owner.get(f"/console/endpoints/{endpoint.pk}/").content.decode(),
        "console list": owner.get("/console/endpoints/").content.decode(),
    }
    assert f"{needed_mb} MB of GPU memory free now" in seen["events API"]
    assert f"{needed_mb} MB of GPU memory free now" in seen["console page"]
    for where, text in seen.items():
        assert f"{FREE_MB} MB" not in text and str(FREE_MB) not in text, where
        assert "the most free" not in text, where
    # Staff keep the figure: the log says what the fleet had free.
    assert f"the most free on a l4 node is {FREE_MB} MB" in caplog.text


def test_the_staff_log_line_is_written_once_per_change_of_what_the_tenant_reads(org, caplog):
    endpoint = _waiting_endpoint(org, caplog)
    with caplog.at_level("INFO", logger="endpoints.replicas"):
        scheduler.reconcile_endpoint(str(endpoint.pk), Load(0, 0, None, 0))
    assert caplog.text.count("the most free on a l4 node") == 1


def test_the_staff_log_line_is_written_once_while_a_pool_provisions_a_node_not_every_tick(org, caplog):
    NodePool.objects.create(name="l4-pool", gpu_type="l4", provider="local", gpus_per_node=1, gpu_memory_mb=80_000,
                            max_nodes=1)
    endpoint = _waiting_endpoint(org, caplog)
    assert endpoint.status_message == PROVISIONING_MESSAGE  # what the tenant reads names no reason to compare with
    with caplog.at_level("INFO", logger="endpoints.replicas"):
        for _ in range(3):
            scheduler.reconcile_endpoint(str(endpoint.pk), Load(0, 0, None, 0))
    # Before: 4, one per tick.
    assert caplog.text.count("the most free on a l4 node") == 1


def test_a_sleeper_that_cannot_wake_on_a_pooled_node_is_told_no_figure_of_the_node():
    node = make_node(memory_mb=NODE_MB)
    why_not = room_to_wake(node, [GpuHold((), NEIGHBOUR_MB, shared=False)], NEIGHBOUR_MB, GpuHold((), 8_000, shared=False))
    assert why_not == "its node no longer has the 8000 MB it needs free"
    assert str(FREE_MB) not in why_not


def test_a_sharing_replica_that_finds_no_room_is_told_what_it_needs_and_staff_what_the_gpu_has(caplog):
    make_gpu_node(1)
    sharing = small_endpoint(allow_gpu_sharing=True, max_replicas=50)
    with caplog.at_level("INFO", logger="endpoints.replicas"):
        while (placed := place_replica(sharing))[0] is not None:
            pass
    reason = placed[1]
    assert reason == f"no h100-80gb GPU has {memory_needed_mb(sharing)} MB free to share now"
    assert "the most free on one h100-80gb GPU is " in caplog.text


def test_the_figures_kept_in_old_events_and_statuses_are_scrubbed_by_the_migration(owner, org):
    endpoint = EndpointFactory(organization=org, gpu_type="l4")
    old = ["waiting for capacity: needs 2816 MB of GPU memory, the most free on a l4 node is 1024 MB",
           "Provisioning a node (pool p): needs 4298 MB of a shared GPU, the most free on one l4 GPU is 337 MB",
           "waiting for capacity: needs a free GPU with 4298 MB each, the most on one l4 node is 0 free GPUs",
           "Replica 1234abcd STOPPED: could not wake: its node has 1024 MB of GPU memory free, it needs 8000 MB; a new "
           "replica starts instead",
           "Scale up 0 → 1: floor 1"]
    for message in old:
        record_event(endpoint, EventKind.CAPACITY, message)
    Endpoint.objects.filter(pk=endpoint.pk).update(status_message=old[0])

    SCRUB.scrub_fleet_memory(apps, None)

    messages = set(endpoint.events.values_list("message", flat=True))
    assert messages == {
        "waiting for capacity: needs 2816 MB of GPU memory",
        "Provisioning a node (pool p): needs 4298 MB of a shared GPU",
        "waiting for capacity: needs a free GPU with 4298 MB each",
        "Replica 1234abcd STOPPED: could not wake: its node no longer has the 8000 MB it needs free; a new replica "
        "starts instead",
        "Scale up 0 → 1: floor 1"}
    assert Endpoint.objects.get(pk=endpoint.pk).status_message == "waiting for capacity: needs 2816 MB of GPU memory"
    events_page = owner.get(f"/api/v1/endpoints/{endpoint.pk}/events/").content.decode()
    assert "1024" not in events_page and "337" not in events_page


def test_an_overcommitted_nodes_free_memory_is_zero_for_staff_never_negative():
    node = make_node(memory_mb=4_000)  # a heartbeat lowered it below what its replicas reserved
    decision = choose_node(EndpointFactory(gpu_type="l4"), 3_000, [node], {node.pk: 6_000}, {})
    assert decision.node is None
    # Before: "… the most free on a l4 node is -2000 MB".
    assert decision.fleet_detail == "needs 3000 MB of GPU memory, the most free on a l4 node is 0 MB"


def test_the_migration_scrubs_the_negative_figures_of_overcommitted_nodes_in_every_batch_of_events(org, monkeypatch):
    endpoint = EndpointFactory(organization=org, gpu_type="l4")
    old = {"waiting for capacity: needs 2816 MB of GPU memory, the most free on a l4 node is -1024 MB":
           "waiting for capacity: needs 2816 MB of GPU memory",
           "Replica 1234abcd STOPPED: could not wake: its node has -512 MB of GPU memory free, it needs 8000 MB":
           "Replica 1234abcd STOPPED: could not wake: its node no longer has the 8000 MB it needs free",
           "Provisioning a node (pool p): needs 4298 MB of a shared GPU, the most free on one l4 GPU is 337 MB":
           "Provisioning a node (pool p): needs 4298 MB of a shared GPU",
           "Scale up 0 → 1: floor 1": "Scale up 0 → 1: floor 1"}
    for message in [*old, *old]:
        record_event(endpoint, EventKind.CAPACITY, message)
    monkeypatch.setattr(SCRUB, "EVENT_IDS_PER_BATCH", 3)  # the ids span three batches and a part

    SCRUB.scrub_fleet_memory(apps, None)
    SCRUB.scrub_fleet_memory(apps, None)  # as `migrate` runs it again after a lock it did not get: no change

    # Before: the negative figures were left, served to the tenant.
    assert sorted(endpoint.events.values_list("message", flat=True)) == sorted([*old.values(), *old.values()])


@pytest.mark.django_db(transaction=True)
def test_the_migration_keeps_what_it_scrubbed_when_an_endpoint_row_is_held_past_migrates_lock_timeout(org):
    endpoint = EndpointFactory(organization=org, gpu_type="l4")
    old = "waiting for capacity: needs 2816 MB of GPU memory, the most free on a l4 node is 1024 MB"
    record_event(endpoint, EventKind.CAPACITY, old)
    Endpoint.objects.filter(pk=endpoint.pk).update(status_message=old)
    held, done = threading.Event(), threading.Event()

    def scheduler_tick_holding_the_row():
        try:
            with transaction.atomic():
                list(Endpoint.objects.select_for_update().filter(pk=endpoint.pk))
                held.set()
                done.wait(30)
        finally:
            connection.close()

    holder = threading.Thread(target=scheduler_tick_holding_the_row)
    holder.start()
    try:
        assert held.wait(30)
        # As Django's executor runs the migration (in one transaction when it is atomic), under `migrate`'s timeout.
        in_its_transaction = transaction.atomic() if SCRUB.Migration.atomic else contextlib.nullcontext()
        with connection.execute_wrapper(LockTimeout(0.3)), pytest.raises(OperationalError), in_its_transaction:
            SCRUB.scrub_fleet_memory(apps, None)
    finally:
        done.set()
        holder.join(30)

    # Before: the whole migration rolled back (one transaction): the event kept its figure until a retry got every lock.
    assert endpoint.events.get().message == "waiting for capacity: needs 2816 MB of GPU memory"
    SCRUB.scrub_fleet_memory(apps, None)  # `migrate`'s next run
    assert Endpoint.objects.get(pk=endpoint.pk).status_message == "waiting for capacity: needs 2816 MB of GPU memory"


def test_what_pods_before_0028_wrote_while_it_rolled_out_is_scrubbed_by_a_later_migration(org):
    """0028 runs first in its deploy while pods of the code before it still serve: what they wrote after it stays
    unless a later migration repeats it (README, *What a release may assume*). Before endpoints/0029, nothing did."""
    from django.db.migrations.loader import MigrationLoader
    from django.db.migrations.operations import RunPython

    endpoint = EndpointFactory(organization=org, gpu_type="l4")
    SCRUB.scrub_fleet_memory(apps, None)  # 0028, at the start of its deploy
    old = "waiting for capacity: needs 2816 MB of GPU memory, the most free on a l4 node is 1024 MB"
    record_event(endpoint, EventKind.CAPACITY, old)  # an old pod's placement, minutes later
    Endpoint.objects.filter(pk=endpoint.pk).update(status_message=old)

    graph = MigrationLoader(connection).graph
    (leaf,) = graph.leaf_nodes("endpoints")
    after_0028 = graph.forwards_plan(leaf)
    after_0028 = after_0028[after_0028.index(("endpoints", SCRUB.__name__.rsplit(".", 1)[1])) + 1:]
    for key in after_0028:
        for operation in graph.nodes[key].operations:
            if isinstance(operation, RunPython):
                operation.code(apps, None)

    assert endpoint.events.get().message == "waiting for capacity: needs 2816 MB of GPU memory"
    assert Endpoint.objects.get(pk=endpoint.pk).status_message == "waiting for capacity: needs 2816 MB of GPU memory"
