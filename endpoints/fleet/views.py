"""Fleet console (staff only): nodes, cordon/drain, node pools (`pool_views`), join tokens, every replica, the audit log."""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.contrib import messages
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from controlplane.accounts.console import staff_required
from controlplane.accounts.models import AuditEvent, Organization
from controlplane.accounts.services import Actor
from controlplane.plain_numbers import plain_int
from endpoints.fleet import services
from endpoints.fleet.pool_views import pools_context
from endpoints.models import ACTIVE_REPLICA_STATES, Replica, organization_of_scope
from endpoints.nodes.models import JoinToken, Node
from gpu_agent.protocol import NodeState

NUM_AUDIT_EVENTS_SHOWN = 50
NODE_ACTIONS = {
    "cordon": (NodeState.CORDONED, "cordoned: it keeps its replicas and gets no new ones"),
    "uncordon": (NodeState.READY, "ready for new replicas again"),
    "drain": (NodeState.DRAINING, "draining: its replicas move to other nodes"),
}


def _fleet_context() -> dict:
    nodes = list(Node.objects.all())
    active = Replica.objects.filter(state__in=ACTIVE_REPLICA_STATES).select_related("endpoint__organization", "node")
    replicas_by_node: dict = {}
    for replica in active:
        replicas_by_node.setdefault(replica.node_id, []).append(replica)
    now = timezone.now()
    for node in nodes:
        node.active_replicas = replicas_by_node.get(node.pk, [])
        status = node.last_status or {}
        node.gpu_rows = gpu_rows(node, status.get("gpus") or [], node.active_replicas)
        node.weights = status.get("weights") or []
        node.cpu_percent = status.get("cpu_percent")
        node.memory_used_mb = status.get("memory_used_mb")
        node.gpus_ignored = status.get(services.GPUS_IGNORED, "")
        node.heartbeat_age_s = (now - node.last_heartbeat_at).total_seconds() if node.last_heartbeat_at else None
        node.heartbeat_late = node.heartbeat_age_s is None or node.heartbeat_age_s > 3 * settings.AGENT_HEARTBEAT_INTERVAL_S
    name_weights_owners(nodes)
    return {
        "nodes": nodes,
        "replicas": Replica.objects.select_related("endpoint__organization", "node").order_by("-state_changed_at")[:100],
        "num_active_replicas": len(active),
    }


def name_weights_owners(nodes: list[Node]) -> None:
    """Give each node's cached copy (`node.weights`, from its heartbeat) the `owner` staff read on its chip: the
    organisation whose private copy it is, or "shared" for the catalogue's one copy (scope "").

    NOTE: two organisations' copies of one source were two identical chips, as if the node listed one twice. Staff
    only: a tenant never sees the fleet page. One query for every node's copies."""
    scopes = {copy.get("scope") for node in nodes for copy in node.weights if isinstance(copy, dict)}
    ids = {organization_of_scope(scope) for scope in scopes if isinstance(scope, str)} - {None}
    names = dict(Organization.objects.filter(pk__in=ids).values_list("pk", "name")) if ids else {}
    for node in nodes:
        node.weights = [dict(copy, owner=_owner(copy.get("scope"), names)) for copy in node.weights if isinstance(copy, dict)]


def _owner(scope, names: dict) -> str:
    if scope in (None, ""):
        return "shared"  # NOTE: an agent older than scopes reported none: its copies were the shared ones
    organization_id = organization_of_scope(scope) if isinstance(scope, str) else None
    if organization_id is None:
        return "unknown scope"
    return names.get(organization_id) or f"organisation {organization_id} (gone)"


def gpu_rows(node: Node, reported: list[dict], replicas: list[Replica]) -> list[dict]:
    """One row per GPU of the node: its latest load, MIG slices, and the replicas placement gave it."""
    rows = {gpu["index"]: dict(gpu, memory_total_mb=gpu["memory_mb"], holders=[]) for gpu in node.gpus}
    for gpu in reported:  # the heartbeat's load (and every GPU of an agent that reported no inventory)
        rows.setdefault(gpu.get("index"), {"holders": []}).update(gpu)
    for replica in replicas:
        for index in replica.gpu_indices:
            rows.setdefault(index, {"index": index, "holders": []})["holders"].append(replica)
    return [rows[index] for index in sorted(rows, key=lambda index: (index is None, index or 0))]


