"""The join path judged by PostgreSQL's clock, as a pool's launch times are (`nodes.models.database_now`): a web pod
whose clock is off does not keep a machine from being linked to its launch."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

import endpoints.nodes.models as node_models
from controlplane.accounts.services import SYSTEM
from endpoints.fleet import pools, services
from endpoints.nodes.models import LaunchState, Node, NodeLaunch, database_now
from gpu_agent import protocol
from tests.fleet.test_pool_policy import RecordingProvider, make_pool, tick, waiting_endpoint

pytestmark = pytest.mark.django_db


def web_pod_clock(monkeypatch, offset: timedelta) -> None:
    """This process is a web pod whose clock is `offset` from PostgreSQL's: `timezone.now()` where the join path reads
    it, and the default a new node's row takes for what it does not set."""
    clock = type("Clock", (), {"now": staticmethod(lambda: timezone.now() + offset)})
    for module in (node_models, services):
        monkeypatch.setattr(module, "timezone", clock)
    monkeypatch.setattr(Node._meta.get_field("registered_at"), "_get_default", clock.now)


def registration(join_token: str, name: str) -> protocol.RegisterRequest:
    return protocol.RegisterRequest(join_token=join_token, name=name, gpu_type="cpu", num_gpus=0, gpu_memory_mb=8192,
                                    num_cpus=4, memory_mb=8192, agent_version="t", advertise_host="127.0.0.1")


def test_a_machine_that_joins_by_name_through_a_web_pod_whose_clock_is_behind_is_linked_and_kept(monkeypatch):
    # Before: Kubernetes' DaemonSet agent registers with a shared token and the tick links it to its launch by the node
    # name the provider reports, if it registered after the launch was requested: `registered_at` by the web pod's
    # clock, `requested_at` by PostgreSQL's. Through a web pod 2 minutes behind it was never linked (LAUNCHING, no
    # node) and, at its deadline, the machine, its node READY, was terminated as "did not join".
    pool, provider = make_pool(join_deadline_s=600, idle_timeout_s=3600), RecordingProvider()
    waiting_endpoint()
    tick(provider)
    launch = NodeLaunch.objects.get(pool=pool)
    assert launch.state == LaunchState.LAUNCHING
    shared = services.create_join_token(SYSTEM, name="daemonset")
    web_pod_clock(monkeypatch, timedelta(minutes=-2))
    answer = services.register_node(registration(shared.plain, pools.node_name(pool, launch)))
    monkeypatch.undo()
    node = Node.objects.get(pk=answer.node_id)

    tick(provider)
    launch.refresh_from_db()
    assert (launch.state, launch.node_id) == (LaunchState.JOINED, node.pk)
    tick(provider, now=database_now() + timedelta(seconds=601))
    launch.refresh_from_db()
    assert launch.state == LaunchState.JOINED and provider.terminated == []

