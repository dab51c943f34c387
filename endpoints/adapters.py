"""Writes with side effects for LoRA adapters: create, delete, want (a call named one), and what
agents report about them (loaded, refused).

An adapter is served by its endpoint's replicas, not by a replica of its own: the engine starts
with LoRA enabled (`Endpoint.max_loras` slots, `max_lora_rank`), and the agent loads the adapters
callers want into the running engine, unloading the least recently wanted when its slots are full
(`gpu_agent.runtime.adapters`). The gateway marks an adapter wanted (`want_adapter`) when a call
names one no READY replica holds, and holds the call like a cold start until one reports it.
"""

from __future__ import annotations

from django.db import transaction
from django.db.models import Exists, F
from django.http import Http404
from django.utils import timezone
from rest_framework.exceptions import NotFound, ValidationError

from controlplane.accounts.services import Actor, record_audit
from controlplane.clock import DatabaseClock, database_time_ago
from controlplane.integrity import unique_or_field_error
from controlplane.secrets import SecretUnreadable
from endpoints.credentials import hold_credential, source_credentials
from endpoints.events import record_event
from endpoints.models import (
    Adapter,
    AdapterPrice,
    AdapterState,
    Endpoint,
    EventKind,
    Replica,
    organization_scope,
    same_source,
)
from endpoints.nodes.models import Node
from endpoints.nodes.notify import notify_endpoint_ready, notify_node
from gpu_agent.protocol import (
    FINAL_REPLICA_STATES,
    MAX_ADAPTERS_PER_REPLICA,
    AdapterSpec,
    ModelTask,
    ReplicaState,
    ReplicaStatus,
)

# An endpoint's adapters: every one is in each of its replicas' specs, on every heartbeat of their nodes (its
# credentials decrypted for it). NOTE: there was no limit: thousands of adapters made each heartbeat's answer
# megabytes, past the agent's request timeout, and the node went OFFLINE with every tenant's replica on it.
MAX_ADAPTERS = MAX_ADAPTERS_PER_REPLICA  # the protocol's: an agent reports at most as many per replica
MAX_REPORTED_ADAPTERS = MAX_ADAPTERS
TOO_MANY_ADAPTERS = f"An endpoint serves at most {MAX_ADAPTERS} adapters; delete one first."

# A call model names an adapter as "<endpoint>:<adapter>".
ADAPTER_SEPARATOR = ":"


def split_model_name(model: str) -> tuple[str, str]:
    """("endpoint", "adapter") from "endpoint:adapter"; ("endpoint", "") from a plain endpoint name."""
    endpoint, _, adapter = model.partition(ADAPTER_SEPARATOR)
    return endpoint, adapter


def parse_model_name(model: str) -> tuple[str, str] | None:
    """What a call's `model` names, as `split_model_name`; None for `"<endpoint>:"`, which names no adapter, so no
    model (the gateway's `adapter_hold.resolve` and a batch's line checks alike)."""
    endpoint, adapter = split_model_name(model)
    if not adapter and model.endswith(ADAPTER_SEPARATOR):
        return None
    return endpoint, adapter


# NOTE: an "auto" endpoint takes adapters while its model is unread; an embedding model's engine runs without LoRA
# (`gpu_agent.runtime.engine`), so no load can work: each one the agent asked for failed as the engine's "Not Found".
EMBEDDING_SERVES_NO_ADAPTERS = "its endpoint's model is an embedding model, whose engine serves no LoRA adapters"

ADAPTER_NAME_TAKEN = "This endpoint already has an adapter with this name."
# NOTE: the endpoint's name is its engines' served model name (`--served-model-name`), which vLLM refuses as an
# adapter's ("conflicts with a served base model"): an adapter so named could never load.
ADAPTER_NAMED_AS_ENDPOINT = "An adapter cannot bear its endpoint's name: the endpoint's engines serve the base model under it."
ENDPOINT_NAMED_AS_ADAPTER = "This endpoint has an adapter with this name: its engines could not load the adapter."


