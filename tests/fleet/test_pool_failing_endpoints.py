"""What a tenant's endpoints may make a node pool launch: only replicas that can be placed and served.

The pool tick (`endpoints.fleet.pools`) and the scheduler against a real database and Redis, with the recording
provider of `test_pool_policy.py`: a machine launched is one the operator pays for, so every launch here is counted.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.accounts.models import Plan
from controlplane.accounts.services import SYSTEM, save_plan, set_organization_plan
from endpoints.fleet.pool_demand import PROVISIONING_MESSAGE
from endpoints.fleet.pool_services import update_node_pool
from endpoints.fleet.providers.local import DEFAULT_ENGINE_PORTS
from endpoints.models import EndpointEvent, Replica
from endpoints.nodes.models import Node, NodeLaunch
from endpoints.scheduler import reconcile_endpoint
from tests.factories import EndpointFactory, OrganizationFactory
from tests.fleet.test_pool_policy import TINY, RecordingProvider, join, make_pool, tick

pytestmark = pytest.mark.django_db

# A machine of this pool holds one replica of TINY (about 2.8 GB reserved on CPU).
ONE_REPLICA_MB = 4000


def organization_allowed(num_replicas: int):
    organization = OrganizationFactory()
    plan = save_plan(SYSTEM, Plan(name=f"allows-{num_replicas}-{organization.pk}", max_replicas=num_replicas, max_min_replicas=100))
    set_organization_plan(SYSTEM, organization, plan)
    return organization


def test_many_endpoints_wanting_replicas_launch_no_more_machines_than_their_organisations_quota_allows():
    """Before: each endpoint's quota check counted replicas held, not the ones waiting for a machine, so five endpoints
    of an organisation allowed two replicas each recorded one unplaced replica and the pool launched five machines."""
    pool, provider = make_pool(gpu_memory_mb=ONE_REPLICA_MB, max_nodes=10), RecordingProvider()
    organization = organization_allowed(2)
    for _ in range(5):
        endpoint = EndpointFactory(organization=organization, gpu_type="cpu", model_source=TINY, quantization="none",
                                   min_replicas=1)
        reconcile_endpoint(str(endpoint.pk))
    assert tick(provider) == 2
    assert NodeLaunch.objects.filter(pool=pool).count() == 2


def test_one_endpoint_wanting_more_replicas_than_its_quota_allows_launches_only_what_it_may_hold():
    """Before: the replicas a scale-up could not place were all demand (4), though the quota refuses all but one."""
    pool, provider = make_pool(gpu_memory_mb=ONE_REPLICA_MB, max_nodes=10), RecordingProvider()
    endpoint = EndpointFactory(organization=organization_allowed(1), gpu_type="cpu", model_source=TINY,
                               quantization="none", min_replicas=4, max_replicas=4)
    reconcile_endpoint(str(endpoint.pk))
    endpoint.refresh_from_db()
    assert endpoint.unplaced_replicas == 1
    assert tick(provider) == 1 and NodeLaunch.objects.filter(pool=pool).count() == 1


def test_another_organisations_quota_is_its_own():
    pool, provider = make_pool(gpu_memory_mb=ONE_REPLICA_MB, max_nodes=10), RecordingProvider()
    for organization in (organization_allowed(1), organization_allowed(1)):
        for _ in range(2):
            endpoint = EndpointFactory(organization=organization, gpu_type="cpu", model_source=TINY,
                                       quantization="none", min_replicas=1)
            reconcile_endpoint(str(endpoint.pk))
    assert tick(provider) == 2 and NodeLaunch.objects.filter(pool=pool).count() == 2


def test_a_replica_placement_keeps_off_the_pools_machines_launches_no_machine_after_machine():
    """A replica no machine of the pool takes for another reason than room (here a quantization its agents do not
    offer; as well an agent older than its endpoint needs). Before: each tick counted it as demand for a new machine,
    and the pool launched one after another up to its maximum, each joining empty and idle, paid for."""
    pool, provider = make_pool(min_nodes=1, max_nodes=4), RecordingProvider()
    tick(provider)
    [launch] = NodeLaunch.objects.filter(pool=pool)
    join(launch)  # its agent offers quantization "none" only
    tick(provider)
    endpoint = EndpointFactory(gpu_type="cpu", model_source=TINY, quantization="int8", min_replicas=1)
    reconcile_endpoint(str(endpoint.pk))
    endpoint.refresh_from_db()
    assert endpoint.unplaced_replicas == 1 and not Replica.objects.filter(endpoint=endpoint).exists()
    later = timezone.now() + timedelta(seconds=60)  # past the settle window of the machine that joined
    for _ in range(3):
        tick(provider, now=later)
    assert NodeLaunch.objects.filter(pool=pool).count() == 1
    assert EndpointEvent.objects.filter(endpoint=endpoint, message__contains="no new node would take them").exists()
    assert not endpoint.status_message.startswith("provisioning")  # it says why placement refused: no node comes
    assert endpoint.waiting_for_capacity and "quantization int8" in endpoint.status_message


def test_an_older_endpoint_no_pool_can_hold_takes_none_of_its_organisations_room():
    """An endpoint too large for every pool's machines gets none of them: the quota room it took, oldest first, was
    taken from a newer endpoint of its organisation that a machine would hold. Before: that one waited for ever, no
    machine launched for it while the large one was told no machine of the pool can hold it."""
    pool, provider = make_pool(gpu_memory_mb=ONE_REPLICA_MB, max_nodes=10), RecordingProvider()
    organization = organization_allowed(1)
    too_large = EndpointFactory(organization=organization, gpu_type="cpu", model_source="hf:org/model-70B",
                                quantization="none", min_replicas=1)
    reconcile_endpoint(str(too_large.pk))
    fitting = EndpointFactory(organization=organization, gpu_type="cpu", model_source=TINY, quantization="none",
                              min_replicas=1)
    reconcile_endpoint(str(fitting.pk))
    fitting.refresh_from_db()
    assert fitting.unplaced_replicas == 1
    assert tick(provider) == 1 and NodeLaunch.objects.filter(pool=pool).count() == 1
    assert EndpointEvent.objects.filter(endpoint=too_large, message__contains="no machine of this pool can hold").exists()


def joined_empty(pool, provider):
    """The pool's one machine (its minimum), joined and settled: empty, its agent offering quantization "none" only."""
    tick(provider)
    [launch] = NodeLaunch.objects.filter(pool=pool)
    join(launch)
    tick(provider)
    return launch


