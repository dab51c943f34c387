"""Fleet writes: join tokens, node registration, heartbeats, cordon, drain and retire.

A node that registers with a pool launch's join token joins that launch (`endpoints.fleet.launches`).

What a heartbeat says of each replica, and a node's drain, change replicas through `endpoints.replicas`.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import F, Value
from django.db.models.functions import Coalesce, Now, NullIf
from django.utils import timezone

from controlplane import tokens
from controlplane.accounts.known_credentials import SharedKnownCredentials
from controlplane.accounts.models import AuditEvent
from controlplane.accounts.services import SYSTEM, Actor, record_audit
from controlplane.credential_lookups import WAIT_S, CredentialLookups, ExpiringSet, LookupSlots
from controlplane.secrets import SecretUnreadable
from controlplane.worker_threads import in_worker_thread
from endpoints.adapters import adapter_specs, record_replica_adapters
from endpoints.catalogue import default_reasoning_parser
from endpoints.credentials import source_access
from endpoints.fleet.launches import link_joined_node
from endpoints.fleet.providers import kubernetes
from endpoints.fleet.providers.base import ProviderError, ProviderUnreachable
from endpoints.models import (
    LIVE_REPLICA_STATES,
    RESERVATION_FACTS,
    TEMPLATE_COUNT_FACTS,
    IdleAction,
    ModelFacts,
    Replica,
    merged_claims,
    replica_key,
    weights_scope_for,
)
from endpoints.nodes.models import (
    REPLICA_ACTIONS_KNOWN,
    JoinToken,
    LaunchState,
    Node,
    NodeLaunch,
    advertise_host_problem,
    bounded_gpu_inventory,
    control_plane_service_addresses,
    engine_ports_problem,
    gpu_inventory,
)
from endpoints.nodes.notify import notify_node
from endpoints.placement import WHOLE_GPU_MEMORY_FRACTION, weight_factor
from endpoints.replicas import apply_replica_report, drain_node, fail_replica, fail_replica_and_count
from endpoints.speculative import speculative_spec
from gpu_agent import protocol
from gpu_agent.protocol import FINAL_REPLICA_STATES, ModelTask, NodeState, ReplicaAction, ReplicaState

logger = logging.getLogger(__name__)


class AgentAuthError(Exception):
    """The agent's join token or node secret is not valid."""


class NodeUnknown(AgentAuthError):
    """A node secret that names no node (never issued here, or its node retired or deleted): the agent API answers 401
    with `protocol.NODE_UNKNOWN`, the one answer on which an agent registers again."""


class NodeRetired(AgentAuthError):
    """A node secret that is the very one of a retired node (`Node.retired_secret_digest`): the agent API answers 401
    with `protocol.NODE_RETIRED`, on which the agent stops its engines, wipes their folders and the weights, and idles."""


class NodeRefused(AgentAuthError):
    """A registered node whose host the gateway may no longer reach: the agent API answers 401 with the reason and
    `protocol.NODE_REFUSED`, on which the agent, its own secret accepted, stops its engines."""


class PodTokenUnreviewed(Exception):
    """The Kubernetes API did not answer the review of a registration's pod token (a timeout, a 5xx): the agent API
    answers 503, and the agent registers again shortly."""


class ReportRefused(ValueError):
    """A registration or heartbeat the control plane refuses whole, whatever its credentials (a 400 naming the field)."""


@dataclass(slots=True, frozen=True)
class CreatedJoinToken:
    join_token: JoinToken
    plain: str


def create_join_token(actor: Actor, *, name: str, expires_at: datetime | None = None, max_uses: int | None = None) -> CreatedJoinToken:
    issued = tokens.issue_token(JoinToken.TOKEN_KIND)
    with transaction.atomic():
        join_token = JoinToken.objects.create(
            name=name, lookup=issued.lookup, digest=issued.digest, created_by=actor.user,
            expires_at=expires_at, max_uses=max_uses,
        )
        record_audit(actor, None, "join_token.create", join_token, max_uses=max_uses)
    return CreatedJoinToken(join_token=join_token, plain=issued.plain)


def revoke_join_token(actor: Actor, join_token: JoinToken) -> None:
    if JoinToken.objects.filter(pk=join_token.pk, revoked_at__isnull=True).update(revoked_at=timezone.now()):
        record_audit(actor, None, "join_token.revoke", join_token)


def rotate_join_token(actor: Actor, join_token: JoinToken) -> CreatedJoinToken:
    """A new join token in place of `join_token`, which is revoked: the way to shut out a machine that joined with
    a token other machines share (a retired node's agent registers again with it as a new node).

    The new token keeps the old one's name, expiry and remaining uses. Nodes joined with the old token keep their
    own node secrets and run on; a machine that must register again (a new one, or one that lost its state) needs
    the new token.
    """
    remaining = None if join_token.max_uses is None else max(join_token.max_uses - join_token.num_uses, 0)
    with transaction.atomic():
        created = create_join_token(actor, name=join_token.name, expires_at=join_token.expires_at, max_uses=remaining)
        revoke_join_token(actor, join_token)
        record_audit(actor, None, "join_token.rotate", created.join_token, replaces=str(join_token))
    return created


