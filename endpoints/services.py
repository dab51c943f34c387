"""Writes with side effects for endpoints: create, update, pause, resume, delete.

Their replicas change through `endpoints.replicas`; every write here is logged with `endpoints.events`.
"""

from __future__ import annotations

from django.db import transaction
from django.db.models import Q
from django.http import Http404
from django.utils import timezone
from rest_framework.exceptions import ValidationError

from controlplane.accounts.services import ORGANIZATION_CLOSED, Actor, record_audit
from controlplane.integrity import unique_or_field_error
from endpoints import quotas
from endpoints.adapters import clear_embedding_failures, keep_staff_prices
from endpoints.catalogue import GPU_TYPES
from endpoints.credentials import hold_credential
from endpoints.events import record_event
from endpoints.models import ENGINE_FIELDS, Adapter, Endpoint, EventKind, PromptFactor
from endpoints.replicas import drain_replicas, request_reconcile

ENDPOINT_NAME_TAKEN = "An endpoint with this name already exists in your organisation."
_NAME_CONSTRAINT = {"endpoint_name_unique_in_org": ("name", ENDPOINT_NAME_TAKEN)}


@transaction.atomic
def create_endpoint(actor: Actor, organization, **spec) -> Endpoint:
    """Raises `quotas.QuotaExceeded` when the organisation's plan refuses it (checked under its lock)."""
    locked = quotas.lock_organization(organization.pk)
    if locked.closed_at is not None:  # NOTE: a create racing the organisation's close (`endpoints.closing`)
        raise ValidationError({"non_field_errors": [ORGANIZATION_CLOSED]})
    quotas.check_spec(locked, spec)
    hold_credential(spec.get("credential"))
    for name, price in _prices_of(spec["gpu_type"]).items():
        spec.setdefault(name, price)
    with unique_or_field_error(_NAME_CONSTRAINT):  # NOTE: the name may have been taken since the serializer's check
        endpoint = Endpoint.objects.create(organization=organization, **spec)
    record_event(endpoint, EventKind.CONFIG, "Endpoint created", spec=_plain(spec))
    record_audit(actor, organization, "endpoint.create", endpoint)
    request_reconcile(endpoint.pk)
    return endpoint


def _prices_of(gpu_type: str) -> dict:
    """An endpoint's prices on `gpu_type`: the catalogue's for that type."""
    gpu = GPU_TYPES[gpu_type]
    return {"price_input_per_million": gpu.price_input_per_million,
            "price_cached_input_per_million": gpu.price_cached_input_per_million,
            "price_output_per_million": gpu.price_output_per_million}


@transaction.atomic
def wait_for_endpoint_row(endpoint_id) -> None:
    """Wait until no other transaction holds the endpoint's row, holding nothing else (an edit run again after a
    deadlock: `integrity.again_after_deadlocks`)."""
    Endpoint.objects.select_for_update(no_key=True).filter(pk=endpoint_id).values_list("pk", flat=True).first()


