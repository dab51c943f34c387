"""The join path judged by PostgreSQL's clock, as a pool's launch times are (`controlplane.clock.database_now`): a web pod
whose clock is off neither fails to link a machine to its launch, nor refuses a launch's token, nor leaves a retired
node's token open."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

import endpoints.nodes.models as node_models
from controlplane.accounts.services import SYSTEM
from controlplane.clock import database_now
from endpoints.fleet import pools, services
from endpoints.nodes.models import JoinToken, LaunchState, Node, NodeLaunch
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


def test_a_pool_launchs_token_admits_its_machine_through_a_web_pod_whose_clock_is_ahead(monkeypatch):
    # Before: the launch's one-use token expires at its deadline (PostgreSQL's clock) and registration first judged it
    # by the web pod's clock (`JoinToken.is_usable`): a pod 11 minutes ahead (join deadline 10 minutes) refused every
    # pool machine with AgentAuthError, each terminated at its deadline and launched again, for good.
    pool, provider = make_pool(join_deadline_s=600), RecordingProvider()
    waiting_endpoint()
    launch, plain = pools.create_launch(pool, provider, database_now(), "test")
    web_pod_clock(monkeypatch, timedelta(minutes=11))
    answer = services.register_node(registration(plain, "m1"))
    monkeypatch.undo()
    launch.refresh_from_db()
    assert (launch.state, str(launch.node_id)) == (LaunchState.JOINED, answer.node_id)
    # still one use, and still expiring: a second machine, or any machine past the deadline, is refused
    with pytest.raises(services.AgentAuthError):
        services.register_node(registration(plain, "m2"))
    expiring = services.create_join_token(SYSTEM, name="expired", expires_at=database_now() - timedelta(seconds=1))
    web_pod_clock(monkeypatch, timedelta(minutes=-11))
    with pytest.raises(services.AgentAuthError):
        services.register_node(registration(expiring.plain, "m3"))


def test_retiring_a_node_through_a_pod_whose_clock_is_ahead_revokes_the_token_that_still_admits_its_agent(
        monkeypatch):
    # Before: the retire revoked the node's join token only if the pod's clock found it usable: a pod 11 minutes ahead
    # took a token PostgreSQL still finds unexpired for expired and left it open (no revocation), and the retired
    # node's agent, told it is unknown, registered again with it.
    token = services.create_join_token(SYSTEM, name="by hand", expires_at=database_now() + timedelta(minutes=10),
                                       max_uses=2)
    answer = services.register_node(registration(token.plain, "m1"))
    node = Node.objects.get(pk=answer.node_id)
    web_pod_clock(monkeypatch, timedelta(minutes=11))
    retirement = services.retire_node(SYSTEM, node, reason="test")
    monkeypatch.undo()
    assert retirement.revoked_join_token == token.join_token
    assert JoinToken.objects.get(pk=token.join_token.pk).revoked_at is not None
    with pytest.raises(services.AgentAuthError):
        services.register_node(registration(token.plain, "m1"))