# NOTE: the agent API is public: anyone may send well-formed node secrets and join tokens never seen before, each a
# query. One that names no node or token is remembered as refused (by its hash; a secret or token issued later is
# random and new, so never among them), and at most this many of each kind are looked up at once per process; the
# rest wait briefly, then get a 503 (`LookupsBusy`), which an agent retries. A node secret once valid and refused
# later (a retired node) never becomes valid again; a real join token refused for now (expired, used up) is not
# remembered, as staff may extend it.
MAX_AGENT_LOOKUPS = 4
REFUSED_AGENT_CREDENTIALS_S = 60.0
NODE_SECRET_LOOKUPS = CredentialLookups(max_concurrent=MAX_AGENT_LOOKUPS, refused_for_s=REFUSED_AGENT_CREDENTIALS_S)
JOIN_TOKEN_LOOKUPS = CredentialLookups(max_concurrent=MAX_AGENT_LOOKUPS, refused_for_s=REFUSED_AGENT_CREDENTIALS_S)
# Node secrets that matched a node in any web process, or were just issued: looked up without a slot in a process that
# never saw them (`known_credentials`). NOTE: known per process only, after a deploy or a scale-up of the web pods every
# node's heartbeat was a stranger's there, and a flood of made-up secrets had them all refused until the sweep judged
# the fleet silent.
NODE_SECRETS_KNOWN = SharedKnownCredentials("node_secret")
# NOTE: and at most this many of a registration's pod token reviews (a TokenReview, `_reviewed_agent_pod`) at once per
# process; the rest wait briefly, then get a 503 (`LookupsBusy`). Any holder of the shared join token may send made-up
# pod tokens: before, every one's review ran at once, each holding a web thread up to the client's timeouts while the
# API server was slow, and the agents' own reviews queued behind them in the web pods' flow.
POD_TOKEN_REVIEWS = LookupSlots(MAX_AGENT_LOOKUPS, wait_s=WAIT_S)
# The very secrets of retired nodes this process has answered `NodeRetired` (their SHA-256, as refused ones are):
# answered so again without a query. NOTE: a retire is for good, so none is ever wrong, and only a secret that matched a
# retired node's kept hash is added, so nobody without one can fill it. Before, each heartbeat and watch of a retired
# node's agent, or of anyone replaying its secret, queried the database.
RETIRED_NODE_SECRETS_KEPT_S = 3600.0
MAX_RETIRED_NODE_SECRETS = 10_000
RETIRED_NODE_SECRETS = ExpiringSet(RETIRED_NODE_SECRETS_KEPT_S, max_entries=MAX_RETIRED_NODE_SECRETS)
_RETIRED = "this node is retired: stop its engines and remove what they left"


def _find_join_token(plain: str) -> JoinToken | None:
    """The join token `plain` names, usable or not; None (and remembered) if it names none."""
    lookup = tokens.split_token(plain, JoinToken.TOKEN_KIND)
    if lookup is None or JOIN_TOKEN_LOOKUPS.is_refused(plain):
        return None
    with JOIN_TOKEN_LOOKUPS.slots.held():
        join_token = JoinToken.objects.filter(lookup=lookup).first()
    if join_token is None or not tokens.token_matches(plain, join_token.digest):
        JOIN_TOKEN_LOOKUPS.refuse(plain)
        return None
    return join_token


def register_node(request: protocol.RegisterRequest) -> protocol.RegisterResponse:
    """Admit a node with a join token; the answer carries its secret, which is stored only as a hash.
    Raises `AgentAuthError` for a join token that admits nobody (unknown, expired, used up, revoked), whatever the
    registration's host; `ReportRefused` for a usable token's host the gateway may not reach (`advertise_host_problem`)
    or engine ports outside the platform's (`engine_ports_problem`) before a use of the token is spent, audited
    (`node.register_refused`, naming the token): its holder tried to aim the gateway at an address outside the fleet's
    (once an hour for the same refusal, `_audit_refused_registration`);
    `ServiceAddressesUnresolved` (retry) while the control plane's own addresses do not resolve; `LookupsBusy` when
    other join tokens hold every lookup slot for longer than a caller may wait.

    NOTE: the token first: `ReportRefused` is answered `protocol.NODE_REFUSED`, on which the agent stops its engines,
    so only a control plane whose token admits the node may say it refuses the node. Before, the host was judged first
    and a bogus or revoked token at a host outside this environment's networks (an agent pointed at another
    environment) was told its node is refused, and stopped every engine. A stranger's refused registrations write
    nothing (and a refused token sent again costs no query, `JOIN_TOKEN_LOOKUPS`)."""
    join_token = _find_join_token(request.join_token)
    if join_token is None or not JoinToken.objects.usable().filter(pk=join_token.pk).exists():
        raise AgentAuthError("invalid, expired, revoked or used-up join token")
    problem = _registration_problem(request)
    if problem:
        logger.warning("registration of node %r with join token %s refused: advertise_host %r, engine ports "
                       "%d-%d: %s", request.name, join_token, request.advertise_host, request.engine_port_min,
                       request.engine_port_max, problem)
        _audit_refused_registration(join_token, request, problem)
        raise ReportRefused(problem)
    agent_pod_uid = _reviewed_agent_pod(request)
    issued = tokens.issue_token(Node.SECRET_KIND)
    with transaction.atomic():
        # NOTE: the use count is claimed with a conditional update so a token with max_uses=1
        # admits exactly one node even under concurrent registrations; and a token revoked or expired since the
        # check above admits nobody (a retire or a rotation revoking it under its row lock is waited for).
        claimed = JoinToken.objects.usable().filter(pk=join_token.pk).update(num_uses=F("num_uses") + 1)
        if not claimed:
            raise AgentAuthError("join token is used up")
        node = Node.objects.create(
            name=request.name, gpu_type=request.gpu_type, num_gpus=request.num_gpus,
            gpu_memory_mb=request.gpu_memory_mb, num_cpus=request.num_cpus, memory_mb=request.memory_mb,
            labels=request.labels, quantizations=list(request.supported_quantizations), gpus=gpu_inventory(request.gpus),
            agent_version=request.agent_version, engine_version=request.engine_version,
            engine_sandbox=request.engine_sandbox,
            advertise_host=request.advertise_host, engine_port_min=request.engine_port_min,
            engine_port_max=request.engine_port_max,
            secret_lookup=issued.lookup, secret_digest=issued.digest, join_token=join_token,
            agent_pod_uid=agent_pod_uid,
            # NOTE: PostgreSQL's clock, as the sweeps judge heartbeats (`database_time_ago`) and the pool's tick
            # compares the registration with its launch's request (`pools.link_joins`). Before, `registered_at` was
            # the web pod's: one 2 minutes behind never linked a Kubernetes machine to its launch by name, and the
            # machine was terminated at its deadline, READY, as "did not join".
            last_heartbeat_at=Now(), registered_at=Now(),
        )
        node.refresh_from_db(fields=["last_heartbeat_at", "registered_at"])
        # NOTE: in the node's transaction: a machine a pool launched (its launch's one-use join token) marks that
        # launch JOINED and is held to its pool's type and shape before any reconcile can see it. Linked after the
        # commit, a reconcile between the two placed another type's replica on the machine the machine claimed to be.
        # A node joined by hand belongs to no launch.
        record_audit(SYSTEM, None, "node.register", node, gpu_type=node.gpu_type, num_gpus=node.num_gpus)
        launch = link_joined_node(node)
    logger.info("node %s (%s) registered", node.name, node.pk)
    NODE_SECRETS_KNOWN.add(CredentialLookups.digest(issued.plain))  # its first heartbeat never behind a flood
    if launch is not None:
        logger.info("node %s joined as launch %s of pool %s", node.name, launch.pk, launch.pool_id)
    return protocol.RegisterResponse(
        node_id=str(node.pk), node_secret=issued.plain, heartbeat_interval_s=settings.AGENT_HEARTBEAT_INTERVAL_S
    )


