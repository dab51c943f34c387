"""The shared Redis connections: one sync client per process, one async client per event loop.

NOTE: every call is bounded by `REDIS_TIMEOUT_S` (connect and reply): a Redis that is stopped,
partitioned or frozen makes callers fail fast with `redis.exceptions.TimeoutError` or
`ConnectionError`, never hang. A connection broken by a Redis restart is retried once on a new
one (a restart closes every pooled socket; the first use of each would otherwise fail), and a
timeout is not retried, so a silent Redis costs one timeout, not several; and after that one, none: a timeout
opens the process's circuit (`controlplane.redis_circuit`), and until Redis answers its probe every command is
refused at once with `RedisSilent` (a `ConnectionError`), as the gateway's scripts are.

With `REDIS_CLUSTER=1` both are redis-py's cluster clients, seeded from `REDIS_URL` (one node; they
discover the others and route each command by its key's slot). Commands of several keys and
scripts need their keys in one slot: `controlplane.redis_keys` names them so. Each node has a circuit of its own
(`redis_circuit.node_circuit`): a command for a silent node's slots is refused before the cluster client handles it
(which would send it again, and read the cluster's layout again for every caller), the other nodes' served.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import random
import threading
import time
from collections.abc import Iterator

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.asyncio.retry
import redis.backoff
import redis.cluster
import redis.exceptions
import redis.retry
from django.conf import settings

from controlplane.per_loop import PerLoop
from controlplane.redis_circuit import RedisCircuit, Refused, circuit, node_circuit

logger = logging.getLogger(__name__)

HEALTH_CHECK_INTERVAL_S = 10
MIN_CONNECT_TIMEOUT_S = 5.0  # a burst of new pooled connections on a busy machine needs more than one reply's time


class RedisSilent(redis.exceptions.ConnectionError, Refused):
    """Refused without asking: Redis left a command unanswered past its deadline, and has not answered since
    (`controlplane.redis_circuit`)."""


def _trips_on_timeout(timeout) -> bool:
    """Whether a read that timed out was a command's reply overdue (redis-py's own `socket_timeout`), not a read with
    a wait of its own (pub/sub's, which ends in silence as it should)."""
    return timeout is None or timeout is redis.connection.SENTINEL


class _CircuitConnection(redis.connection.Connection):
    """redis-py's connection, refusing while the process's circuit is open and opening it on a reply overdue."""

    def _circuit(self) -> RedisCircuit:
        return circuit

    def connect(self):
        if not self._circuit().admits():
            raise RedisSilent("Redis is not answering")
        super().connect()

    def send_packed_command(self, command, check_health=True):
        if not self._circuit().admits():
            raise RedisSilent("Redis is not answering")
        super().send_packed_command(command, check_health)

    def read_response(self, *args, **kwargs):
        try:
            return super().read_response(*args, **kwargs)
        except redis.exceptions.TimeoutError as exc:
            if _trips_on_timeout(kwargs.get("timeout")):
                self._circuit().trip(exc)
            raise


class _CircuitSSLConnection(_CircuitConnection, redis.connection.SSLConnection):
    pass


class _NodeCircuitConnection(_CircuitConnection):
    """A connection to a cluster node, guarded by that node's circuit."""

    def _circuit(self) -> RedisCircuit:
        return node_circuit(redis.cluster.get_node_name(self.host, self.port))


class _NodeCircuitSSLConnection(_NodeCircuitConnection, redis.connection.SSLConnection):
    pass


class _AsyncCircuitConnection(redis.asyncio.Connection):
    """`_CircuitConnection`, for the asyncio client."""

    def _circuit(self) -> RedisCircuit:
        return circuit

    async def connect(self):
        if not self._circuit().admits():
            raise RedisSilent("Redis is not answering")
        await super().connect()

    async def send_packed_command(self, command, check_health=True):
        if not self._circuit().admits():
            raise RedisSilent("Redis is not answering")
        await super().send_packed_command(command, check_health)

    async def read_response(self, *args, **kwargs):
        try:
            return await super().read_response(*args, **kwargs)
        except redis.exceptions.TimeoutError as exc:
            if _trips_on_timeout(kwargs.get("timeout")):
                self._circuit().trip(exc)
            raise


class _AsyncCircuitSSLConnection(_AsyncCircuitConnection, redis.asyncio.SSLConnection):
    pass


class _AsyncNodeCircuitConnection(_AsyncCircuitConnection):
    """`_NodeCircuitConnection`, for the asyncio cluster client."""

    def _circuit(self) -> RedisCircuit:
        return node_circuit(redis.cluster.get_node_name(self.host, self.port))


class _AsyncNodeCircuitSSLConnection(_AsyncNodeCircuitConnection, redis.asyncio.SSLConnection):
    pass


LAYOUT_REREAD_S = 1.0


def _layout_reread_due(client) -> bool:
    """Whether a cluster client refusing a silent node's command reads the cluster's layout again now: at most every
    `LAYOUT_REREAD_S`, from the other nodes first (the silent one's connections are refused at once).

    NOTE: redis-py reads it again at a node's timeout, before the cluster has failed the node over; its later
    commands are refused before redis-py sees them, so only this reading finds the replica that took its slots over
    (at an address of its own, with a circuit of its own). Without it the silent node's organisations were refused
    for as long as it stayed silent, for ever a dead host's (`tests/test_redis_cluster_circuit.py`)."""
    now = time.monotonic()
    if now < client.layout_read_at + LAYOUT_REREAD_S:
        return False
    client.layout_read_at = now
    return True


def _answering_default_node(client):
    """A cluster client's default node (for a command of no key: `TIME`, `PING`), another primary if its circuit is
    open.

    NOTE: redis-py replaces it when a command there fails as it sends it again (a timeout), never on a refusal, and the
    sync client's every reading of the layout makes the holder of slot 0 the default again: a silent one had every
    `redis_time` (the scheduler's, the autoscaler's, the sweeper's) refused for as long as it was silent."""
    node = client.nodes_manager.default_node
    if node is not None and node_circuit(node.name).is_open:
        answering = [each for each in client.get_primaries() if not node_circuit(each.name).is_open]
        if answering:
            client.nodes_manager.default_node = node = random.choice(answering)
    return node


class _ClusterClient(redis.cluster.RedisCluster):
    """redis-py's cluster client, its connections guarded by their nodes' circuits (`_NodeCircuitConnection`).

    NOTE: a command for a node whose circuit is open is refused here, before redis-py's handling of a node's
    connection error: that marks the cluster's layout to be read again by the next command (any organisation's, from
    any node, the silent one perhaps) and sends the command again."""

    def __init__(self, *args, **kwargs):
        self.layout_read_at = 0.0  # by a refused command (`_layout_reread_due`)
        super().__init__(*args, **kwargs)
        # NOTE: after redis-py's own setting (a `rediss://` URL names its plain SSL connection, over any given here)
        _guard_nodes(self.nodes_manager, _NodeCircuitSSLConnection if _tls() else _NodeCircuitConnection)
        for node in self.nodes_manager.nodes_cache.values():
            pool = node.redis_connection.connection_pool
            pool.connection_class = self.nodes_manager.connection_kwargs["connection_class"]
            pool.reset()  # its idle connections, from the first reading of the layout, made of redis-py's class

    def get_default_node(self):
        return _answering_default_node(self)

    def _execute_command(self, target_node, *args, **kwargs):
        if not node_circuit(target_node.name).admits():
            if _layout_reread_due(self):
                with contextlib.suppress(Exception):  # none answered: the next refusal's reading, a second on
                    self.nodes_manager.initialize(last_failed_node_name=target_node.name)
            raise RedisSilent(f"Redis cluster node {target_node.name} is not answering")
        return super()._execute_command(target_node, *args, **kwargs)


def _guard_nodes(nodes_manager, connection_class) -> None:
    """The nodes a cluster client finds from now on connect through `connection_class`."""
    nodes_manager.connection_kwargs["connection_class"] = connection_class


def connection_options() -> dict:
    timeout_s = settings.REDIS_TIMEOUT_S
    return {
        "decode_responses": True, "socket_timeout": timeout_s,
        "socket_connect_timeout": max(timeout_s, MIN_CONNECT_TIMEOUT_S),
        "health_check_interval": HEALTH_CHECK_INTERVAL_S, "retry_on_timeout": False,
    }


def _tls() -> bool:
    return settings.REDIS_URL.startswith("rediss://")


def _more_startup_nodes(cluster_module) -> list:
    """The nodes of `REDIS_CLUSTER_NODES`, as `cluster_module`'s (sync or asyncio) `ClusterNode`s: where a cluster
    client reads the layout from besides `REDIS_URL`'s node.

    NOTE: a client started from that node alone could not start while it was down (a rolling deploy during a node's
    failure): every process started then failed its every command, the other nodes answering
    (`tests/test_redis_cluster.py`). The client keeps `REDIS_URL`'s credentials and TLS for these."""
    return [cluster_module.ClusterNode(host, port) for host, port in settings.REDIS_CLUSTER_NODES]


@functools.cache
def get_redis() -> redis.Redis | redis.cluster.RedisCluster:
    retry = redis.retry.Retry(redis.backoff.NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,))
    if settings.REDIS_CLUSTER:
        return _ClusterClient.from_url(settings.REDIS_URL, retry=retry, startup_nodes=_more_startup_nodes(redis.cluster),
                                       **connection_options())
    connection_class = _CircuitSSLConnection if _tls() else _CircuitConnection
    return redis.Redis.from_url(settings.REDIS_URL, retry=retry, connection_class=connection_class,
                                **connection_options())


