"""One circuit per process for a Redis that does not answer: open once a call's deadline passes, closed once Redis
answers a probe again.

NOTE: a Redis that accepts connections and never replies (a partition, a dead load balancer that sends no RST, a frozen
server) cost every call `REDIS_TIMEOUT_S` before its 503: each found the connection dropped by the one before and
opened a new one into the same silence, and a key new to the process waited out two more (redis-py's, for its shared
mark), so a gateway under load held every caller 2 to 4 s. While the circuit is open a caller on the gateway's path
is refused at once (the gateway's clean 503 with `Retry-After`); nothing is admitted without Redis, so never without
its limits. One probe at a time, on a connection of its own, asks Redis again every `PROBE_INTERVAL_S` with a short
deadline of its own (`PROBE_TIMEOUT_S`), so calls flow again within a second of Redis answering.

Every caller is refused while the circuit is open, and the first one starts the probe if none runs. The probe runs on
a thread of its own, never on a caller's event loop: a loop that ends with its call (a batch run's `run_briefly`, a
Celery task's) cancelled the probe it started before it asked, and the next such loop started one that met the same
end, so a process whose only loops are short (a Celery worker) refused them all for as long as it lived, Redis
answering all along (`tests/test_redis_circuit.py`). A forked child finds its parent's probe thread gone and starts
its own. Refusals log nothing each: the circuit logs its opening, and at its closing how long and how many calls.

On Redis Cluster (`REDIS_CLUSTER=1`) each node has a circuit of its own (`node_circuit`), probed at its own address:
a silent node's organisations (their slots) are refused at once, and the other nodes' are served as before. One circuit
for the whole cluster would refuse every organisation for one node's silence; none (as before) cost every call on the
silent node two deadlines (redis-py's cluster clients send a timed-out command again), and each such call made the
client read the cluster's layout again before the next command of any organisation, from a node that may be the silent
one (`tests/test_redis_cluster_circuit.py`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from urllib.parse import urlparse

import redis
import redis.backoff
import redis.retry
from django.conf import settings

logger = logging.getLogger(__name__)

PROBE_INTERVAL_S = 0.1
PROBE_TIMEOUT_S = 0.5
# NOTE: a cluster node's probe stops once no call was refused for it this long (the next refusal starts another): a
# node failed over and gone, its address dead or another process's, was probed every 0.1 s for as long as the process
# lived, by every gateway and Celery worker process, a thread more for each address a cluster went through.
NODE_PROBE_IDLE_S = 60.0


class Refused(Exception):
    """Mixed into what a call the circuit refused raises (`redis_client.RedisSilent`, `redis_scripts.RedisRefused`):
    Redis was never asked. NOTE: its caller logs no line for it (the circuit logs its opening, and its closing with
    how many it refused): refused at once, calls come as fast as clients send them."""


class RedisCircuit:
    """Whether this process sends calls to Redis now (see the module's docstring). `node`: a cluster node's name
    (`host:port`, as redis-py names it) whose calls it guards; none for `REDIS_URL`'s Redis."""

    def __init__(self, node: str | None = None) -> None:
        self.node = node
        self._lock = threading.Lock()
        self.is_open = False
        self._opened_at = 0.0
        self.num_refused = 0  # since it opened
        self._refused_at = 0.0  # the last refusal (monotonic)
        self._probe: threading.Thread | None = None

    def admits(self) -> bool:
        """Whether a call may go to Redis now: not while the circuit is open, and then a probe runs.

        NOTE: while closed (nearly every call) one attribute read, no lock and no clock."""
        if not self.is_open:
            return True
        with self._lock:
            if not self.is_open:
                return True
            self.num_refused += 1
            self._refused_at = time.monotonic()
            if self._probe is None or not self._probe.is_alive():
                self._probe = threading.Thread(target=self._probe_until_answered, name="redis circuit probe",
                                               daemon=True)
                self._probe.start()
        return False

    def trip(self, why: BaseException) -> None:
        """A call's deadline passed: Redis is silent. Open until a probe is answered."""
        with self._lock:
            if self.is_open:
                return
            self.is_open = True
            self._opened_at = time.monotonic()
            self.num_refused = 0
        logger.warning("Redis%s did not answer (%s): calls refused until it does", self._where(), why)

    def close(self) -> None:
        """Redis answers: calls go to it again."""
        with self._lock:
            was_open, self.is_open = self.is_open, False
        if was_open:
            logger.warning("Redis%s answers again: calls sent to it again (%.1f s without it, %d calls refused)",
                           self._where(), time.monotonic() - self._opened_at, self.num_refused)

    def _where(self) -> str:
        return "" if self.node is None else f" cluster node {self.node}"

    def _after_fork_in_child(self) -> None:
        # NOTE: a fork copies the lock as it was: held by a thread of the parent's that the child does not have, it
        # would never be released there, and the child's first call while the circuit is open would wait for ever.
        self._lock = threading.Lock()
        self._probe = None

    def _probe_until_answered(self) -> None:
        while self.is_open:
            try:
                _ping(self.node)
            except Exception:  # noqa: BLE001 - any failure is "not yet"; the probe never dies loud
                if self._unasked():
                    return
                time.sleep(PROBE_INTERVAL_S)
                continue
            self.close()

    def _unasked(self) -> bool:
        """Whether this (a cluster node's) probe stops: no call refused for `NODE_PROBE_IDLE_S`. Under the lock, so
        that a refusal after it starts another probe."""
        if self.node is None:
            return False
        with self._lock:
            if time.monotonic() - self._refused_at < NODE_PROBE_IDLE_S:
                return False
            self._probe = None
            return True


def _ping(node: str | None) -> None:
    """One PING on a connection of its own: never a caller's (which may be the silent one), nor one the circuit
    refuses; bounded by `PROBE_TIMEOUT_S` (connecting, and the reply), and never tried again by redis-py. `node`: a
    cluster node's name, asked at its own address with `REDIS_URL`'s credentials."""
    url = settings.REDIS_URL if node is None else _node_url(node)
    client = redis.Redis.from_url(url, socket_timeout=PROBE_TIMEOUT_S,
                                  socket_connect_timeout=PROBE_TIMEOUT_S, single_connection_client=True,
                                  retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0))
    try:
        client.ping()
    finally:
        client.close()


def _node_url(node: str) -> str:
    """`REDIS_URL` (its scheme and credentials) pointed at a cluster node, `host:port`."""
    host, port = node.rsplit(":", 1)
    parsed = urlparse(settings.REDIS_URL)
    credentials, _, _ = parsed.netloc.rpartition("@")
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return parsed._replace(netloc=f"{credentials}@{address}" if credentials else address, path="").geturl()


circuit = RedisCircuit()

node_circuits: dict[str, RedisCircuit] = {}
"""The circuits of a Redis Cluster's nodes, by name (`host:port`); made on a node's first call."""
_node_circuits_lock = threading.Lock()


def node_circuit(node: str) -> RedisCircuit:
    """The circuit of the cluster node named `node` (`host:port`, redis-py's `ClusterNode.name`)."""
    found = node_circuits.get(node)
    if found is None:
        with _node_circuits_lock:
            found = node_circuits.setdefault(node, RedisCircuit(node))
    return found


def _after_fork_in_child() -> None:
    global _node_circuits_lock
    _node_circuits_lock = threading.Lock()
    for each in (circuit, *node_circuits.values()):
        each._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
