"""Staff writes of node pools: create, update, delete, each audited; the one place their rules live.

The API (`endpoints.fleet.pool_api`), the console (`endpoints.fleet.pool_views`) and the Django
admin all call these, and show `PoolInvalid.errors` next to the fields they name (a provider's
template errors as `template.<field>`). The pool policy (`endpoints.fleet.pools`) only reads pools.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from django.db import IntegrityError, transaction
from django.http import Http404
from django.utils import timezone

from controlplane.accounts.services import Actor, record_audit
from endpoints.catalogue import GPU_TYPES
from endpoints.fleet.providers import get_provider
from endpoints.nodes.models import LIVE_LAUNCH_STATES, NodeLaunch, NodePool, PoolProvider

# What staff set; everything else of a pool is the system's.
POOL_FIELDS = ("name", "gpu_type", "provider", "template", "gpus_per_node", "gpu_memory_mb", "min_nodes",
               "max_nodes", "warm_nodes", "idle_timeout_s", "join_deadline_s", "hourly_price")
# Bounds that keep a typo from reaching a provider (or overflowing a column).
MAX_GPUS_PER_NODE = 64
MAX_NODES = 10_000
MAX_DURATION_S = 30 * 24 * 3600
MAX_GPU_MEMORY_MB = 10_000_000
MAX_HOURLY_PRICE = Decimal("100000")
# NOTE: a DNS label: the name goes into machine names, tags and Kubernetes labels.
POOL_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")


class PoolInvalid(Exception):
    """Field errors of a pool: `{field: [message, …]}`, template fields as `template.<field>`."""

    def __init__(self, errors: dict[str, list[str]]):
        super().__init__("; ".join(f"{name}: {' '.join(messages)}" for name, messages in errors.items()))
        self.errors = errors


class PoolInUse(Exception):
    """The pool still has machines; they must be released before it goes."""


def _int_errors(values: dict, errors: dict, name: str, low: int, high: int) -> None:
    value = values.get(name)
    if isinstance(value, bool) or not isinstance(value, int):
        errors.setdefault(name, []).append("A whole number is required.")
    elif not low <= value <= high:
        errors.setdefault(name, []).append(f"Must be between {low} and {high}.")


def pool_errors(values: dict, pool: NodePool | None = None) -> dict[str, list[str]]:
    """Every rule a pool must keep, over its complete values ({} when valid)."""
    errors: dict[str, list[str]] = {}
    name = values.get("name")
    if not isinstance(name, str) or not name:
        errors["name"] = ["A name is required."]
    elif not POOL_NAME.fullmatch(name):
        errors["name"] = ["Lowercase letters, digits and hyphens, at most 63, starting and ending with a letter or digit."]
    elif NodePool.objects.filter(name=name).exclude(pk=getattr(pool, "pk", None)).exists():
        errors["name"] = [f"A pool named {name!r} exists."]
    if values.get("gpu_type") not in GPU_TYPES:
        errors["gpu_type"] = [f"Choose one of: {', '.join(GPU_TYPES)}."]
    if values.get("provider") not in PoolProvider.values:
        errors["provider"] = [f"Choose one of: {', '.join(PoolProvider.values)}."]
    for field, low, high in (("gpus_per_node", 0, MAX_GPUS_PER_NODE), ("gpu_memory_mb", 1, MAX_GPU_MEMORY_MB),
                             ("min_nodes", 0, MAX_NODES), ("max_nodes", 0, MAX_NODES), ("warm_nodes", 0, MAX_NODES),
                             ("idle_timeout_s", 1, MAX_DURATION_S), ("join_deadline_s", 1, MAX_DURATION_S)):
        _int_errors(values, errors, field, low, high)
    if values.get("gpus_per_node") == 0 and values.get("gpu_type") in GPU_TYPES and values["gpu_type"] != "cpu":
        errors.setdefault("gpus_per_node", []).append("Only a CPU pool has machines without GPUs.")
    if not errors.keys() & {"min_nodes", "max_nodes", "warm_nodes"}:
        if values["min_nodes"] > values["max_nodes"]:
            errors["min_nodes"] = ["Must be at most max_nodes."]
        elif values["min_nodes"] + values["warm_nodes"] > values["max_nodes"]:
            errors["warm_nodes"] = ["min_nodes + warm_nodes must be at most max_nodes."]
    try:
        price = Decimal(values.get("hourly_price"))
        if not price.is_finite() or not Decimal(0) <= price <= MAX_HOURLY_PRICE:
            errors["hourly_price"] = [f"Must be between 0 and {MAX_HOURLY_PRICE}."]
    except (TypeError, ValueError, InvalidOperation):
        errors["hourly_price"] = ["A number is required."]
    template = values.get("template")
    if not isinstance(template, dict):
        errors["template"] = ["A JSON object is required."]
    elif "provider" not in errors:
        for field, messages in get_provider(values["provider"]).template_errors(template).items():
            errors.setdefault(field, []).extend(messages)
    if pool is not None and values.get("provider") != pool.provider and _has_live_launches(pool):
        errors.setdefault("provider", []).append(
            "The pool has live machines: set max_nodes to 0 and wait for them to be released first.")
    return errors


def _has_live_launches(pool: NodePool) -> bool:
    return NodeLaunch.objects.filter(pool=pool, state__in=LIVE_LAUNCH_STATES).exists()


def _complete(values: dict) -> dict:
    """Defaults a pool's values take from its GPU type: CPU machines have no GPUs; memory from the catalogue."""
    gpu = GPU_TYPES.get(values.get("gpu_type"))
    if values.get("gpus_per_node") is None:
        values["gpus_per_node"] = 0 if values.get("gpu_type") == "cpu" else 1
    if not values.get("gpu_memory_mb") and gpu is not None:
        values["gpu_memory_mb"] = gpu.memory_mb
    return values