POOL_WAIT_S = 10


class _KeepingNodesManager(redis.asyncio.cluster.NodesManager):
    """redis-py's async cluster layout, whose reading keeps the connections of the nodes whose role it left as it was.

    NOTE: redis-py marks every connection of every node to be closed and opened again at each reading (lest one keep a
    replica's `READONLY`: these clients never read from replicas), the layout unchanged or not. Read once a second
    while a node is silent (`_layout_reread_due`), that reconnected every gateway to the whole cluster every second
    (`tests/test_redis_cluster_circuit.py`). A node that became a replica or a primary, or whose circuit is open, is
    reconnected as redis-py does, and so is a connection marked before the reading."""

    __slots__ = ()

    async def initialize(self, *args, **kwargs) -> None:
        roles = {name: node.server_type for name, node in self.nodes_cache.items()}
        marked = {connection for node in self.nodes_cache.values() for connection in node._connections
                  if connection.should_reconnect()}
        await super().initialize(*args, **kwargs)
        for name, node in self.nodes_cache.items():
            if roles.get(name) == node.server_type and not node_circuit(name).is_open:
                for connection in node._connections:
                    if connection not in marked:
                        connection.reset_should_reconnect()


class _AsyncClusterClient(redis.asyncio.cluster.RedisCluster):
    """redis-py's async cluster client, initialised (slots and nodes read) before its first command.

    NOTE: a burst of first commands on a new client (redis-py 8) each run the initialisation's
    default-node replacement; some then fail with a closed connection and are retried, running a
    script twice. Initialising once, under the client's lock, before any command avoids that
    (tests/test_redis_cluster.py's burst of admissions counts it).

    Its connections are guarded by their nodes' circuits, and a command for a silent node refused before redis-py
    handles it, as `_ClusterClient`'s."""

    def __init__(self, *args, **kwargs):
        self.layout_read_at = 0.0  # by a refused command (`_layout_reread_due`)
        super().__init__(*args, **kwargs)
        connection_class = _AsyncNodeCircuitSSLConnection if _tls() else _AsyncNodeCircuitConnection
        self.nodes_manager.__class__ = _KeepingNodesManager  # slotted: its methods cannot be wrapped on the instance
        _guard_nodes(self.nodes_manager, connection_class)
        for node in self.nodes_manager.startup_nodes.values():  # made already, not connected yet
            node.connection_class = connection_class

    async def execute_command(self, *args, **kwargs):
        if self._initialize:
            await self.initialize()
        return await super().execute_command(*args, **kwargs)

    def get_default_node(self):
        return _answering_default_node(self)

    def pipeline(self, transaction=None, shard_hint=None):
        pipe = super().pipeline(transaction, shard_hint)
        if not transaction:
            pipe._execution_strategy = _NodePipelineStrategy(pipe)
        return pipe

    async def _execute_command(self, target_node, *args, **kwargs):
        if not node_circuit(target_node.name).admits():
            await self.reread_layout_if_due(target_node.name)
            raise RedisSilent(f"Redis cluster node {target_node.name} is not answering")
        handling = _handling_a_command.set(True)
        try:
            return await super()._execute_command(target_node, *args, **kwargs)
        finally:
            _handling_a_command.reset(handling)

    async def aclose(self) -> None:
        """Close every connection, unless redis-py's handling of one command's answer asks it.

        NOTE: redis-py closes the whole client (every connection to every node, those under other callers' commands
        included) to have the layout read again after a `CLUSTERDOWN` (a failover under way) and at every fifth
        `MOVED` (a reshard): every process reconnected to the whole cluster as it struggled, and a call in flight on a
        closed connection was sent again (`tests/test_redis_cluster.py`). There the layout is only marked to be read
        again before the command's retry."""
        if _handling_a_command.get():
            self._initialize = True
            return
        await super().aclose()
        # NOTE: redis-py's closes nothing while the layout is marked to be read again, as above (or by a pipeline's
        # failure, `_NodePipelineStrategy`): a loop ending before the next command left every connection open past it.
        await self.nodes_manager.aclose()
        await self.nodes_manager.aclose("startup_nodes")

    async def reread_layout_if_due(self, failed_node_name: str | None) -> None:
        """Read the cluster's layout again after a silent node's refusal, at most every `LAYOUT_REREAD_S`."""
        if _layout_reread_due(self):
            self._initialize = True  # redis-py's own mark after a node's connection error
            with contextlib.suppress(Exception):  # none answered: the next command reads it again
                await self.initialize(last_failed_node_name=failed_node_name)