def _reviewed_agent_pod(request: protocol.RegisterRequest) -> str:
    """The uid of the Kubernetes agent pod the registration's pod token is of, on the node it registers as ("" when it
    sent none: a bare-metal agent, or one of the release before, which no Kubernetes pool links: `pools.link_joins`).
    Raises `AgentAuthError` naming why the API server's review refused it (or when this control plane cannot ask one),
    `PodTokenUnreviewed` when the API server did not answer, `LookupsBusy` when other reviews hold every slot
    (`POD_TOKEN_REVIEWS`); before any write, so a refused registration leaves nothing.

    NOTE: before, a Kubernetes pool's machine was known by its node's name and its agent pod's IP alone: a holder of
    the shared join token registering there first took the machine over (`Machine.pod_bound`)."""
    if not request.pod_token:
        return ""
    try:
        with POD_TOKEN_REVIEWS.held():
            return kubernetes.reviewed_agent_pod(request.pod_token, request.name)
    except ProviderUnreachable as error:
        raise PodTokenUnreviewed(str(error)) from None
    except ProviderError as error:
        logger.warning("registration of node %r refused: its pod token: %s", request.name, error)
        raise AgentAuthError(f"the pod's service-account token was refused: {error}") from None


# NOTE: a refused node's agent registers again at every back-off (at most a minute; every 5 s had it exited, systemd's
# `Restart=always`), so one refusal is audited once an hour per join token, machine name, host, port range and reason,
# at most `MAX_REFUSED_REGISTRATIONS_AUDITED_PER_HOST` of one host. Before, each try wrote a row: 1,440 a day for each
# refused node while its token was usable. A host where one of the token's nodes is registered (the operator narrowed
# the networks under a fleet) is always audited so; of other hosts (a token's holder trying one after another), at most
# `MAX_REFUSED_REGISTRATIONS_AUDITED` refusals of one token an hour, then one `node.register_refusals_unaudited` row
# says the bound was reached. The log says each.
REFUSED_REGISTRATION_AUDIT_S = 3600
MAX_REFUSED_REGISTRATIONS_AUDITED = 100
MAX_REFUSED_REGISTRATIONS_AUDITED_PER_HOST = 5


def _audited_within(action: str, target, seconds: float, **details):
    """The audit rows of `action` on `target` written in the last `seconds` whose details hold `details`: what bounds
    an action a node or an agent can repeat to one row per period."""
    return AuditEvent.objects.filter(action=action, target_type=type(target).__name__, target_id=str(target.pk),
                                     created_at__gte=timezone.now() - timedelta(seconds=seconds),
                                     details__contains=details)


def _audit_refused_registration(join_token: JoinToken, request: protocol.RegisterRequest, problem: str) -> None:
    """Audit a usable join token's registration refused for its host or ports (`node.register_refused`), unless the
    same refusal of the token was audited within the hour, or as many of its host's as the hour's bound, or, for a host
    none of its nodes is registered on, as many of such refusals for the same reason as the hour's bound (the first
    past it writes `node.register_refusals_unaudited` naming the reason, once an hour a reason).

    NOTE: before, the bound counted every refusal of the token: a token a fleet shares and the operator narrowing the
    networks under 500 of its nodes audited 100, and its holder spending them on decoy hosts first left its real probes
    (a Redis address) unaudited. Then it counted every refusal of a host none of the token's nodes is on: 100 decoys
    outside the networks still hid a probe of the control plane's own Redis, or of the cloud's metadata service. Each
    reason has its own bound now (the control plane's own addresses are few, each capped at
    `MAX_REFUSED_REGISTRATIONS_AUDITED_PER_HOST`: never reaching it)."""
    refusal = {"name": request.name, "advertise_host": request.advertise_host,
               "engine_port_min": request.engine_port_min, "engine_port_max": request.engine_port_max,
               "reason": problem}
    audited = _audited_within("node.register_refused", join_token, REFUSED_REGISTRATION_AUDIT_S)
    if audited.filter(details__contains=refusal).exists() or audited.filter(
        details__contains={"advertise_host": request.advertise_host}
    )[:MAX_REFUSED_REGISTRATIONS_AUDITED_PER_HOST].count() >= MAX_REFUSED_REGISTRATIONS_AUDITED_PER_HOST:
        return
    registered_host = Node.objects.filter(join_token=join_token, advertise_host=request.advertise_host).exists()
    if not registered_host and audited.filter(details__contains={"registered_host": False, "reason": problem})[
        :MAX_REFUSED_REGISTRATIONS_AUDITED
    ].count() >= MAX_REFUSED_REGISTRATIONS_AUDITED:
        if not _audited_within("node.register_refusals_unaudited", join_token, REFUSED_REGISTRATION_AUDIT_S,
                               reason=problem).exists():
            record_audit(SYSTEM, None, "node.register_refusals_unaudited", join_token, reason=problem,
                         bound=MAX_REFUSED_REGISTRATIONS_AUDITED, period_s=REFUSED_REGISTRATION_AUDIT_S)
        return
    record_audit(SYSTEM, None, "node.register_refused", join_token, registered_host=registered_host, **refusal)


def _registration_problem(request: protocol.RegisterRequest) -> str:
    """Why the gateway may not route to engines at the registration's host and ports ("field: reason"; "" if it may).
    NOTE: the control plane's own addresses are resolved first, so a DNS failure of ours raises
    `ServiceAddressesUnresolved` (the agent retries) rather than refuse the node."""
    control_plane_service_addresses()
    host_problem = advertise_host_problem(request.advertise_host)
    if host_problem:
        return f"advertise_host: {host_problem}"
    ports_problem = engine_ports_problem(request.engine_port_min, request.engine_port_max)
    if ports_problem:
        return f"engine_port_min: {ports_problem}"
    return ""