@transaction.atomic
def update_endpoint(actor: Actor, endpoint: Endpoint, **changes) -> Endpoint:
    # NOTE: the organisation's row first (its quotas are checked under it), then the endpoint's: never waited for
    # with the endpoint's row held, which a heartbeat reporting a replica failed or READY takes. Behind a key revocation
    # (12 s with 3,000 minted keys) that held the node's whole heartbeat past its agent's timeout
    # (`tests/test_replica_lock_order.py`). Its callers that lock the endpoint's row themselves (`api.EndpointViewSet`,
    # `views.endpoint_edit`) take the organisation's before it alike.
    organization = quotas.lock_organization(endpoint.organization_id)
    # NOTE: `FOR NO KEY UPDATE`, as every lock on an endpoint's row (`replicas.fail_replica_and_count`): a plain one
    # blocks the `FOR KEY SHARE` a heartbeat's restart event takes at its commit while it holds a replica's row, which
    # `drain_replicas` below then waits on (a deadlock, the edit its victim).
    endpoint = Endpoint.objects.select_for_update(no_key=True).get(pk=endpoint.pk)
    changed = {name: value for name, value in changes.items() if getattr(endpoint, name) != value}
    if not changed:
        return endpoint
    if "gpu_type" in changed:
        # NOTE: prices follow the hardware: another GPU type is that type's prices (staff may edit them again).
        changed |= {name: price for name, price in _prices_of(changed["gpu_type"]).items() if getattr(endpoint, name) != price}
    quotas.check_spec(organization, changed, endpoint)
    hold_credential(changed.get("credential"))
    for name, value in changed.items():
        setattr(endpoint, name, value)
    _clear_failures(endpoint)  # a new spec deserves a fresh try
    restarted = sorted(ENGINE_FIELDS & changed.keys())
    if restarted:
        endpoint.engine_generation += 1  # NOTE: under the row lock taken above
    with unique_or_field_error(_NAME_CONSTRAINT):
        endpoint.save()
    record_event(endpoint, EventKind.CONFIG, "Configuration changed: " + ", ".join(sorted(changed)), changes=_plain(changed))
    record_audit(actor, endpoint.organization, "endpoint.update", endpoint, changes=_plain(changed))
    if restarted:
        # NOTE: in the transaction that saves the change: no replica of the old configuration is READY once it
        # commits (calls in flight on them finish there, billed at the prices they were admitted at; new calls
        # wait for the new replicas as in a cold start). A gateway's cached READY list may still name a drained
        # replica for a moment: the generation keeps calls checked by the new configuration off it.
        drain_replicas(endpoint, reason=f"its engine started with the previous {', '.join(restarted)}; replaced")
        clear_embedding_failures(endpoint)
    request_reconcile(endpoint.pk)
    return endpoint


# What staff price in the admin: an endpoint's (its GPU type's by default) and an adapter's (the endpoint's by default).
ENDPOINT_PRICE_FIELDS = ("price_input_per_million", "price_cached_input_per_million", "price_output_per_million",
                         "batch_price_fraction")


@transaction.atomic
def set_prices(actor: Actor, priced: Endpoint | Adapter, **prices) -> dict[str, dict[str, str | None]]:
    """Staff's prices for an endpoint or an adapter (`ENDPOINT_PRICE_FIELDS`, `adapters.ADAPTER_PRICE_FIELDS`; an adapter's
    None: its endpoint's): saved, audited (`endpoint.prices`, `adapter.prices`) and written on the endpoint's log for
    its owner to read. Returns what changed, `{field: {"from", "to"}}`; nothing is recorded when nothing did.

    NOTE: the admin saved them as a plain form: a customer's prices changed with no audit event and nothing on the
    endpoint's log. The gateway reads them anew within `directory.ENDPOINT_CACHE_S`."""
    model = type(priced)
    row = model.objects.select_for_update(no_key=True).get(pk=priced.pk)
    changes = {}
    for name, value in prices.items():
        places = model._meta.get_field(name).decimal_places
        before, after = (None if v is None else format(v, f".{places}f") for v in (getattr(row, name), value))
        if before != after:
            changes[name] = {"from": before, "to": after}
            setattr(row, name, value)
    if not changes:
        return changes
    row.save(update_fields=list(changes))
    if isinstance(row, Adapter):
        keep_staff_prices(row)  # kept under its name: its row goes with a delete, the contract does not
    endpoint = row if isinstance(row, Endpoint) else row.endpoint
    what = "" if isinstance(row, Endpoint) else f" of adapter {row.name}"
    record_audit(actor, endpoint.organization, f"{'endpoint' if what == '' else 'adapter'}.prices", row, changes=changes)
    shown = ", ".join(f"{name} {change['from'] or 'the endpoint’s'} → {change['to'] or 'the endpoint’s'}"
                      for name, change in changes.items())
    record_event(endpoint, EventKind.CONFIG, f"Prices changed{what} by the platform: {shown}"[:300], changes=changes)
    return changes