@transaction.atomic
def create_adapter(actor: Actor, endpoint: Endpoint, **spec) -> Adapter:
    # NOTE: the count and the name, checked again under the endpoint's lock: both may have changed since the serializer;
    # and the endpoint itself, deleted meanwhile (before, the adapter was added to it once the deletion committed: a 201)
    if Endpoint.objects.live().select_for_update(no_key=True).filter(pk=endpoint.pk).first() is None:
        raise NotFound("No such endpoint.")
    if Adapter.objects.filter(endpoint=endpoint).count() >= MAX_ADAPTERS:
        raise ValidationError({"endpoint": [TOO_MANY_ADAPTERS]})
    hold_credential(spec.get("credential"))
    kept = staff_prices(endpoint, spec["name"], spec["source"])
    if kept is not None:
        spec = {**spec, **kept}
    with unique_or_field_error({"adapter_name_unique_in_endpoint": ("name", ADAPTER_NAME_TAKEN)}):
        adapter = Adapter.objects.create(endpoint=endpoint, **spec)
    record_event(endpoint, EventKind.CONFIG, f"Adapter {adapter.name} added" + (
        " at the prices the platform set for it" if kept is not None else ""))
    record_audit(actor, endpoint.organization, "adapter.create", adapter)
    return adapter


ADAPTER_PRICE_FIELDS = ("price_input_per_million", "price_output_per_million")


def keep_staff_prices(adapter: Adapter) -> None:
    """Keep the prices staff set on `adapter` (`services.set_prices`) under its endpoint and name, beyond its row."""
    AdapterPrice.objects.update_or_create(endpoint_id=adapter.endpoint_id, name=adapter.name, defaults={
        "source": adapter.source, "updated_at": timezone.now(),
        **{field: getattr(adapter, field) for field in ADAPTER_PRICE_FIELDS}})


def staff_prices(endpoint: Endpoint, name: str, source: str) -> dict | None:
    """The prices staff set on an adapter of `endpoint` named `name`, or else on the last priced with the same `source`,
    that an adapter created now starts at; None if staff priced neither.

    NOTE: a staff price on an adapter name is the contract: deleting the adapter and creating it again keeps it (it
    was the endpoint's prices after, 40 times less for one priced 40/80 on an endpoint at 1/2), and so does the same
    source under another name, however spelled (`models.same_source`: before, a trailing slash on the S3 prefix lost
    them). A new name with a new source starts at the endpoint's prices until staff price it."""
    kept = AdapterPrice.objects.filter(endpoint=endpoint, name=name).first() or _priced_with_source(endpoint, source)
    if kept is None or all(getattr(kept, field) is None for field in ADAPTER_PRICE_FIELDS):
        return None
    return {field: getattr(kept, field) for field in ADAPTER_PRICE_FIELDS}


def _priced_with_source(endpoint: Endpoint, source: str) -> AdapterPrice | None:
    """The last priced of `endpoint`'s adapters with `source`, spelled as it may have been (`same_source`)."""
    wanted = same_source(source)
    if not wanted:
        return None
    # NOTE: every spelling of `wanted` starts with its repo id or prefix, in some case: only those rows are read
    candidates = AdapterPrice.objects.filter(endpoint=endpoint, source__istartswith=wanted.partition("@")[0])
    return next((price for price in candidates.order_by("-updated_at") if same_source(price.source) == wanted), None)


@transaction.atomic
def delete_adapter(actor: Actor, adapter: Adapter) -> None:
    """Replicas unload it at their next sync (it is gone from their spec). Http404 where it was deleted since the
    caller read it.

    NOTE: two deletes at once (two members, or one's and the organisation's close: `closing`) both found it; the
    second logged "Adapter removed" and audited its delete again, deleting no row (a 204)."""
    adapter = Adapter.objects.select_for_update().select_related("endpoint__organization").filter(pk=adapter.pk).first()
    if adapter is None:
        raise Http404("No such adapter.")
    endpoint = adapter.endpoint
    record_event(endpoint, EventKind.CONFIG, f"Adapter {adapter.name} removed")
    record_audit(actor, endpoint.organization, "adapter.delete", adapter)
    adapter.delete()
    _wake_nodes(endpoint.pk)