def authenticate_node(secret: str) -> Node:
    """The node whose secret this is. Raises `AgentAuthError` for anything not shaped as a node secret (none sent),
    `NodeUnknown` for a node secret that names no node (a refused secret sent again costs no query), `NodeRetired` for
    the very secret of a node retired (`retire_node` keeps its hash), `LookupsBusy` when
    other secrets hold every lookup slot for longer than a caller may wait."""
    lookup = tokens.split_token(secret, Node.SECRET_KIND)
    if lookup is None:
        raise AgentAuthError("send 'Authorization: Bearer <node secret>'")
    _refuse_without_a_query(secret)
    # none for a secret that matched a node before, here or in another process: never behind a flood
    with NODE_SECRET_LOOKUPS.slot_for(secret, known_elsewhere=NODE_SECRETS_KNOWN.contains):
        node = Node.objects.filter(secret_lookup=lookup).first()
    if node is not None and not node.secret_digest and node.retired_secret_digest and tokens.token_matches(
            secret, node.retired_secret_digest):
        # NOTE: never remembered as refused: sent again, it is answered so again, never `NodeUnknown` (on which the
        # agent would register again); remembered as retired instead (`RETIRED_NODE_SECRETS`).
        RETIRED_NODE_SECRETS.add(CredentialLookups.digest(secret))
        NODE_SECRETS_KNOWN.discard(CredentialLookups.digest(secret))
        raise NodeRetired(_RETIRED)
    if node is None or not tokens.token_matches(secret, node.secret_digest):
        NODE_SECRET_LOOKUPS.refuse(secret)
        if node is not None:  # NOTE: a made-up secret has no mark: its refusal costs Redis nothing
            NODE_SECRETS_KNOWN.discard(CredentialLookups.digest(secret))
        raise NodeUnknown("invalid node secret")
    digest = CredentialLookups.digest(secret)
    if digest not in NODE_SECRET_LOOKUPS.known:  # NOTE: renewed once an hour a process, not at each heartbeat
        NODE_SECRETS_KNOWN.add(digest)
    NODE_SECRET_LOOKUPS.know(secret)
    return node


def _refuse_without_a_query(secret: str) -> None:
    """`NodeUnknown` for a secret refused a moment ago, `NodeRetired` for one this process knows a retired node's."""
    if NODE_SECRET_LOOKUPS.is_refused(secret):
        raise NodeUnknown("invalid node secret")
    if CredentialLookups.digest(secret) in RETIRED_NODE_SECRETS:
        raise NodeRetired(_RETIRED)


async def authenticate_node_async(secret: str) -> Node:
    """`authenticate_node` for an async view: a refused secret costs no thread, and callers beyond the lookup
    slots wait as coroutines, not as threads.

    NOTE: in a worker thread that closes its connection after (`in_worker_thread`): run on the loop's default executor
    and left open, each lookup pinned a pooled connection to that long-lived thread for good, so a few bogus secrets
    (no credentials needed) took the web process's whole pool and every request after got a 503
    (`tests/test_web_database_pool.py`)."""
    if tokens.split_token(secret, Node.SECRET_KIND) is None:
        raise AgentAuthError("send 'Authorization: Bearer <node secret>'")
    _refuse_without_a_query(secret)
    async with NODE_SECRET_LOOKUPS.slot_for_async(secret, known_elsewhere=NODE_SECRETS_KNOWN.contains_async):
        return await in_worker_thread(authenticate_node)(secret)


# The node's `last_status` key that says what of its heartbeat's GPU list was ignored (the fleet pages show it).
GPUS_IGNORED = "gpus_ignored"


def record_heartbeat(node: Node, heartbeat: protocol.Heartbeat) -> protocol.HeartbeatResponse:
    """Take the agent's report, move replica states forward, and answer with the desired replicas.

    Raises `ReportRefused` (nothing taken) when a report names no replica id the control plane could have issued;
    `NodeRefused` when the node's registered host is one the gateway may no longer reach (`Node.host_problem`: the
    operator narrowed `NODE_NETWORKS` since it registered; the sweep moves its replicas elsewhere);
    `ServiceAddressesUnresolved` (retry) while the control plane's own addresses do not resolve. Only reports on the node's own replicas in live states are taken, found in one query (`apply_replica_report`):
    one on a replica stopped or failed, or another node's, or made up, changes nothing, its events and adapters included.
    A numbered heartbeat (`Heartbeat.sequence`) no newer than the last taken from the node (`Node.heartbeat_is_newer`)
    changes nothing either, and is answered with the node's desired replicas.
    """
    control_plane_service_addresses(admitting=False)  # NOTE: a DNS failure of ours refuses no node (`_registration_problem`)
    host_problem = node.host_problem()
    if host_problem:
        raise NodeRefused(f"the node's registered host or engine ports are refused ({host_problem}); "
                          "register again with allowed ones")
    reported_ids = _reported_replica_ids(heartbeat.replicas)
    status = heartbeat.to_dict()
    status.pop("replicas", None)
    for own_column in ("engine_sandbox", "boot_id", "sequence"):  # kept in their own columns, below
        status.pop(own_column, None)
    status[REPLICA_ACTIONS_KNOWN] = sorted(action.value for action in protocol.understood_actions(heartbeat))
    with transaction.atomic():
        authenticated_digest = node.secret_digest
        node = Node.objects.select_for_update().get(pk=node.pk)
        if node.secret_digest != authenticated_digest:
            # NOTE: retired (`retire_node`) after this heartbeat's secret was checked, before its row lock:
            # it stays retired, nothing it reports is taken, and it is told to run nothing. Read under the
            # lock, so an OFFLINE that a retire wrote is never taken for a node coming back.
            return protocol.HeartbeatResponse(
                node_state=NodeState.OFFLINE, heartbeat_interval_s=settings.AGENT_HEARTBEAT_INTERVAL_S, desired=[])
        # NOTE: compared under the row lock, so of two heartbeats in flight at once the older, second here, is stale.
        stale = not node.heartbeat_is_newer(heartbeat.boot_id, heartbeat.sequence)
        if not stale:
            came_back, newly_ignored, sandbox_before, sandbox_changed = _take_node_report(node, heartbeat, status)
        elif node.state != NodeState.OFFLINE:
            # NOTE: its agent is alive, so the sweep must not take the node OFFLINE: an agent process restored from a
            # snapshot counts again below the stored number (`Node.heartbeat_is_newer`), and every heartbeat it sent
            # stale, the node went OFFLINE at the grace with every replica on it. Never for an OFFLINE node.
            Node.objects.filter(pk=node.pk).update(last_heartbeat_at=Now())
    if stale:
        # NOTE: older than one taken already (delayed in flight: a retry, a slow proxy): nothing of it is taken, its
        # replicas' states and its figures included, only that its agent lives. Before, a READY replica went back to
        # STARTING until the next heartbeat, and a stale word from a node gone silent since brought it back. Its agent
        # is answered as a current heartbeat would be.
        logger.info("node %s: heartbeat %d of agent %s came after a newer one: not taken", node.name,
                    heartbeat.sequence, heartbeat.boot_id)
        return protocol.HeartbeatResponse(
            node_state=NodeState(node.state),
            heartbeat_interval_s=settings.AGENT_HEARTBEAT_INTERVAL_S,
            desired=desired_replicas(node),
        )
    if came_back:
        record_audit(SYSTEM, None, "node.online", node)
    if newly_ignored:
        logger.warning("node %s: its heartbeat's GPUs past its registration were ignored: %s", node.name,
                       newly_ignored)
        _audit_node_at_most_hourly(node, "node.gpus_ignored", reason=newly_ignored)
    if sandbox_changed:
        _record_sandbox_change(node, sandbox_before)
    numbered = (heartbeat.boot_id, heartbeat.sequence) if heartbeat.sequence is not None else None
    # NOTE: as its replicas' reports, skipped once a newer heartbeat was taken since this one's check (its facts are
    # newer); before, they were learnt after the newer's. Left open: a newer one taken while these are being learnt,
    # whose facts may then be learnt first (each copy's under its own row lock, `ModelFacts.learn`).
    if numbered is None or Node.objects.last_heartbeat_is(node.pk, numbered).exists():
        record_model_facts(node, heartbeat.weights)
    live = set(Replica.objects.filter(node=node, pk__in=reported_ids).exclude(state__in=FINAL_REPLICA_STATES)
               .values_list("pk", flat=True)) if reported_ids else set()
    for report, replica_id in zip(heartbeat.replicas, reported_ids, strict=True):
        if replica_id not in live:
            continue
        # NOTE: adapters first: a report that fails its replica still says which adapters the engine refused.
        if report.adapters or report.adapter_failures:
            record_replica_adapters(node, report, heartbeat=numbered)
        apply_replica_report(node, report, heartbeat=numbered)
    return protocol.HeartbeatResponse(
        node_state=NodeState(node.state),
        heartbeat_interval_s=settings.AGENT_HEARTBEAT_INTERVAL_S,
        desired=desired_replicas(node),
    )