_handling_a_command: contextvars.ContextVar[bool] = contextvars.ContextVar("handling_a_cluster_command", default=False)


class _NodePipelineStrategy(redis.asyncio.cluster.PipelineStrategy):
    """redis-py's async cluster pipeline (`transaction=False`), without its closing of every node's connections when
    one node fails it.

    NOTE: redis-py meets a node's connection error, timeout or `CLUSTERDOWN` in a pipeline by closing the whole
    client (`RedisCluster.aclose`: every connection to every node, those under other callers' commands included), then
    sends the pipeline again a quarter second later. A gateway's beat pipelines many organisations' keys
    (`presence`), so one silent node, its circuit refusing, closed every gateway's connections to the whole cluster
    every second, and a call in flight on one was sent again (`tests/test_redis_cluster_circuit.py`). Here a refusal
    (the node's circuit open: nothing sent, and nothing to gain by sending it again) is raised at once, and a failure
    marks the layout to be read again before the one retry, as a single command's does, and closes the idle
    connections (`tests/test_redis_cluster.py`)."""

    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> list:
        if not self._command_queue:
            return []
        client = self._pipe.cluster_client
        try:
            tries_left = client.retry.get_retries()
            while True:
                try:
                    if client._initialize:
                        await client.initialize()
                    return await self._execute(client, self._command_queue, raise_on_error=raise_on_error,
                                               allow_redirections=allow_redirections)
                except Refused:
                    await client.reread_layout_if_due(None)
                    raise
                except redis.asyncio.cluster.RedisCluster.ERRORS_ALLOW_RETRY:
                    if tries_left <= 0:
                        raise
                    tries_left -= 1
                    # NOTE: the failed node's idle connections may all be dead (a node that restarted): the retry would
                    # take the next. Which node failed a pipeline is not known here: every node's idle ones are closed
                    # (those under other calls are left to them), as a single command's failure closes its node's.
                    await asyncio.gather(*(node.disconnect_free_connections() for node in client.get_nodes()))
                    client._initialize = True
                    await asyncio.sleep(0.25)  # redis-py's: a cluster failing a node over needs a moment
        finally:
            await self.reset()


