"""GPU nodes and the join tokens that admit them."""

from __future__ import annotations

import ipaddress
import logging
import math
import socket
import threading
import time
import uuid
from urllib.parse import urlsplit

from django.conf import settings
from django.contrib.postgres.fields import ArrayField
from django.db import models
from django.db.models.functions import Now
from django.utils import timezone

from controlplane import tokens
from gpu_agent.protocol import (
    DEFAULT_ENGINE_PORT_MAX,
    DEFAULT_ENGINE_PORT_MIN,
    MAX_BOOT_ID_CHARS,
    MAX_GPU_TYPE_CHARS,
    MAX_VERSION_CHARS,
    GpuStatus,
    NodeState,
    ReplicaAction,
)

logger = logging.getLogger(__name__)

# The node's `last_status` key that lists the replica actions its agent knows (`record_heartbeat`).
REPLICA_ACTIONS_KNOWN = "replica_actions"
# The node's `last_status` key that says its agent launches engines within their billed context (`record_heartbeat`
# keeps the heartbeat's fields there: `Heartbeat.launches_within_billed_context`).
LAUNCHES_WITHIN_BILLED_CONTEXT = "launches_within_billed_context"


def engine_address_problem(address: str, host: str, port_min: int, port_max: int) -> str:
    """Why `address` is not an engine of the node registered at `host` with ports in [min, max] ("" if it is).

    NOTE: the one rule for where the gateway may send customers' prompts: plain `http://host:port`
    on the node's own registered host and inside its port range; no path, user, query or fragment.
    """
    # NOTE: the reasons name neither the address nor the node's host or ports: a replica's failure reason is shown to
    # every member of its organisation, and where the fleet's machines listen is the operator's (`replicas` logs it).
    try:
        parts = urlsplit(address)
        port = parts.port
    except ValueError:
        return "the engine's address is not a URL"
    if parts.scheme != "http" or parts.username or parts.password or parts.path not in ("", "/") or parts.query or parts.fragment:
        return "the engine's address is not of the form http://host:port"
    reported_host = (parts.hostname or "").lower()
    if not reported_host or reported_host != _normal_host(host):
        return "the engine's address is not on the node's registered host"
    if advertise_host_problem(host, admitting=False):
        return "the node's registered host is not one the gateway may reach"
    if port is None or not port_min <= port <= port_max or engine_ports_problem(port, port):
        return "the engine's address is outside the node's engine ports"
    return ""


def engine_ports_problem(port_min: int, port_max: int) -> str:
    """Why a node may not serve engines on ports [min, max] ("" if it may).

    NOTE: inside the node networks a node's host may be any pod's or machine's, so its ports must be the platform's
    engine ports (`DEFAULT_ENGINE_PORT_MIN..MAX`, what the NetworkPolicies open to the web and batch-worker pods): else
    a join token's holder aimed the gateway at a web pod's own :8000, a Redis or PostgreSQL peer or the kube API. The
    local stack (`ALLOW_LOOPBACK_NODES`) keeps any range: its pools' loopback agents use 10000-19999
    (`endpoints.fleet.providers.local`)."""
    if settings.ALLOW_LOOPBACK_NODES or DEFAULT_ENGINE_PORT_MIN <= port_min <= port_max <= DEFAULT_ENGINE_PORT_MAX:
        return ""
    return f"its engine ports must lie in the platform's, {DEFAULT_ENGINE_PORT_MIN}-{DEFAULT_ENGINE_PORT_MAX}"