def _take_node_report(node: Node, heartbeat: protocol.Heartbeat, status: dict) -> tuple[bool, str, str, bool]:
    """Keep what a heartbeat says of its node (under the node's row lock): its time, status, GPUs, sandbox, state and
    number. Returns whether it came back from OFFLINE, what of its GPUs was ignored if that is news ("" if not), its
    sandbox fact before and whether that changed."""
    previous_status = node.last_status or {}
    came_back = node.state == NodeState.OFFLINE
    node.last_heartbeat_at = Now()  # NOTE: PostgreSQL's clock, as the sweeps judge it (`database_time_ago`)
    node.last_status = status
    node.agent_version = heartbeat.agent_version
    fields = ["last_heartbeat_at", "last_status", "agent_version", "state"]
    if heartbeat.sequence is not None:
        node.heartbeat_boot_id, node.heartbeat_sequence = heartbeat.boot_id, heartbeat.sequence
        fields += ["heartbeat_boot_id", "heartbeat_sequence"]
    inventory = gpu_inventory(heartbeat.gpus)
    # NOTE: only an agent that names its GPUs (by UUID) gets per-GPU placement; an older one
    # keeps the pooled placement it was registered with. What it names is bounded by what the node
    # registered (its pool's shape), the rest ignored with the reason on the node (`bounded_gpu_inventory`).
    ignored = ""
    if inventory and all(gpu["uuid"] for gpu in inventory):
        inventory, ignored = bounded_gpu_inventory(inventory, node.gpu_shape())
        if inventory != node.gpus:
            node.gpus = inventory
            fields.append("gpus")
    newly_ignored = ignored if ignored != previous_status.get(GPUS_IGNORED) else ""
    # NOTE: written only when it changed (a fact is stable for hours); None from an agent older than the field.
    sandbox_before = node.engine_sandbox
    sandbox_changed = heartbeat.engine_sandbox is not None and heartbeat.engine_sandbox != sandbox_before
    if sandbox_changed:
        node.engine_sandbox = heartbeat.engine_sandbox
        fields.append("engine_sandbox")
    if ignored:
        status[GPUS_IGNORED] = ignored
    if came_back:
        # NOTE: its replicas were failed and replaced while it was gone; they are absent from
        # `desired` below, so the agent stops them: a returning node is reconciled, not trusted.
        # A cordoned or draining node comes back cordoned or draining: silence undoes no decision.
        held = node.state_before_offline
        node.state = held if held in (NodeState.CORDONED, NodeState.DRAINING) else NodeState.READY
        # NOTE: and a pool's machine being released (it went silent, its terminate is retried) comes back
        # cordoned: READY, it won placement and the next tick terminated it under the replica.
        if node.state == NodeState.READY and NodeLaunch.objects.filter(
            node=node, state=LaunchState.RELEASING
        ).exists():
            node.state = NodeState.CORDONED
        node.state_before_offline = ""
        fields.append("state_before_offline")
    node.save(update_fields=fields)
    return came_back, newly_ignored, sandbox_before, sandbox_changed


# A node's own word audited at most once an hour per fact (`_audit_node_at_most_hourly`), at most this many an hour a
# node and action; a sandbox's new gap always (`_record_sandbox_change`).
NODE_REPORT_AUDIT_S = 3600
MAX_NODE_REPORTS_AUDITED = 5


def _audit_node_at_most_hourly(node: Node, action: str, **details) -> None:
    """Audit what a node's heartbeat says of itself (`node.gpus_ignored`) unless the node had a row of that action saying
    the same within the hour, or `MAX_NODE_REPORTS_AUDITED` rows of it: its current word is on the node's row and each
    is logged.

    NOTE: each is audited when it changes, and a node alternating two facts (two GPU lists past its registration)
    changed it every other heartbeat: a row each, 8,640 a day, with no more than a stolen node secret. Then one row of
    the action an hour hid a second, different word within the hour."""
    audited = _audited_within(action, node, NODE_REPORT_AUDIT_S)
    if audited.filter(details__contains=details).exists() or audited[:MAX_NODE_REPORTS_AUDITED].count() >= (
            MAX_NODE_REPORTS_AUDITED):
        return
    record_audit(SYSTEM, None, action, node, **details)