def int8_endpoint():
    endpoint = EndpointFactory(gpu_type="cpu", model_source=TINY, quantization="int8", min_replicas=1)
    reconcile_endpoint(str(endpoint.pk))
    endpoint.refresh_from_db()
    assert endpoint.unplaced_replicas == 1
    return endpoint


def test_a_cheaper_pools_empty_machine_that_refuses_a_replica_leaves_its_demand_to_the_pool_that_serves_it():
    """Two pools of one GPU type: the cheaper one (below its maximum) has an empty machine, of its definition as it
    stands, whose agent refuses the endpoint (here a quantization it lacks; as well an older agent). Before: the
    cheaper pool took the endpoint's demand and held it against that machine; the pricier pool never launched, and the
    endpoint's calls got an immediate 503 for ever."""
    cheap, provider = make_pool(name="cheap", min_nodes=1, max_nodes=3, hourly_price=1), RecordingProvider()
    joined_empty(cheap, provider)
    pricier = make_pool(name="pricier", max_nodes=3, hourly_price=2)
    endpoint = int8_endpoint()
    assert endpoint.status_message == PROVISIONING_MESSAGE and not endpoint.waiting_for_capacity  # calls are held
    later = timezone.now() + timedelta(seconds=60)  # past the settle window of the machine that joined
    for _ in range(3):
        tick(provider, now=later)
    assert NodeLaunch.objects.filter(pool=cheap).count() == 1  # a new one of it would refuse the replica too
    [launch] = NodeLaunch.objects.filter(pool=pricier)
    node = join(launch)
    Node.objects.filter(pk=node.pk).update(quantizations=["none", "int8"])
    reconcile_endpoint(str(endpoint.pk))
    assert Replica.objects.get(endpoint=endpoint).node_id == node.pk


def test_a_pool_kept_at_its_minimum_by_an_older_machine_launches_the_new_template_machine_that_serves_a_replica():
    """One pool at `min_nodes` whose only machine predates the pool's template (its agent older: it refuses the
    endpoint). Before: that empty machine held the endpoint's demand, the machine of the new template that would serve
    it never launched, and its calls got a 503 for ever. Now one launches, once: joined, of the new template, a machine
    that refused it as well would launch no other."""
    pool, provider = make_pool(min_nodes=1, max_nodes=4), RecordingProvider()
    joined_empty(pool, provider)
    pool = update_node_pool(SYSTEM, pool, template={"engine_ports": "{}-{}".format(*DEFAULT_ENGINE_PORTS)})
    endpoint = int8_endpoint()
    assert endpoint.status_message == PROVISIONING_MESSAGE and not endpoint.waiting_for_capacity
    later = timezone.now() + timedelta(seconds=60)
    for _ in range(3):
        tick(provider, now=later)
    assert NodeLaunch.objects.filter(pool=pool).count() == 2
    new_launch = NodeLaunch.objects.filter(pool=pool).order_by("-requested_at").first()
    node = join(new_launch)
    Node.objects.filter(pk=node.pk).update(quantizations=["none", "int8"])
    reconcile_endpoint(str(endpoint.pk))
    assert Replica.objects.get(endpoint=endpoint).node_id == node.pk