def want_adapter(adapter_id) -> None:
    """A call named this adapter and no READY replica holds it: ask the agents to load it.

    NOTE: a conditional update, so a burst of calls writes once per second at most. The nodes of the
    endpoint's replicas are woken (their long poll answers), so their agents load it at once.
    """
    # NOTE: by PostgreSQL's clock: stamped by each gateway's own, one 10 minutes ahead put an adapter it wanted once
    # before the one every call now names (the latest wanted are the ones replicas hold) for 10 minutes
    changed = Adapter.objects.filter(pk=adapter_id).exclude(
        last_requested_at__gt=database_time_ago(1)
    ).update(last_requested_at=DatabaseClock())
    if changed:
        _wake_nodes(Adapter.objects.filter(pk=adapter_id).values_list("endpoint_id", flat=True).first())


def _wake_nodes(endpoint_id) -> None:
    nodes = Replica.objects.filter(endpoint_id=endpoint_id, state=ReplicaState.READY, node__isnull=False)
    for node_id in set(nodes.values_list("node_id", flat=True)):
        notify_node(node_id)


def adapter_specs(endpoint: Endpoint) -> list[AdapterSpec]:
    """The endpoint's adapters as its replicas' specs carry them (with the credentials they are read with): at most
    `MAX_ADAPTERS`, the most recently wanted first (an endpoint may hold more, stored before the cap). One whose
    credential cannot be used (incomplete, or encrypted with a key since dropped) fails alone, with the reason, and
    is left out: it raised out of the node's heartbeat, a 500 for every tenant's replica on the node."""
    if endpoint.serving_task == ModelTask.EMBED:
        _fail_all(endpoint, EMBEDDING_SERVES_NO_ADAPTERS)
        return []
    specs = []
    adapters = (endpoint.adapters.select_related("credential")
                .order_by(F("last_requested_at").desc(nulls_last=True), "name")[:MAX_ADAPTERS])
    for adapter in adapters:
        try:
            credentials = source_credentials(adapter.credential) if adapter.credential_id else None
        except (ValueError, SecretUnreadable) as exc:
            _fail(adapter, f"its credential cannot be used: {exc}")
            continue
        specs.append(AdapterSpec(
            name=adapter.name, source=adapter.source, credentials=credentials,
            weights_scope=organization_scope(endpoint.organization_id),
            wanted_at=adapter.last_requested_at.timestamp() if adapter.last_requested_at else 0.0,
        ))
    return specs


def _fail(adapter: Adapter, reason: str) -> None:
    reason = reason[:300]
    if Adapter.objects.filter(pk=adapter.pk).exclude(state=AdapterState.FAILED, status_message=reason,
                                                     failure_retried=False).update(
            state=AdapterState.FAILED, status_message=reason, failure_retried=False):
        record_event(adapter.endpoint, EventKind.FAILURE, f"Adapter {adapter.name} failed: {reason}")


def _fail_all(endpoint: Endpoint, reason: str) -> None:
    """Every adapter of `endpoint` FAILED with `reason` (one event, and nothing written once they are)."""
    if endpoint.adapters.exclude(state=AdapterState.FAILED, status_message=reason, failure_retried=False).update(
            state=AdapterState.FAILED, status_message=reason, failure_retried=False):
        record_event(endpoint, EventKind.FAILURE, f"Adapters failed: {reason}")


def clear_embedding_failures(endpoint: Endpoint) -> None:
    """After an edit of `endpoint` that restarts its engines (another model, task or credential): its adapters failed
    only because its model embedded are PENDING again unless it still does.

    NOTE: failed for good (not retried), the gateway answered every call naming them 400 `adapter_failed` before
    marking them wanted, and the agent loads only wanted ones: a model replaced by a generating one left them refused
    for good, with a reason no longer true."""
    if endpoint.serving_task != ModelTask.EMBED:
        endpoint.adapters.filter(state=AdapterState.FAILED, status_message=EMBEDDING_SERVES_NO_ADAPTERS).update(
            state=AdapterState.PENDING, status_message="", failure_retried=False)