def advertise_host_problem(host: str, *, admitting: bool = True) -> str:
    """Why the gateway may not send prompts to engines on `host`, a node's advertised host ("" if it may).

    NOTE: the one rule for a node's host, applied when it registers and again by the gateway before it routes
    (`engine_address_problem`): any holder of a shared join token can register a node, so its host must not be the
    gateway's own machine (loopback, the unspecified address), a link-local address (169.254.169.254 is the cloud's
    metadata service) or a multicast one, nor an internal service's: it must be inside the networks the operator named
    for GPU nodes (`NODE_NETWORKS`) and not the control plane's own PostgreSQL or Redis. A
    host name is taken only where loopback nodes are (`ALLOW_LOOPBACK_NODES`, the local stack): the gateway connects
    by name, and a name may resolve to anything, later as well as now; a fleet node advertises its IP (pod, instance).

    `admitting=False` judges a node admitted already (the sweeps, the gateway's directory, placement, pool release):
    where the control plane's own names have not resolved yet in this process (`ServiceAddressesUnresolved`), only
    the comparison with them is skipped (against what did resolve, `ServiceAddressesUnresolved.kept`): every other
    rule, `NODE_NETWORKS` included, still applies; a new node is refused meanwhile (fail closed).
    NOTE: before, "could not be resolved" was a refusal everywhere: the sweep failed every live replica on every node,
    the directory routed to none, placement found no node (`tests/test_node_networks.py`). And then it returned ""
    at once, before the networks: a process whose first look-up failed routed to nodes outside narrowed networks.
    """
    try:
        address = ipaddress.ip_address(_normal_host(host))
    except ValueError:
        return "" if settings.ALLOW_LOOPBACK_NODES else "it must be an IP address, not a host name"
    address = _unmapped(address)
    if address.is_loopback:  # NOTE: first: ::1 is also in IPv6's reserved ::/8
        return "" if settings.ALLOW_LOOPBACK_NODES else "it is a loopback address"
    if address in _INSTANCE_METADATA_ADDRESSES:  # NOTE: its own reason, so link-local decoys never spend its audit rows
        return "it is a cloud's instance metadata service"
    if address.is_unspecified or address.is_link_local or address.is_multicast or address.is_reserved or (
            address.version == 4 and address in _THIS_NETWORK):
        return "it is an unspecified, link-local, multicast or reserved address"
    try:
        service_addresses = control_plane_service_addresses(admitting=admitting)
    except ServiceAddressesUnresolved as unresolved:  # NOTE: fail closed: one we cannot name may be this one
        if admitting:
            return "the control plane's own PostgreSQL or Redis addresses could not be resolved yet"
        service_addresses = unresolved.kept
    if address in service_addresses:
        return "it is an address of the control plane's own PostgreSQL or Redis"
    if not any(address in network for network in settings.NODE_NETWORKS):
        return "it is outside the networks GPU nodes may serve on (INFERPLANE_NODE_NETWORKS)"
    return ""


class ServiceAddressesUnresolved(Exception):
    """A host name of the control plane's own PostgreSQL or Redis did not resolve (DNS down): try again later.
    `kept`: the addresses known meanwhile (those that did resolve, and those kept from earlier answers)."""

    def __init__(self, host: str, kept: frozenset = frozenset()):
        super().__init__(host)
        self.kept = kept


# After a failed lookup, the next is tried no sooner than this: while DNS is down, each heartbeat, registration and
# directory load would otherwise wait out the resolver's timeout (refused meanwhile all the same).
RESOLVE_RETRY_S = 2.0
_last_unresolved = {"at": -math.inf, "host": ""}
# The control plane's own names are looked up again this long after they last resolved (a managed database's
# failover moves its name to another IP), and an address they named is still refused this long after they last did
# (the old primary is still ours: a replica, or the primary again at the next failover). A full answer older than
# `SERVICE_ADDRESSES_KEPT_S` (DNS down that long) no longer admits a new node.
SERVICE_ADDRESSES_TTL_S = 30.0
SERVICE_ADDRESSES_KEPT_S = 3600.0
# `addresses`: every address named (None before any was), `seen`: address -> `time.monotonic()` it was last named;
# `at`: when every name last resolved (the last full answer).
_resolved: dict = {"at": -math.inf, "addresses": None, "seen": {}}
_resolving = threading.Lock()