def _record_sandbox_change(node: Node, before: str) -> None:
    """Say that a node's engine sandbox changed; audited (`node.sandbox_weakened`) when it lost a part of it, unless
    each gap it has (`protocol.ENGINE_SANDBOX_GAPS`) was in a fact audited within the hour.

    NOTE: a node alternating a confined and a weakened fact is so audited once an hour, and a sandbox weakened again
    (Landlock turned off after the namespaces were lost) at once. Before, one row of the action an hour: the second,
    worse weakening within the hour left no audit trace."""
    if not protocol.engine_sandbox_weakened(before, node.engine_sandbox):
        logger.info("node %s: its engine sandbox is now %r (was %r)", node.name, node.engine_sandbox, before)
        return
    logger.warning("node %s: its engine sandbox weakened: %r (was %r)", node.name, node.engine_sandbox, before)
    audited_facts = _audited_within("node.sandbox_weakened", node, NODE_REPORT_AUDIT_S).values_list(
        "details__engine_sandbox", flat=True)
    audited_gaps = {gap for fact in audited_facts for gap in protocol.ENGINE_SANDBOX_GAPS if gap in (fact or "")}
    if any(gap in node.engine_sandbox and gap not in audited_gaps for gap in protocol.ENGINE_SANDBOX_GAPS):
        record_audit(SYSTEM, None, "node.sandbox_weakened", node, engine_sandbox=node.engine_sandbox, before=before)


def _reported_replica_ids(reports: list[protocol.ReplicaStatus]) -> list[uuid.UUID]:
    """Each report's replica id as a UUID, the form the control plane issues them in (`ReportRefused` if not)."""
    try:
        return [uuid.UUID(report.replica_id) for report in reports]
    except ValueError:
        raise ReportRefused("replica_id: each must be a replica's UUID") from None


def record_model_facts(node: Node, weights: list[protocol.WeightsStatus]) -> None:
    """Keep what the node read from its models' configs (context length, architecture, parameters, quantization,
    tokenizer normalizer)
    and the size of their files as stored (placement's estimate of the engine's weights).

    NOTE: taken only for sources this node runs replicas of now (live states): a node cannot set the limits of
    a model it was never asked to run, nor of one it ran once (its replica rows are kept for ever). And kept in the
    scope its replicas read the source in (`weights_scope_for`): a catalogue model's name served from one
    tenant's own store (its credential, its endpoint URL) sets that tenant's facts, not every tenant's.
    A source this node reads in two scopes at once is skipped: its report does not say which copy it read.
    What a report may change, and what one node cannot, is `ModelFacts.learn`'s rule; a size is plausible only
    up to what the node's GPUs could hold of it at its replicas' quantization.
    NOTE: only copies the node read in that same scope count (`WeightsStatus.scope`): a tenant's draft
    or adapter naming a catalogue source is read in the tenant's scope, so what the tenant's store said
    about it never becomes the catalogue's facts. Of several copies in one scope, the most recently used
    complete one speaks. An older agent reports no scope: its one copy of a source counts, several none.
    """
    copies: dict[tuple[str, str | None], list[protocol.WeightsStatus]] = {}
    for status in weights:
        if status.size_bytes > 0 or status.model_info is not None:
            copies.setdefault((status.source, status.scope), []).append(status)
    if not copies:
        return
    scopes: dict[str, set[str]] = {}
    quantizations: dict[str, set[str]] = {}
    # The claims of this copy that stand by what this node runs now (`ModelFacts.running_claimants`): its own, and its
    # live replicas'; a steady heartbeat asks the database of no other (`_nothing_to_write`).
    standing: dict[tuple[str, str], set[str]] = {}
    for replica_id, organization_id, credential_id, source, quantization in (
            Replica.objects.filter(node=node, state__in=LIVE_REPLICA_STATES,
                                   endpoint__model_source__in=list({source for source, _ in copies})).order_by()
            .values_list("pk", "endpoint__organization_id", "endpoint__credential_id", "endpoint__model_source",
                         "endpoint__quantization")):
        scope = weights_scope_for(organization_id, credential_id, source)
        scopes.setdefault(source, set()).add(scope)
        quantizations.setdefault(source, set()).add(quantization)
        standing.setdefault((source, scope), {str(node.pk)}).add(replica_key(replica_id))
    known = {(facts.source, facts.scope): facts for facts in ModelFacts.objects.filter(source__in=list(scopes))}
    for source, (scope, *others) in scopes.items():
        statuses = copies.get((source, scope)) or _unscoped_copy(copies.get((source, None)))
        if others or not statuses:
            continue
        complete = [w for w in statuses if w.complete and w.model_info is not None]
        newest = max(complete, key=lambda w: w.last_used_at or 0.0) if complete else None
        size_bytes = newest.size_bytes if newest is not None else max(w.size_bytes for w in statuses)
        values = {"weights_bytes": size_bytes} if size_bytes > 0 else {}
        info = newest.model_info if newest is not None else None
        if info is not None:
            values |= {"max_model_len": info.max_model_len, "architecture": info.architecture[:200], "num_params": info.num_params}
            if info.quantization is not None:  # an older agent does not read it: keep what another one did
                values["checkpoint_quantization"] = info.quantization.to_dict()
            if info.tokenizer_normalizer is not None:  # the same
                values["tokenizer_normalizer"] = info.tokenizer_normalizer.to_dict()
        if scope and len(complete) > 1:
            # NOTE: a tenant's copies of one source are its revisions (its branch moved between two replicas' starts),
            # and the node does not say which its replicas run: what bounds a reservation is theirs merged, as over
            # nodes (`ModelFacts.learn`). Before, the most recently used spoke, the cheaper while the costlier served.
            values |= merged_claims({w.cache_key: _reservation_facts(w.model_info) for w in complete})
        if not values:
            continue
        facts = known.get((source, scope))
        if facts is not None and _nothing_to_write(facts, str(node.pk), values, standing[source, scope]):
            continue
        problem = ModelFacts.learn(source, scope, node.pk, values,
                                   max_weights_bytes=_most_weights_bytes(node, quantizations[source]))
        if problem:
            logger.warning("node %s: its report of %s (scope %r) was not all kept: %s", node.name, source[:200], scope, problem)


def _reservation_facts(info: protocol.ModelInfo) -> dict:
    """What one copy's reading says of `RESERVATION_FACTS`."""
    normalizer = info.tokenizer_normalizer
    return {"max_model_len": info.max_model_len,
            "tokenizer_normalizer": normalizer.to_dict() if normalizer is not None else None}