def _new_async_client() -> redis.asyncio.Redis | redis.asyncio.cluster.RedisCluster:
    # NOTE: a burst beyond the pool waits for a free connection instead of failing; nothing holds
    # one for long (pub/sub waiters share `controlplane.pubsub`'s own connection).
    retry = redis.asyncio.retry.Retry(redis.backoff.NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,))
    if settings.REDIS_CLUSTER:
        options = connection_options()
        del options["retry_on_timeout"]  # the cluster client's retry covers connection errors only already
        return _AsyncClusterClient.from_url(
            settings.REDIS_URL, max_connections=settings.REDIS_MAX_CONNECTIONS, retry=retry,
            startup_nodes=_more_startup_nodes(redis.asyncio.cluster), **options)
    pool = redis.asyncio.BlockingConnectionPool.from_url(
        settings.REDIS_URL, max_connections=settings.REDIS_MAX_CONNECTIONS, timeout=POOL_WAIT_S, retry=retry,
        connection_class=_AsyncCircuitSSLConnection if _tls() else _AsyncCircuitConnection, **connection_options())
    return redis.asyncio.Redis(connection_pool=pool)


IN_USE_WAIT_S = 1.0  # how long a loop's end waits for its Redis connections in use


async def _close_async_client(client: redis.asyncio.Redis | redis.asyncio.cluster.RedisCluster) -> None:
    if isinstance(client, redis.asyncio.Redis):
        # NOTE: its pool is its own (`_new_async_client`); a connection still in use is left to its command (closed
        # under it, the command would be sent again on a new one by the retry: run twice), and closed once it is
        # back, for at most `IN_USE_WAIT_S` (the review of the per-loop close).
        pool = client.connection_pool
        await pool.disconnect(inuse_connections=False)
        waited_until = time.monotonic() + IN_USE_WAIT_S
        while getattr(pool, "_in_use_connections", None) and time.monotonic() < waited_until:
            await asyncio.sleep(0.05)
            await pool.disconnect(inuse_connections=False)
    else:
        await client.aclose()