def control_plane_service_addresses(*, admitting: bool = True) -> frozenset[
        ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The IPs of the control plane's own PostgreSQL and Redis (`DATABASE_URL`, `REDIS_URL`, `CELERY_BROKER_URL`): a
    node never advertises one, even inside `NODE_NETWORKS`. A host name is looked up again once its last answer is
    `SERVICE_ADDRESSES_TTL_S` old, and an address it named stays refused for `SERVICE_ADDRESSES_KEPT_S` after. Raises
    `ServiceAddressesUnresolved` (with what is known, `kept`) when a name does not resolve before the first full answer
    (fail closed: the callers refuse new nodes and answer 503), for `RESOLVE_RETRY_S` after the failure (a DNS failure
    at first use once cached an empty set, and the check was off for the process's life). A later look-up that fails
    keeps the last good answer, merges in the names that did resolve, and logs; it is tried again `RESOLVE_RETRY_S`
    later. Once the last full answer is `SERVICE_ADDRESSES_KEPT_S` old it raises again for `admitting` (a new node's
    registration), never for judging an admitted node (`admitting=False`: heartbeats, sweeps, the directory).
    NOTE: before, a failed re-lookup raised too: one DNS hiccup after the TTL refused every node's host. Then the
    last good answer was kept forever, and a partial failure discarded the names that had resolved.

    NOTE: before, a name was resolved once per process: after a managed database's failover moved it to another IP,
    a node registered at the new one (inside the node networks) was admitted and the gateway POSTed prompts to the
    database (`tests/test_node_networks.py`). One thread looks up at a time; the others take the last good answer
    meanwhile (or wait, before the first, and take its outcome: a failure too). The web pods' egress NetworkPolicy
    (`infra/k8s/base/network-policies.yaml`) is the other wall. Loopback ones matter only where loopback nodes are refused: the local stack allows them
    (`ALLOW_LOOPBACK_NODES`) and its servers are there."""
    if time.monotonic() - _resolved["at"] < SERVICE_ADDRESSES_TTL_S:
        return _resolved["addresses"]
    if time.monotonic() - _last_unresolved["at"] >= RESOLVE_RETRY_S and _resolving.acquire(
            blocking=_resolved["at"] == -math.inf):  # else another thread is looking them up: the last answer
        try:
            # NOTE: not looked up, nor failed, while this one waited: before, each caller queued behind a failed first
            # look-up ran its own (8 threads behind a resolver failing in 0.5 s: 8 look-ups in a row, 4 s).
            if (time.monotonic() - _resolved["at"] >= SERVICE_ADDRESSES_TTL_S
                    and time.monotonic() - _last_unresolved["at"] >= RESOLVE_RETRY_S):
                if _look_up_service_addresses():
                    return _resolved["addresses"]  # a full answer, just made
        finally:
            _resolving.release()
    return _service_addresses_known(admitting)


def _look_up_service_addresses() -> bool:
    """Look the names up now and merge what resolved into `_resolved` (under `_resolving`); whether all resolved."""
    named, unresolved_host = _resolve_service_addresses()
    now = time.monotonic()
    seen = dict(_resolved["seen"])
    if not unresolved_host:  # NOTE: forgotten only after a full answer: one that failed names not all that is ours
        seen = {address: at for address, at in seen.items() if now - at < SERVICE_ADDRESSES_KEPT_S}
    seen.update(dict.fromkeys(named, now))
    _resolved.update(addresses=frozenset(seen), seen=seen)
    if unresolved_host:
        _last_unresolved.update(at=now, host=unresolved_host)
        logger.warning("the control plane's own address %s did not resolve: the last good answer is kept",
                       unresolved_host)
        return False
    _resolved["at"] = now
    return True


def _service_addresses_known(admitting: bool) -> frozenset[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The addresses known now, or `ServiceAddressesUnresolved` when they cannot be trusted to judge by: no full
    answer yet, or (`admitting`) none for `SERVICE_ADDRESSES_KEPT_S`."""
    age = time.monotonic() - _resolved["at"]
    answered = _resolved["at"] > -math.inf
    if age < SERVICE_ADDRESSES_TTL_S or (answered and (not admitting or age < SERVICE_ADDRESSES_KEPT_S)):
        return _resolved["addresses"]
    raise ServiceAddressesUnresolved(_last_unresolved["host"], kept=_resolved["addresses"] or frozenset())


def _forget_service_addresses() -> None:
    """Look every name up afresh at the next call (settings changed: tests)."""
    _resolved.update(at=-math.inf, addresses=None, seen={})


control_plane_service_addresses.cache_clear = _forget_service_addresses  # as `functools.cache` spelled it


def _resolve_service_addresses() -> tuple[set[ipaddress.IPv4Address | ipaddress.IPv6Address], str]:
    """What the control plane's own service URLs name now, and the first host name that did not resolve ("" if none).
    NOTE: the look-up stops there: while DNS is down each name would wait out the resolver's timeout."""
    addresses = set()
    for url in (settings.DATABASE_URL, settings.REDIS_URL, settings.CELERY_BROKER_URL):
        try:
            host = urlsplit(url).hostname
        except ValueError:
            host = None
        if not host or host.startswith("/"):  # a Unix socket
            continue
        try:
            addresses.add(_unmapped(ipaddress.ip_address(_normal_host(host))))
            continue
        except ValueError:
            pass
        try:
            resolved = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
        except OSError:
            return addresses, host
        addresses.update(_unmapped(ipaddress.ip_address(info[4][0].split("%", 1)[0])) for info in resolved)
    return addresses, ""


def _unmapped(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """`::ffff:10.0.0.5` as `10.0.0.5`: one spelling for an IPv4 address, as nodes' hosts are compared."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


_THIS_NETWORK = ipaddress.ip_network("0.0.0.0/8")  # "this host on this network": never a node's address
# The clouds' instance metadata services (credentials of the machine's role): AWS, GCP, Azure and OpenStack's IPv4 and
# AWS's IPv6 address, ECS's task metadata, Alibaba Cloud's (in 100.64.0.0/10, which node networks may name).
_INSTANCE_METADATA_ADDRESSES = frozenset(ipaddress.ip_address(address) for address in (
    "169.254.169.254", "fd00:ec2::254", "169.254.170.2", "100.100.100.200"))


def _normal_host(host: str) -> str:
    host = host.strip().lower().strip("[]")
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host



class JoinTokenQuerySet(models.QuerySet):
    def with_num_nodes(self):
        """Each token with `num_nodes`: the nodes joined with it that are not retired (a retired node's secret is void)."""
        return self.annotate(num_nodes=models.Count("nodes", filter=~models.Q(nodes__secret_digest="")))

    def usable(self):
        """The tokens that admit a node now: not revoked, uses left, not expired by PostgreSQL's clock.

        NOTE: what registration, a retire and a rotation decide by. A pool launch's token expires at its deadline,
        PostgreSQL's clock (`database_now`); judged by a web pod's (`JoinToken.is_usable`), a pod 11 minutes ahead
        refused every pool machine, each terminated at its deadline and launched again."""
        return self.filter(revoked_at__isnull=True).filter(
            models.Q(max_uses__isnull=True) | models.Q(num_uses__lt=models.F("max_uses"))
        ).filter(models.Q(expires_at__isnull=True) | models.Q(expires_at__gt=Now()))


class JoinToken(models.Model):
    TOKEN_KIND = "jt"

    name = models.CharField(max_length=100)
    lookup = models.CharField(max_length=tokens.LOOKUP_LENGTH, unique=True)
    digest = models.CharField(max_length=64)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, related_name="+")
    expires_at = models.DateTimeField(null=True, blank=True)
    max_uses = models.PositiveIntegerField(null=True, blank=True)
    num_uses = models.PositiveIntegerField(default=0)
    revoked_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    objects = JoinTokenQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.name} ({self.TOKEN_KIND}_{self.lookup})"

    def is_usable(self, now=None) -> bool:
        """For the fleet page's display only, by this process's clock: decisions go by `JoinToken.objects.usable()`."""
        now = now or timezone.now()
        return (
            self.revoked_at is None
            and (self.expires_at is None or self.expires_at > now)
            and (self.max_uses is None or self.num_uses < self.max_uses)
        )


# How far behind the last heartbeat taken from a node a heartbeat of the same agent process may arrive and be taken
# for a delayed one (not taken). Its agent sends one at a time, 5 s apart by default (0.2 s at the least), and gives
# each up after its request timeout (10 s): one that a proxy held past 100 newer ones was held for minutes.
MAX_HEARTBEAT_REORDERING = 100


class NodeQuerySet(models.QuerySet):
    def schedulable(self):
        return self.filter(state=NodeState.READY)

    def placeable(self) -> list[Node]:
        """The READY nodes placement may give a replica: those whose registered host the gateway may reach
        (`Node.host_problem`, as `placement.choose_node` skips the others). A list: the rule is Python's.

        NOTE: what the console offers and what a node pool counts as spare come from here, so neither counts a node
        that placement never uses (a pool kept it as its warm machine and never launched a usable one)."""
        return [node for node in self.schedulable().order_by("pk") if not node.host_problem()]

    def admitted(self):
        """Nodes whose secret still admits their agent: all but the retired (`retire_node` voids the secret)."""
        return self.exclude(secret_digest="")

    def last_heartbeat_is(self, node_pk, heartbeat: tuple[str, int]):
        """The node, while `heartbeat` (boot id, sequence) is still the last heartbeat taken from it
        (`Node.heartbeat_is_newer`); what a heartbeat's reports write is conditioned on it, so of two heartbeats in
        flight at once the older's never lands after the newer's."""
        return self.filter(pk=node_pk, heartbeat_boot_id=heartbeat[0], heartbeat_sequence=heartbeat[1])


class Node(models.Model):
    SECRET_KIND = "nd"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(max_length=128)
    gpu_type = models.CharField(max_length=MAX_GPU_TYPE_CHARS)
    num_gpus = models.PositiveIntegerField(default=0)
    gpu_memory_mb = models.PositiveIntegerField(default=0)  # per GPU (CPU nodes: memory for the KV cache)
    num_cpus = models.PositiveIntegerField(default=1)
    memory_mb = models.PositiveIntegerField(default=0)
    labels = models.JSONField(default=dict, blank=True)
    quantizations = ArrayField(models.CharField(max_length=32), default=list, blank=True)
    state = models.CharField(max_length=16, choices=[(s.value, s.value.title()) for s in NodeState], default=NodeState.READY)
    # What staff had made of it (READY, CORDONED or DRAINING) when it went silent: it comes back to that,
    # so falling silent for a while never undoes a cordon or a drain. Empty while it is not OFFLINE.
    state_before_offline = models.CharField(max_length=16, blank=True, default="", db_default="")
    agent_version = models.CharField(max_length=MAX_VERSION_CHARS, blank=True)
    engine_version = models.CharField(max_length=MAX_VERSION_CHARS, blank=True)
    # What confines each engine on the node, as its agent found it: "landlock abi 6; own pid, mount and user
    # namespaces", or "none: <why>" and "no namespaces: <why>" for either part.
    engine_sandbox = models.CharField(max_length=200, blank=True, default="", db_default="")
    secret_lookup = models.CharField(max_length=tokens.LOOKUP_LENGTH, unique=True)
    secret_digest = models.CharField(max_length=64)
    # The secret's hash as it was when the node was retired (`retire_node` voids `secret_digest`): a heartbeat that
    # presents that very secret is told the node is retired (`protocol.NODE_RETIRED`), on which its agent stops its
    # engines and wipes their folders. The hash only, as `secret_digest`; empty for a node not retired, or retired
    # before it was kept.
    retired_secret_digest = models.CharField(max_length=64, blank=True, default="", db_default="")
    join_token = models.ForeignKey(JoinToken, on_delete=models.SET_NULL, null=True, related_name="nodes")
    # The uid of the Kubernetes agent pod that registered the node, as the API server's review of the pod's projected
    # service-account token named it (`RegisterRequest.pod_token`, on the node the registration names): only such a
    # node is a Kubernetes pool's machine (`pools.link_joins`). Empty for bare-metal nodes and for registrations that
    # carried no token (agents of the release before).
    agent_pod_uid = models.CharField(max_length=64, blank=True, default="", db_default="")
    # Each GPU as the agent reported it: [{index, uuid, name, memory_mb, mig_slices: [{uuid, profile,
    # memory_mb}]}]. Empty for CPU nodes and agents older than per-GPU placement: placement then
    # treats the node's GPU memory as one pool and assigns no GPU indices.
    gpus = models.JSONField(default=list, db_default=[], blank=True)
    # The latest heartbeat as the agent sent it (GPUs, weights cache, …), for the fleet pages.
    last_status = models.JSONField(default=dict, blank=True)
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)
    # The last heartbeat whose report was taken: its agent process (`Heartbeat.boot_id`) and its number there
    # (`Heartbeat.sequence`); empty and null until an agent that numbers its heartbeats beats. NOTE: a default in the
    # database too: the previous release's web pods, running on this schema during a deploy, insert nodes without it.
    heartbeat_boot_id = models.CharField(max_length=MAX_BOOT_ID_CHARS, blank=True, default="", db_default="")
    heartbeat_sequence = models.BigIntegerField(null=True, blank=True)
    # Where its engines listen, as registered (never from a heartbeat): replica addresses must match.
    advertise_host = models.CharField(max_length=253, default="127.0.0.1")
    engine_port_min = models.PositiveIntegerField(default=DEFAULT_ENGINE_PORT_MIN)
    engine_port_max = models.PositiveIntegerField(default=DEFAULT_ENGINE_PORT_MAX)
    # NOTE: stamped by PostgreSQL's clock at registration (`register_node`), as a pool's launch times are: the tick links
    # a machine to its launch by name only if it registered after the launch was requested (`pools.link_joins`).
    registered_at = models.DateTimeField(default=timezone.now)

    objects = NodeQuerySet.as_manager()

    class Meta:
        ordering = ["name"]
        indexes = [models.Index(fields=["state", "gpu_type"])]

    def __str__(self) -> str:
        return self.name

    def engine_address_problem(self, address: str) -> str:
        return engine_address_problem(address, self.advertise_host, self.engine_port_min, self.engine_port_max)

    def host_problem(self) -> str:
        """Why the gateway may not reach this node's engines at all ("" if it may): its registered host as
        `advertise_host_problem` judges it now (an admitted node: kept while our own names cannot be resolved), and its
        engine ports as `engine_ports_problem` does.

        NOTE: a node registered before those rules, or before `ALLOW_LOOPBACK_NODES` was turned off, keeps a host or
        ports the gateway refuses (`engine_address_problem`): placement skips it (`placement.choose_node`) and the
        sweeps move its replicas elsewhere (`scheduler.move_off_unreachable_nodes`), rather than fail them there in a
        loop."""
        return advertise_host_problem(self.advertise_host, admitting=False) or engine_ports_problem(
            self.engine_port_min, self.engine_port_max
        )

    def heartbeat_is_newer(self, boot_id: str, sequence: int | None) -> bool:
        """Whether a heartbeat numbered so is newer than the last one taken from this node (read under its row lock).

        NOTE: an agent older than the numbering (no sequence) is taken, as before; so is another agent process's
        first (a restarted agent counts from 1 again, under a new boot id), and one more than
        `MAX_HEARTBEAT_REORDERING` behind the last taken: the same process counting again from an earlier point (a VM or
        process snapshot restored), which would otherwise have none of its reports taken until its count passed the
        stored one. A heartbeat held in flight that long would be taken once, and put right by the next. What stays open: a
        heartbeat of a previous agent process delayed past its successor's first is taken once, and after it one of
        the successor's own delayed heartbeats may be too (its boot id differs from the stored one again); the
        successor's next heartbeat puts the node's replicas right."""
        if sequence is None or boot_id != self.heartbeat_boot_id or self.heartbeat_sequence is None:
            return True
        return sequence > self.heartbeat_sequence or sequence < self.heartbeat_sequence - MAX_HEARTBEAT_REORDERING

    @property
    def total_gpu_memory_mb(self) -> int:
        return self.gpu_memory_mb * max(self.num_gpus, 1)

    def knows_action(self, action: ReplicaAction) -> bool:
        """Whether the node's agent, as its last heartbeat said (`protocol.understood_actions`), carries out `action`.
        A node with no heartbeat since the control plane kept it is taken to, as before; its next heartbeat says."""
        known = (self.last_status or {}).get(REPLICA_ACTIONS_KNOWN)
        return not isinstance(known, list) or action.value in known

    def launches_within_billed_context(self) -> bool:
        """Whether the node's agent, as its last heartbeat said, launches each engine with no more context than its
        spec's `billed_context_tokens`; an older agent ignores it and launches with its own reading of the model. A
        node with no heartbeat since the control plane kept it is taken to, as `knows_action` does; its next heartbeat
        says."""
        return (self.last_status or {}).get(LAUNCHES_WITHIN_BILLED_CONTEXT) is not False

    def gpu_shape(self) -> tuple[int, int]:
        """(GPUs, MiB per GPU) this node may hold at most: what it registered with its join token, within its
        pool's shape when a pool launched it (staff's figures, not the machine's)."""
        num_gpus, memory_mb = self.num_gpus, self.gpu_memory_mb
        pool_shape = NodeLaunch.objects.filter(node=self).values_list("pool__gpus_per_node", "pool__gpu_memory_mb").first()
        if pool_shape is not None:
            num_gpus, memory_mb = min(num_gpus, pool_shape[0]), min(memory_mb, pool_shape[1])
        return num_gpus, memory_mb

    def keep_within_shape(self) -> str:
        """Hold what it registered (its count, size per GPU and GPU list) to `gpu_shape`, and its GPU type to its pool's;
        returns what was ignored.

        NOTE: a pool's machine registers with its launch's join token, which sits on the machine: what its agent
        says of itself is held to what staff made the pool once it is linked to its launch, as its heartbeats are.
        """
        num_gpus, memory_mb = self.gpu_shape()
        gpus, ignored = bounded_gpu_inventory(self.gpus, (num_gpus, memory_mb))
        # NOTE: and its GPU type: a pool's machine that said it was another type took that type's endpoints (another
        # pool's to serve, billed as that type) onto the pool's hardware.
        gpu_type = NodeLaunch.objects.filter(node=self).values_list("pool__gpu_type", flat=True).first() or self.gpu_type
        if (num_gpus, memory_mb, gpus, gpu_type) == (self.num_gpus, self.gpu_memory_mb, self.gpus, self.gpu_type):
            return ""
        if (num_gpus, memory_mb, gpus) != (self.num_gpus, self.gpu_memory_mb, self.gpus):
            ignored = ignored or f"registered past its shape ({num_gpus} GPUs of {memory_mb} MiB)"
        if gpu_type != self.gpu_type:
            ignored = "; ".join(filter(None, [f"registered as {self.gpu_type}, its pool's machines are {gpu_type}", ignored]))
        Node.objects.filter(pk=self.pk).update(num_gpus=num_gpus, gpu_memory_mb=memory_mb, gpus=gpus, gpu_type=gpu_type)
        self.num_gpus, self.gpu_memory_mb, self.gpus, self.gpu_type = num_gpus, memory_mb, gpus, gpu_type
        return ignored


def gpu_inventory(gpus: list[GpuStatus]) -> list[dict]:
    """What a node keeps of its agent's GPU reports (`Node.gpus`): identity and size, not load."""
    return [
        {"index": gpu.index, "uuid": gpu.uuid, "name": gpu.name, "memory_mb": gpu.memory_total_mb,
         "mig_slices": [slice_.to_dict() for slice_ in gpu.mig_slices]}
        for gpu in sorted(gpus, key=lambda gpu: gpu.index)
    ]


def bounded_gpu_inventory(inventory: list[dict], shape: tuple[int, int]) -> tuple[list[dict], str]:
    """`inventory` (`gpu_inventory`) within a node's `shape` (`Node.gpu_shape`), and what of it was ignored ("" if nothing).

    NOTE: a heartbeat is the machine's word, and a machine holding one node's secret is trusted with nothing beyond
    its own replicas: GPUs past the shape's count (the lowest indices stay) and memory past its size per GPU are
    ignored, never placed on. Before, a heartbeat's list replaced the node's: 64 GPUs of any size pulled the first
    replica of every endpoint (its spec, credentials and prompts) onto one machine.
    """
    num_gpus, memory_mb = shape
    kept = [dict(gpu, memory_mb=min(gpu["memory_mb"], memory_mb)) for gpu in inventory[:num_gpus]]
    ignored = []
    if len(inventory) > num_gpus:
        ignored.append(f"{len(inventory) - num_gpus} GPU(s) past the {num_gpus} it may have")
    if any(gpu["memory_mb"] > memory_mb for gpu in inventory[:num_gpus]):
        ignored.append(f"memory past {memory_mb} MiB per GPU")
    return kept, "; ".join(ignored)


class PoolProvider(models.TextChoices):
    """Where a pool's machines come from (`endpoints.fleet.providers`)."""

    LOCAL = "local", "Local agent processes"
    EC2 = "ec2", "Amazon EC2"
    KUBERNETES = "kubernetes", "Kubernetes placeholder pods"


class NodePool(models.Model):
    """Staff-defined machines of one shape that the fleet launches on demand and releases when idle.

    `min_nodes` always run; `warm_nodes` more are kept empty and ready; never more than `max_nodes`.
    A node empty for `idle_timeout_s` is released down to min + warm; one that has not registered
    within `join_deadline_s` of its launch is terminated and replaced.
    """

    name = models.SlugField(max_length=63, unique=True)
    gpu_type = models.CharField(max_length=32)  # catalogue name (endpoints.catalogue.GPU_TYPES)
    provider = models.CharField(max_length=16, choices=PoolProvider.choices)
    # The provider's machine template (validated by the provider): local agent options, an EC2
    # launch template and subnets, a Kubernetes node selector and GPU resource.
    template = models.JSONField(default=dict, blank=True)
    gpus_per_node = models.PositiveIntegerField(default=1)  # 0 for CPU machines
    # Per GPU (CPU machines: the memory their engines may use), what placement will see once one joins.
    gpu_memory_mb = models.PositiveIntegerField(default=0)
    min_nodes = models.PositiveIntegerField(default=0)
    max_nodes = models.PositiveIntegerField(default=1)
    warm_nodes = models.PositiveIntegerField(default=0)
    idle_timeout_s = models.PositiveIntegerField(default=600)
    join_deadline_s = models.PositiveIntegerField(default=600)
    hourly_price = models.DecimalField(max_digits=10, decimal_places=4, default=0)  # per node-hour, the fleet's cost
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class LaunchState(models.TextChoices):
    REQUESTED = "REQUESTED"  # decided and recorded; the provider has not confirmed it yet
    LAUNCHING = "LAUNCHING"  # the provider has the machine; its agent has not registered yet
    JOINED = "JOINED"  # its agent registered: `node` is set
    RELEASING = "RELEASING"  # cordoned and empty, being terminated
    TERMINATED = "TERMINATED"
    FAILED = "FAILED"  # never joined, or the provider refused; `reason` says why


LIVE_LAUNCH_STATES = (LaunchState.REQUESTED, LaunchState.LAUNCHING, LaunchState.JOINED, LaunchState.RELEASING)


class NodeLaunch(models.Model):
    """One machine a pool asked its provider for, from the decision to its termination.

    NOTE: its id is the provider's idempotency key (EC2 ClientToken, pod name, process tag): a launch
    retried after a crash between the decision and the provider's answer never makes a second machine.
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    pool = models.ForeignKey(NodePool, on_delete=models.PROTECT, related_name="launches")
    state = models.CharField(max_length=16, choices=LaunchState.choices, default=LaunchState.REQUESTED)
    provider_id = models.CharField(max_length=255, blank=True)  # instance id, pod name, process id
    zone = models.CharField(max_length=128, blank=True)  # subnet / zone it went to; a retry avoids a failed one
    # One-use, expiring at the join deadline: the machine's agent registers with it.
    join_token = models.OneToOneField(JoinToken, on_delete=models.SET_NULL, null=True, blank=True, related_name="launch")
    node = models.OneToOneField(Node, on_delete=models.SET_NULL, null=True, blank=True, related_name="launch")
    reason = models.TextField(blank=True)
    requested_at = models.DateTimeField(default=timezone.now)
    launched_at = models.DateTimeField(null=True, blank=True)
    joined_at = models.DateTimeField(null=True, blank=True)
    deadline_at = models.DateTimeField()  # joined by then, or terminated and replaced
    terminated_at = models.DateTimeField(null=True, blank=True)
    # Node-hours: empty since `idle_since` (None: busy or not joined); `idle_s` holds earlier empty
    # spells. Booting (requested to joined) counts as idle: paid for, serving nothing.
    idle_since = models.DateTimeField(null=True, blank=True)
    idle_s = models.FloatField(default=0)

    class Meta:
        ordering = ["-requested_at"]
        indexes = [models.Index(fields=["pool", "state"])]

    def __str__(self) -> str:
        return f"{self.pool.name}/{str(self.pk)[:8]}"

    def node_seconds(self, now=None) -> tuple[float, float]:
        """(Seconds paid for, of them seconds idle) up to `now` or its termination.

        Paid from the request to the provider until termination; idle while booting (not joined
        yet), and while joined with no active replica.
        """
        now = now or timezone.now()
        end = self.terminated_at or now
        total = max(0.0, (end - self.requested_at).total_seconds())
        idle = self.idle_s
        if self.joined_at is None and self.terminated_at is None:
            idle += total  # still booting: all of it so far
        elif self.idle_since is not None:
            idle += max(0.0, (end - self.idle_since).total_seconds())
        return total, min(idle, total)


class StrayMachine(models.Model):
    """A machine a pool's provider lists, carrying this fleet's marking, whose launch id no `NodeLaunch` knows: its
    record was lost (PostgreSQL failed over to a replica without the commit, or restored to an earlier point) after the
    launch was sent. The stray sweep (`endpoints.fleet.pool_strays`) terminates it once it has been seen so for
    `STRAY_GRACE_S`.

    NOTE: `first_seen_at` and `claimed_at` are PostgreSQL's clock, never a worker's or the provider's: a skewed clock
    cannot shorten the grace. `claimed_at` is the conditional-update claim of the sweep that terminates it (two sweeps
    at once: one terminates and audits); `terminated_at` the first termination the provider accepted."""

    pool = models.ForeignKey(NodePool, on_delete=models.CASCADE, related_name="strays")
    provider_id = models.CharField(max_length=255)
    launch_id = models.CharField(max_length=255)
    first_seen_at = models.DateTimeField()
    claimed_at = models.DateTimeField(null=True, blank=True)
    # NOTE: set with the claim, before the provider is asked: a termination whose answer was lost (a timeout, the
    # worker killed) is still audited when the machine is gone at a later sweep.
    terminate_sent_at = models.DateTimeField(null=True, blank=True)
    terminated_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["pool", "provider_id"], name="stray_machine_once_per_pool")]

    def __str__(self) -> str:
        return f"{self.pool.name}/{self.provider_id}"


class FleetInstallation(models.Model):
    """This installation's own random id, one row: every machine a node pool launches carries it (EC2's
    `inferplane:installation` tag, the placeholder's `inferplane.dev/installation` label, the local agent's record).

    NOTE: only a machine carrying it may be terminated as a stray (`endpoints.fleet.pool_strays`). `INFERPLANE_FLEET_ID`
    and pool ids are alike in every deployment left on the defaults (staging and production in one AWS account, two
    control planes sharing a local-pool folder): each would take the other's machines for its own lost launches. Kept
    in PostgreSQL, so it survives restarts and restores; made by the migration, or by the first caller on a database
    without the row."""

    ROW = 1

    installation_id = models.UUIDField(default=uuid.uuid4, unique=True)

    @classmethod
    def current_id(cls) -> str:
        installation, _ = cls.objects.get_or_create(pk=cls.ROW)  # NOTE: two first callers: the pk makes one row
        return str(installation.installation_id)


class NodeSweep(models.Model):
    """When the node sweeps (`endpoints.scheduler.sweep_stuck`) last ended, by PostgreSQL's clock: one row.

    NOTE: kept in PostgreSQL, not Redis: a gap in the sweeps (PostgreSQL or the workers down, so no heartbeat could
    be written either) must still be seen when Redis lost its memory in the same outage. A missing key read as no gap,
    and the first agent to beat again ended the whole-fleet hold while the others were still backing off: OFFLINE."""

    ROW = 1

    swept_at = models.DateTimeField()