def _nothing_to_write(facts: ModelFacts, node_key: str, values: dict, standing: set[str]) -> bool:
    """Whether a node's report would change nothing kept (`ModelFacts.learn`): of a shared copy, as kept or as this
    node already disputes it; of a tenant's, as this node's claim already kept, the facts merged from the claims kept,
    and every other claim's node or replica still running the copy (`standing`: the claims this node's live replicas
    hold up, read with the heartbeat).

    NOTE: from an unchanged claim the merged facts change only when another claim stops standing (its replica
    stopped: the costlier revision gone, the facts fall to this one's), so that alone is looked up, one query, and
    only for claims of other nodes' replicas. Before, a claim another raised ran `learn` with every heartbeat (8
    queries a copy, a row locked), held at no cost by a SLEEPING replica of another revision; and a copy served from
    one node asked the database every beat whether its own replica (whose template count is a claim) still ran."""
    changed = {name: value for name, value in values.items() if getattr(facts, name) != value}
    if not facts.scope:
        return facts.disputed.get(node_key, {}) == changed
    claimed = {name: value for name, value in values.items() if name in RESERVATION_FACTS}
    own = facts.disputed.get(node_key, {})
    if any(name not in claimed for name in changed) or any(own.get(name) != value for name, value in claimed.items()):
        return False
    if any(name in TEMPLATE_COUNT_FACTS for name in own):  # NOTE: kept before counts were a replica's: `learn` drops it
        return False
    if any(getattr(facts, name) != value for name, value in merged_claims(facts.disputed).items()):
        return False
    others = set(facts.disputed) - standing
    return not others or others <= ModelFacts.running_claimants(facts.source, facts.scope)


def _most_weights_bytes(node: Node, quantizations: set[str]) -> int:
    """The largest checkpoint the node's GPUs (as registered: `Node.gpu_shape`) could hold at any of these quantizations."""
    num_gpus, gpu_memory_mb = node.gpu_shape()
    least_factor = min(weight_factor(quantization, node.gpu_type) for quantization in quantizations)
    return int(max(num_gpus, 1) * gpu_memory_mb * 1024 * 1024 / least_factor)


def _unscoped_copy(statuses: list[protocol.WeightsStatus] | None) -> list[protocol.WeightsStatus]:
    """An older agent's report of a source (no scope): believed only when it is the one copy it names."""
    return statuses if statuses is not None and len(statuses) == 1 else []


REPLICA_ACTIONS = {ReplicaState.DRAINING: ReplicaAction.DRAIN, ReplicaState.SLEEPING: ReplicaAction.SLEEP}


def replica_action(replica: Replica) -> ReplicaAction:
    """What the replica's agent is told to do with it. NOTE: a SLEEPING replica whose node's agent does not know SLEEP
    (older than sleep mode: `Node.knows_action`) is told to DRAIN, what an agent does with a sleep its engine cannot
    take: the SLEEP made such an agent refuse every heartbeat answer, so that it started, stopped and drained none of
    its replicas again, while its heartbeats kept the node READY."""
    action = REPLICA_ACTIONS.get(replica.state, ReplicaAction.RUN)
    if replica.node is not None and not replica.node.knows_action(action):
        return ReplicaAction.DRAIN
    return action


def desired_replicas(node: Node) -> list[protocol.ReplicaSpec]:
    """The specs of the node's live replicas. One whose spec cannot be built (its endpoint's row holds what the
    protocol refuses) fails, with the reason on its endpoint, which stops until its configuration changes: it failed
    the whole heartbeat, so the node went OFFLINE with every other tenant's replica on it, and the next node next."""
    if node.state == NodeState.OFFLINE:
        return []
    replicas = Replica.objects.filter(node=node, state__in=LIVE_REPLICA_STATES).select_related("endpoint", "endpoint__credential", "node")
    specs = []
    model_contexts = ModelFacts.context_lengths_of({(replica.endpoint.model_source, replica.endpoint.weights_scope)
                                                    for replica in replicas if replica.endpoint.max_model_len is None})
    for replica in replicas:
        try:
            specs.append(replica_spec(replica, model_contexts))
        except (ValueError, SecretUnreadable) as exc:
            logger.warning("replica %s of endpoint %s: its spec cannot be built: %s", replica.pk, replica.endpoint_id, exc)
            reason = f"its configuration cannot run: {exc}"
            fail_replica_and_count(replica, reason, permanent=True)
    return specs


def replica_spec(replica: Replica, model_contexts: dict[tuple[str, str], int] | None = None) -> protocol.ReplicaSpec:
    """`model_contexts`: the contexts of its endpoint's model copy read already (`Endpoint.known_context_length`)."""
    endpoint = replica.endpoint
    access = source_access(endpoint)  # NOTE: answered only to the replica's own node (desired_replicas)
    return protocol.ReplicaSpec(
        replica_id=str(replica.pk),
        endpoint_id=str(endpoint.pk),
        served_model_name=endpoint.name,
        model_source=endpoint.model_source,
        action=replica_action(replica),
        # NOTE: on the engine's command line from its start, so only an endpoint that may sleep pays for it
        # (the agent adds it to CUDA engines only).
        sleep_mode=endpoint.idle_action == IdleAction.SLEEP and settings.SLEEP_MODE,
        quantization=endpoint.quantization,
        max_model_len=endpoint.max_model_len,
        # NOTE: a catalogue copy's context is the first node's to describe it; a node reading more launched its engine
        # with its own, larger figure while the gateway reserved and billed by the kept one.
        billed_context_tokens=endpoint.known_context_length(model_contexts),
        max_num_seqs=endpoint.max_num_seqs,
        max_num_batched_tokens=endpoint.max_num_batched_tokens,
        enable_prefix_caching=endpoint.enable_prefix_caching,
        gpu_memory_utilization=memory_fraction(replica),
        num_gpus=len(replica.gpu_indices) or endpoint.gpus_per_replica,
        gpu_indices=list(replica.gpu_indices),
        drain_timeout_s=float(settings.REPLICA_DRAIN_TIMEOUT_S),
        engine_api_key=replica.engine_api_key,
        credentials=access.credentials,
        use_fleet_credentials=access.use_fleet_credentials,
        weights_scope=access.weights_scope,
        tool_call_parser=endpoint.tool_call_parser,
        reasoning_parser=default_reasoning_parser(endpoint.model_source),
        task=ModelTask(endpoint.task),
        speculative=speculative_spec(endpoint),

        max_loras=endpoint.max_loras,
        max_lora_rank=endpoint.max_lora_rank,
        adapters=adapter_specs(endpoint) if endpoint.max_loras else [],
    )