@staff_required
def fleet(request):
    return _fleet_page(request)


def _fleet_page(request, status=200):
    return render(request, "gpu_agent/fleet.html", _fleet_context() | pools_context() | {
        "join_tokens": JoinToken.objects.with_num_nodes().select_related("created_by")[:50],
        "audit_events": AuditEvent.objects.select_related("actor", "organization", "api_key")[:NUM_AUDIT_EVENTS_SHOWN],
        "public_url": settings.PUBLIC_URL,
    }, status=status)


@staff_required
def fleet_live(request):
    """Nodes and replicas alone, polled by htmx."""
    return render(request, "gpu_agent/_fleet_live.html", _fleet_context())


@staff_required
@require_POST
def node_state(request, pk):
    node = get_object_or_404(Node, pk=pk)
    action = NODE_ACTIONS.get(request.POST.get("action", ""))
    if action is None:
        messages.error(request, "Unknown node action.")
        return redirect("console:fleet")
    state, description = action
    offline = node.state == NodeState.OFFLINE
    try:
        services.set_node_state(Actor.from_request(request), node, state)
    except services.NodeStateRefused as refused:
        messages.error(request, f"Nothing changed: {refused}.")
        return redirect("console:fleet")
    if offline:
        messages.success(request, f"Node {node.name} is offline; when its agent beats again it is {description}.")
    else:
        messages.success(request, f"Node {node.name} is {description}.")
    return redirect("console:fleet")


EXPIRY_HOURS = {"1": 1, "24": 24, "168": 168, "never": None}
# NOTE: a console-made token admits one node within a day unless staff choose otherwise ("never", an empty
# "max_uses"): any holder of a token may register nodes, so a token shared by a rack is a choice, not a default.
DEFAULT_EXPIRY_HOURS = "24"
DEFAULT_MAX_USES = 1


@staff_required
@require_POST
def join_token_create(request):
    name = request.POST.get("name", "").strip()[:100] or "join token"
    if "\x00" in name:  # NOTE: PostgreSQL refuses NUL in text: the insert was a 500 (a form decodes no lone surrogate)
        messages.error(request, "A join token's name cannot contain NUL characters.")
        return _fleet_page(request, status=400)
    hours = EXPIRY_HOURS.get(request.POST.get("expires_in_hours", DEFAULT_EXPIRY_HOURS), EXPIRY_HOURS[DEFAULT_EXPIRY_HOURS])
    uses = request.POST.get("max_uses", str(DEFAULT_MAX_USES)).strip()
    max_uses = None if uses == "" else plain_int(uses) or DEFAULT_MAX_USES
    created = services.create_join_token(
        Actor.from_request(request), name=name,
        # NOTE: hours from this pod's clock (judged by PostgreSQL's, `JoinToken.is_usable`): a skew of seconds on hours,
        # as any web process's skew past 2 s is an ERROR and on `/metrics` (`controlplane.clock.record_offset`)
        expires_at=timezone.now() + timedelta(hours=hours) if hours else None,
        max_uses=max_uses,
    )
    # NOTE: the token is rendered in this response only; only its hash is stored.
    return render(request, "gpu_agent/join_token_created.html", {
        "join_token": created.join_token, "secret": created.plain, "public_url": settings.PUBLIC_URL,
    }, status=201)


@staff_required
@require_POST
def join_token_revoke(request, pk):
    join_token = get_object_or_404(JoinToken, pk=pk)
    services.revoke_join_token(Actor.from_request(request), join_token)
    messages.success(request, f"Join token “{join_token.name}” was revoked; nodes already joined keep running.")
    return redirect("console:fleet")


@staff_required
@require_POST
def join_token_rotate(request, pk):
    join_token = get_object_or_404(JoinToken.objects.with_num_nodes(), pk=pk)
    if not JoinToken.objects.usable().filter(pk=join_token.pk).exists():
        messages.error(request, f"Join token “{join_token.name}” admits nobody already: there is nothing to rotate.")
        return redirect("console:fleet")
    created = services.rotate_join_token(Actor.from_request(request), join_token)
    # NOTE: the token is rendered in this response only; only its hash is stored.
    return render(request, "gpu_agent/join_token_created.html", {
        "join_token": created.join_token, "secret": created.plain, "public_url": settings.PUBLIC_URL,
        "replaced": join_token,
    }, status=201)