def record_replica_adapters(node, report: ReplicaStatus, *, heartbeat: tuple[str, int] | None = None) -> None:
    """What an agent reported of one of its replicas' adapters: the replica's `adapters` (what the
    gateway routes on), adapters it loaded READY, failed ones FAILED with the reason, `failure_retried` where the agent
    tries them again (`adapter_failures_retried`: held for, not refused; an older agent's stand). Nothing of a replica
    stopped or failed already (as `replicas.apply_replica_report`), nor of a numbered `heartbeat` (boot id, sequence)
    no longer the node's last taken.

    NOTE: the replica's list is checked and written under its row lock, as `apply_replica_report` takes its state: a
    newer heartbeat taken since skips it, and one taken later waits on the lock and writes after it. Each adapter's
    state (rows every replica of the endpoint writes) is conditioned on it in its own statement
    (`NodeQuerySet.last_heartbeat_is`), never holding a lock past it. Before, of two heartbeats in flight at once the
    older's adapters landed after the newer's (`tests/fleet/test_heartbeat_order.py`)."""
    loaded = [name for name in report.adapters if isinstance(name, str)][:MAX_REPORTED_ADAPTERS]
    failures = {str(name): str(reason) for name, reason in list(report.adapter_failures.items())[:MAX_REPORTED_ADAPTERS]}
    retried = set(report.adapter_failures_retried)
    with transaction.atomic():
        replica = (Replica.objects.select_for_update().filter(pk=report.replica_id, node=node)
                   .exclude(state__in=FINAL_REPLICA_STATES).only("pk", "endpoint_id", "adapters").first())
        if replica is None or (heartbeat is not None
                               and not Node.objects.last_heartbeat_is(node.pk, heartbeat).exists()):
            return
        if replica.adapters != loaded:
            Replica.objects.filter(pk=replica.pk).update(adapters=loaded)
            if set(loaded) - set(replica.adapters):
                # NOTE: calls held for an adapter wait on the endpoint's READY channel (`gateway.adapter_hold`)
                notify_endpoint_ready(replica.endpoint_id)

    def while_last(rows):
        return rows if heartbeat is None else rows.filter(Exists(Node.objects.last_heartbeat_is(node.pk, heartbeat)))

    endpoint_id = replica.endpoint_id
    if loaded:
        while_last(Adapter.objects.filter(endpoint_id=endpoint_id, name__in=loaded).exclude(
            state=AdapterState.READY)).update(state=AdapterState.READY, status_message="", failure_retried=False)
    num_refused = 0
    for name, reason in failures.items():
        # NOTE: before, a failure the agent tries again (a Hub 5xx, a disk full) was kept as a refusal: every call
        # naming the adapter a 400 `adapter_failed` meanwhile, and its batch lines failed for good
        num_changed = while_last(Adapter.objects.filter(endpoint_id=endpoint_id, name=name).exclude(
            state=AdapterState.FAILED, status_message=reason[:300], failure_retried=name in retried
        )).update(state=AdapterState.FAILED, status_message=reason[:300], failure_retried=name in retried)
        num_refused += num_changed if name not in retried else 0
    if num_refused:
        notify_endpoint_ready(endpoint_id)  # the calls held for them are refused now (`gateway.adapter_hold`)


def adapters_with_holders(endpoint: Endpoint) -> list[Adapter]:
    """The endpoint's adapters, each with `num_holders`: its READY replicas holding it now (the console)."""
    holders: dict[str, int] = {}
    for names in endpoint.replicas.filter(state=ReplicaState.READY).values_list("adapters", flat=True):
        for name in names:
            holders[name] = holders.get(name, 0) + 1
    adapters = list(endpoint.adapters.all())
    for adapter in adapters:
        adapter.num_holders = holders.get(adapter.name, 0)
    return adapters