@transaction.atomic
def reset_prompt_factor(actor: Actor, endpoint: Endpoint) -> int:
    """Staff clear what the endpoint's prompt bounds learned to be multiplied by (`PromptFactor`, every copy of its
    model): audited (`endpoint.prompt_factor_reset`, with the factors it had). Returns how many were cleared. The
    gateway reserves as estimated again within `directory.ENDPOINT_CACHE_S`, until a prompt runs past its bound again."""
    factors = {f"{row.model_source} ({row.weights_scope or 'shared'})": str(row.factor)
               for row in PromptFactor.objects.filter(endpoint=endpoint)}
    if not factors:
        return 0
    PromptFactor.objects.filter(endpoint=endpoint).delete()
    record_audit(actor, endpoint.organization, "endpoint.prompt_factor_reset", endpoint, factors=factors)
    return len(factors)


@transaction.atomic
def pause_endpoint(actor: Actor, endpoint: Endpoint) -> Endpoint:
    """Raises Http404 when the endpoint was deleted since the caller looked it up (`live_endpoint_locked`)."""
    endpoint = live_endpoint_locked(endpoint.pk)
    if Endpoint.objects.filter(pk=endpoint.pk, paused_at__isnull=True).update(paused_at=timezone.now()):
        drain_replicas(endpoint, reason="endpoint paused")
        record_event(endpoint, EventKind.CONFIG, "Endpoint paused: replicas drain, calls get 503 until resumed")
        record_audit(actor, endpoint.organization, "endpoint.pause", endpoint)
    endpoint.refresh_from_db()
    return endpoint


@transaction.atomic
def resume_endpoint(actor: Actor, endpoint: Endpoint) -> Endpoint:
    """Resume a paused or failed endpoint, or retry one backing off after failures (console: Retry), from a fresh count.
    Raises Http404 when the endpoint was deleted since the caller looked it up (`live_endpoint_locked`)."""
    endpoint = live_endpoint_locked(endpoint.pk)
    retried = endpoint.paused_at is None and endpoint.failed_at is None
    if Endpoint.objects.filter(pk=endpoint.pk).filter(
        Q(paused_at__isnull=False) | Q(failed_at__isnull=False) | Q(next_attempt_at__isnull=False),
    ).update(paused_at=None, **FRESH_START):
        record_event(endpoint, EventKind.CONFIG, "Endpoint retried: its backoff cleared" if retried else "Endpoint resumed")
        record_audit(actor, endpoint.organization, "endpoint.resume", endpoint)
        request_reconcile(endpoint.pk)
    endpoint.refresh_from_db()
    return endpoint


def live_endpoint_locked(endpoint_id) -> Endpoint:
    """The endpoint's row, locked (`FOR NO KEY UPDATE`, as every lock on it) and read again; Http404 (a 404 on `/api/`
    and in the console, as for an unknown id) when it was deleted since the caller looked it up.

    NOTE: a pause or resume that lost the race to a delete (a member's click while the owner closes the organisation:
    `endpoints.closing`) wrote on the deleted row (a resume asked the scheduler to reconcile it, its log and the audit
    log said "resumed"), then the API's answer found no live endpoint: a 500."""
    endpoint = Endpoint.objects.live().select_for_update(no_key=True).filter(pk=endpoint_id).first()
    if endpoint is None:
        raise Http404("No such endpoint.")
    return endpoint


@transaction.atomic
def delete_endpoint(actor: Actor, endpoint: Endpoint) -> None:
    """Soft delete: the name is free again, replicas drain, usage and invoices keep their endpoint."""
    if Endpoint.objects.filter(pk=endpoint.pk, deleted_at__isnull=True).update(deleted_at=timezone.now()):
        drain_replicas(endpoint, reason="endpoint deleted")
        record_event(endpoint, EventKind.CONFIG, "Endpoint deleted")
        record_audit(actor, endpoint.organization, "endpoint.delete", endpoint)


# What a spec change or a resume resets: failures counted, backoff, giving up.
FRESH_START = {
    "num_identical_failures": 0, "num_failures_since_ready": 0, "num_scale_up_failures": 0, "last_failure_reason": "",
    "next_attempt_at": None, "failed_at": None,
    "status_message": "", "waiting_for_capacity": False, "unplaced_replicas": 0,
}


def _clear_failures(endpoint: Endpoint) -> None:
    for name, value in FRESH_START.items():
        setattr(endpoint, name, value)


def _plain(values: dict) -> dict:
    return {key: (str(value) if not isinstance(value, (int, float, bool, str, type(None))) else value) for key, value in values.items()}