def memory_fraction(replica: Replica) -> float:
    """The share of each of its GPUs the engine may take.

    A replica sharing its GPU gets the fraction placement gave it (the fractions on one GPU sum to at
    most `WHOLE_GPU_MEMORY_FRACTION`); one with whole GPUs gets `WHOLE_GPU_MEMORY_FRACTION`. On a node
    without a GPU list (one pool), exactly what placement reserved for it.
    NOTE: vLLM fills whatever fraction it is given with KV cache, so handing it its
    reservation (not the usual 0.9) is what lets replicas share a GPU without over-commit.
    """
    if replica.gpu_memory_fraction is not None:
        return replica.gpu_memory_fraction
    if replica.gpu_indices:
        return WHOLE_GPU_MEMORY_FRACTION
    node = replica.node
    if node is None or node.gpu_memory_mb <= 0 or not replica.reserved_memory_mb:
        return WHOLE_GPU_MEMORY_FRACTION
    return round(min(0.95, max(0.05, replica.reserved_memory_mb / node.gpu_memory_mb)), 3)


class NodeStateRefused(Exception):
    """Staff's cordon, drain or uncordon has nothing to change on this node (the message says why)."""


def set_node_state(actor: Actor, node: Node, state: NodeState) -> Node:
    """Cordon (no new replicas), drain (move replicas away) or uncordon a node.

    NOTE: a silent node stays OFFLINE: staff's decision is what it comes back to when its agent beats again
    (`state_before_offline`, `record_heartbeat`). A retired node changes not at all, and a pool's machine being
    released is never uncordoned (`NodeStateRefused`). Before, either went READY at once ("select all, uncordon" in
    the admin) and won placement: the silent or retired one until the sweep found it silent again, the released one
    until its machine was terminated; each replica placed there failed toward its endpoint's back-off. Decided under
    the node's row lock, which a heartbeat bringing it back, the sweep taking it OFFLINE and a pool cordoning it for
    release (`pool_release.cordon_for_release`) take too.
    """
    with transaction.atomic():
        locked = Node.objects.select_for_update().get(pk=node.pk)
        if not locked.secret_digest:
            raise NodeStateRefused(f"node {locked.name} is retired: its secret is void and nothing runs on it again")
        if state == NodeState.READY and NodeLaunch.objects.filter(node=locked, state=LaunchState.RELEASING).exists():
            raise NodeStateRefused(f"node {locked.name} is a pool's machine being released: it takes no new replicas")
        offline = locked.state == NodeState.OFFLINE
        Node.objects.filter(pk=node.pk).update(**{"state_before_offline" if offline else "state": state})
        node.refresh_from_db()
        record_audit(actor, None, f"node.{state.value.lower()}", node, **({"while_offline": True} if offline else {}))
    notify_node(node.pk)
    if state == NodeState.DRAINING:
        drain_node(node, reason=f"node {node.name} draining")
    return node


@dataclass(slots=True, frozen=True)
class Retirement:
    """What `retire_node` did.

    `open_join_token`: the join token the node registered with, left usable because `num_other_nodes` other nodes
    (not retired) joined with it too. Until staff rotate it (`rotate_join_token`), whoever holds it can register a
    new node: the retired machine keeps it on its disk (its agent, told `protocol.NODE_RETIRED`, does not register
    again; one older than protocol 5, or the machine set up afresh, does).
    """

    retired: bool
    revoked_join_token: JoinToken | None = None
    open_join_token: JoinToken | None = None
    num_other_nodes: int = 0


def retire_node(actor: Actor, node: Node, *, reason: str) -> Retirement:
    """The node's machine is gone for good (a pool terminated it, or staff shut it out): OFFLINE, its secret no
    longer admits anyone, and its replicas, if any, fail and are replaced.

    NOTE: a void secret alone does not keep the machine out: it holds its join token too (an agent older than
    protocol 5, told its node is unknown, registers again with it). Its secret's hash is kept
    (`Node.retired_secret_digest`), so its agent is told `protocol.NODE_RETIRED` and stops its engines for good. So the join token goes too when no other node (not retired) joined with it; a token others
    share is left usable and named in the answer (`Retirement.open_join_token`), to be rotated. A pool's one-use
    token is spent already and stays as it is.
    """
    # NOTE: one transaction, the join token first (under its row lock) and the agent told only once it commits: a
    # secret voided and announced first woke the agent, which registered again with the token before it was revoked,
    # and counted as one of the "other nodes" that kept it open.
    with transaction.atomic():
        # NOTE: only a token that still admits a node by PostgreSQL's clock, as registration judges it.
        join_token = (JoinToken.objects.usable().select_for_update().filter(pk=node.join_token_id).first()
                      if node.join_token_id else None)
        outcome: dict = {}
        if join_token is not None:
            # NOTE: also for a node retired before (retiring it again closes the token it left open).
            num_other_nodes = Node.objects.admitted().filter(join_token=join_token).exclude(pk=node.pk).count()
            if num_other_nodes:
                outcome = {"open_join_token": join_token, "num_other_nodes": num_other_nodes}
            else:
                revoke_join_token(actor, join_token)
                outcome = {"revoked_join_token": join_token}
        # NOTE: an empty digest matches no secret (`tokens.token_matches` compares hashes).
        # NOTE: its secret's hash is kept (never the secret), so that its agent, presenting that very secret, is told
        # it is retired (`authenticate_node`); retired again, the hash kept before stays.
        retired = Node.objects.filter(pk=node.pk).exclude(state=NodeState.OFFLINE, secret_digest="").update(
            state=NodeState.OFFLINE, secret_digest="",
            retired_secret_digest=Coalesce(NullIf(F("secret_digest"), Value("")), F("retired_secret_digest")))
        if retired:
            node.refresh_from_db()
            record_audit(actor, None, "node.retire", node, reason=reason[:300])
            for replica in Replica.objects.filter(node=node, state__in=LIVE_REPLICA_STATES).select_related("endpoint"):
                fail_replica(replica, reason, moved=True)
            node_id = node.pk
            transaction.on_commit(lambda: notify_node(node_id), robust=True)
            # NOTE: its secret waits for a slot again, as a stranger's (its hash is the mark's: `known_credentials`);
            # at once, not at the commit: a mark gone too early only has a lookup wait for a slot
            NODE_SECRETS_KNOWN.discard(node.retired_secret_digest)
    return Retirement(retired=bool(retired), **outcome)