# NOTE: an asyncio connection pool belongs to the loop that created it, and is closed as that loop ends.
_async_clients: PerLoop[redis.asyncio.Redis | redis.asyncio.cluster.RedisCluster] = PerLoop(
    _new_async_client, close=_close_async_client)


def get_async_redis() -> redis.asyncio.Redis | redis.asyncio.cluster.RedisCluster:
    return _async_clients.get()


@contextlib.contextmanager
def held_alone(key: str, ttl_s: float, *, renewed: bool = False) -> Iterator[bool]:
    """Yields whether this caller holds `key` (taken for `ttl_s`, not waited for): a periodic job's run at a time.
    `renewed`: kept for `ttl_s` more every third of it while the run goes on (a run that may outlast `ttl_s`).

    NOTE: released only if still this caller's (redis-py's `Lock`: a random token, compared in Redis). A run slower
    than `ttl_s` lost the key when it expired, and the next run took it; a plain DELETE at the slow run's end then
    freed the next run's key, and a third run went beside it. Not thread-local (redis-py's default): the thread
    that renews it holds its token too.
    """
    lock = get_redis().lock(key, timeout=ttl_s, blocking=False, thread_local=False)
    held = lock.acquire()
    done, renewer = threading.Event(), None
    if held and renewed:
        renewer = threading.Thread(target=_renew_while_running, args=(lock, key, ttl_s, done), name=f"lock {key}",
                                   daemon=True)
        renewer.start()
    try:
        yield held
    finally:
        if renewer is not None:
            done.set()
            renewer.join()
        if held:
            try:
                lock.release()
            except redis.exceptions.LockError:  # expired meanwhile: perhaps another run's now, left alone
                logger.warning("%s: the run outlived its lock (%.0f s)", key, ttl_s)


def _renew_while_running(lock, key: str, ttl_s: float, done: threading.Event) -> None:
    while not done.wait(ttl_s / 3):
        try:
            lock.reacquire()
        except redis.exceptions.LockError:
            logger.warning("%s: the run lost its lock: another run may start beside it", key)
            return
        except redis.exceptions.RedisError:
            logger.warning("%s: could not renew the run's lock; trying again", key, exc_info=True)


def redis_time(client=None) -> float:
    """Redis's clock (`TIME`), in Unix seconds: the one clock for times that one process writes to Redis and another
    compares with its own "now" (the gateways' last requests and the autoscaler, the sweeps of several workers).

    NOTE: a process's own clock may step (NTP, a VM resumed) or drift apart from the others'; Redis's is one for all
    of them. On Redis Cluster each node keeps its own (the gateways' scripts read the one holding their keys, this
    the node redis-py asks): a few servers kept in step, rather than every gateway and worker.
    """
    seconds, microseconds = (client or get_redis()).time()
    return seconds + microseconds / 1_000_000


def as_text(value: bytes | str) -> str:
    """A Redis reply's string as text: the clients here answer bytes (no `decode_responses`), and scripts' replies
    and tests' stand-ins may be either."""
    return value.decode() if isinstance(value, bytes) else value