def _audit_details(values: dict) -> dict:
    details = {name: values[name] for name in POOL_FIELDS if name in values and name != "template"}
    if "hourly_price" in details:
        details["hourly_price"] = str(details["hourly_price"])
    return details


def _unknown(fields: dict) -> None:
    unknown = set(fields) - set(POOL_FIELDS)
    if unknown:
        raise PoolInvalid({name: ["Unknown field."] for name in sorted(unknown)})


def _values(fields: dict, pool: NodePool | None) -> dict:
    """The complete values a pool would have with `fields` applied (to a new pool when `pool` is None)."""
    _unknown(fields)
    if pool is None:
        current = {name: NodePool._meta.get_field(name).get_default() for name in POOL_FIELDS}
        current["gpus_per_node"] = current["gpu_memory_mb"] = None  # from the GPU type (`_complete`)
    else:
        current = {name: getattr(pool, name) for name in POOL_FIELDS}
        if "gpu_type" in fields and "gpu_memory_mb" not in fields and fields["gpu_type"] != pool.gpu_type:
            fields = fields | {"gpu_memory_mb": 0}  # a new GPU type brings its own memory unless given
    return _complete(current | fields)


def node_pool_errors(fields: dict, pool: NodePool | None = None) -> dict[str, list[str]]:
    """What creating a pool with `fields` (or changing `pool` by them) would be refused for ({} when valid)."""
    try:
        return pool_errors(_values(fields, pool), pool)
    except PoolInvalid as exc:
        return exc.errors


def create_node_pool(actor: Actor, **fields) -> NodePool:
    """A new pool; raises `PoolInvalid` with every field's errors."""
    values = _values(fields, None)
    errors = pool_errors(values)
    if errors:
        raise PoolInvalid(errors)
    try:
        with transaction.atomic():
            pool = NodePool.objects.create(**values)
            record_audit(actor, None, "node_pool.create", pool, **_audit_details(values))
    except IntegrityError:  # NOTE: the name was taken between the check and the insert
        raise PoolInvalid({"name": [f"A pool named {values['name']!r} exists."]}) from None
    return pool


@transaction.atomic
def update_node_pool(actor: Actor, pool: NodePool, **fields) -> NodePool:
    """Change some of a pool's fields; the whole pool must still keep every rule. Http404 where it was deleted since
    the caller read it.

    NOTE: checked against the row as it is, locked and read again (as `delete_node_pool` takes it): an edit that lost
    the race to a delete updated no row, audited an edit of the deleted pool, then its `refresh_from_db` raised
    DoesNotExist, a 500."""
    pool = NodePool.objects.select_for_update().filter(pk=pool.pk).first()
    if pool is None:
        raise Http404("No such node pool.")
    current = {name: getattr(pool, name) for name in POOL_FIELDS}
    values = _values(fields, pool)
    errors = pool_errors(values, pool)
    if errors:
        raise PoolInvalid(errors)
    changed = {name: value for name, value in values.items() if value != current[name]}
    if not changed:
        return pool
    try:
        with transaction.atomic():
            NodePool.objects.filter(pk=pool.pk).update(**changed, updated_at=timezone.now())
            record_audit(actor, None, "node_pool.update", pool, **_audit_details(changed),
                         **({"template_changed": True} if "template" in changed else {}))
    except IntegrityError:  # NOTE: the new name was taken between the check and the update
        raise PoolInvalid({"name": [f"A pool named {values['name']!r} exists."]}) from None
    pool.refresh_from_db()
    return pool


def delete_node_pool(actor: Actor, pool: NodePool) -> None:
    """Delete a pool with no live machines, and its finished launches' history.

    NOTE: refused while any launch is REQUESTED, LAUNCHING, JOINED or RELEASING: those machines
    are paid for, and only the pool knows how to release them.
    """
    with transaction.atomic():
        pool = NodePool.objects.select_for_update().get(pk=pool.pk)
        num_live = NodeLaunch.objects.filter(pool=pool, state__in=LIVE_LAUNCH_STATES).count()
        if num_live:
            raise PoolInUse(f"Pool {pool.name} has {num_live} live machine(s): set its max_nodes to 0 and wait "
                            "for them to be released first.")
        record_audit(actor, None, "node_pool.delete", pool, gpu_type=pool.gpu_type, provider=pool.provider)
        NodeLaunch.objects.filter(pool=pool).delete()
        pool.delete()
