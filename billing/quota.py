"""Spend caps and prepaid credit, enforced atomically in Redis before a request is proxied.

A request's largest possible cost (`endpoints.gateway.estimate`) is reserved before it is proxied,
and after its ledger row is written the reservation is settled with the real cost, never more than
the reservation (`SETTLE_LUA` caps it: a request can never take a cap or the credit past zero). The checks and holds are Lua
functions (`RESERVE_LUA`, `SETTLE_LUA`), run atomically, so concurrent calls from any number of
gateway processes can never overshoot a cap. `reserve` and `settle` run them alone; the gateway
runs them inside its admission and finish scripts (`endpoints/gateway/admission.py`).

Redis holds, in nano-dollars (integers, exact in Lua's doubles up to $9M):
  billing:org:<id>:period:<YYYYMM>   hash {spent, cap (-1 = none), prepaid (0/1)}
  billing:key:<id>:period:<YYYYMM>   hash {spent, cap}
  billing:org:<id>:reserved, billing:key:<id>:reserved   sums of outstanding reservations
  billing:org:<id>:credit            prepaid credit left after settled spend; expires at the next grant expiry
  billing:reservations               request id -> reservation (JSON); billing:reservation_deadlines (zset)
A counter that is missing (a Redis flush, a new period, an expired credit figure) is rebuilt from
PostgreSQL: spend = the ledger's sum. A reservation whose gateway died is released by
`sweep_expired_reservations` once its deadline passes, so a crash never holds a cap forever.

NOTE: the gateway should write the ledger row *before* settling. Then a rebuild between the two
counts the request from the ledger while its reservation still counts too (conservative for a
moment), and `settle` skips counters that were rebuilt, so nothing is counted twice for long.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from decimal import ROUND_CEILING, ROUND_HALF_UP, Decimal

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections
from django.utils import timezone

from billing.ledger import period_spend, undrawn_prepaid_spend
from billing.models import MONEY_QUANTUM, ApiKeySpendCap, BillingAccount, CreditGrant
from billing.periods import Period, period_containing
from controlplane.redis_client import get_async_redis, get_redis

UNITS_PER_DOLLAR = 10**9
PERIOD_TTL_S = 40 * 86_400
SETTLED_MARKER_TTL_S = 86_400
CREDIT_FIGURE_MAX_TTL_S = 3600
RESERVATIONS = "billing:reservations"
DEADLINES = "billing:reservation_deadlines"
NO_KEY = "billing:no-key"  # placeholder Redis key when a request has no API key


class QuotaExceeded(Exception):
    """The request may cost more than the cap or credit left. The gateway answers 402 insufficient_quota."""

    code = "insufficient_quota"

    def __init__(self, reason: str):
        self.reason = reason
        self.message = {
            "org_cap": "Your organisation has reached its monthly spend cap. Raise it in the console to continue.",
            "key_cap": "This API key has reached its monthly spend cap.",
            "credit": "Your prepaid credit balance is too low for this request. Add credit to continue.",
        }.get(reason, "You exceeded your current quota.")
        super().__init__(self.message)


@dataclass(slots=True, frozen=True)
class Reservation:
    request_id: str
    organization_id: int
    api_key_id: int | None
    amount: Decimal
    period_key: str

    def __post_init__(self) -> None:
        if self.amount < 0:
            raise ValueError("a reservation cannot be negative")


def to_units(amount: Decimal, rounding=ROUND_HALF_UP) -> int:
    return int((amount * UNITS_PER_DOLLAR).to_integral_value(rounding=rounding))


def from_units(units: int) -> Decimal:
    return (Decimal(units) / UNITS_PER_DOLLAR).quantize(MONEY_QUANTUM)


# --- Redis keys and scripts -----------------------------------------------------------------

def org_period_key(organization_id: int, period_key: str) -> str:
    return f"billing:org:{organization_id}:period:{period_key}"


def org_reserved_key(organization_id: int) -> str:
    return f"billing:org:{organization_id}:reserved"


def key_period_key(api_key_id: int | None, period_key: str) -> str:
    return f"billing:key:{api_key_id}:period:{period_key}" if api_key_id is not None else NO_KEY


def key_reserved_key(api_key_id: int | None) -> str:
    return f"billing:key:{api_key_id}:reserved" if api_key_id is not None else NO_KEY


def credit_key(organization_id: int) -> str:
    return f"billing:org:{organization_id}:credit"


def settled_key(request_id: str) -> str:
    return f"billing:settled:{request_id}"


# The checks and holds of one reservation, as a Lua function: `reserve` runs it alone, the gateway
# inside its admission script (endpoints/gateway/admission.py), so both run the same code.
# K: org period, org reserved, key period, key reserved, credit, reservations, deadlines
# A: request id, amount (units), deadline, has key (1/0), payload
# Returns {'ok', 'new'|'existing'}, {'refused', reason} or {'missing', what}; only 'ok' changes anything.
RESERVE_LUA = """
local function quota_reserve(K, A)
  if redis.call('EXISTS', K[1]) == 0 then return {'missing', 'org'} end
  local has_key = A[4] == '1'
  if has_key and redis.call('EXISTS', K[3]) == 0 then return {'missing', 'key'} end
  local prepaid = redis.call('HGET', K[1], 'prepaid') == '1'
  if prepaid and redis.call('EXISTS', K[5]) == 0 then return {'missing', 'credit'} end
  if redis.call('HEXISTS', K[6], A[1]) == 1 then return {'ok', 'existing'} end
  local amount = tonumber(A[2])
  local org_reserved = tonumber(redis.call('GET', K[2]) or '0')
  local cap = tonumber(redis.call('HGET', K[1], 'cap'))
  if cap >= 0 and tonumber(redis.call('HGET', K[1], 'spent')) + org_reserved + amount > cap then
    return {'refused', 'org_cap'}
  end
  if has_key then
    local key_cap = tonumber(redis.call('HGET', K[3], 'cap'))
    local key_reserved = tonumber(redis.call('GET', K[4]) or '0')
    if key_cap >= 0 and tonumber(redis.call('HGET', K[3], 'spent')) + key_reserved + amount > key_cap then
      return {'refused', 'key_cap'}
    end
  end
  if prepaid and tonumber(redis.call('GET', K[5])) - org_reserved - amount < 0 then
    return {'refused', 'credit'}
  end
  redis.call('INCRBY', K[2], A[2])
  if has_key then redis.call('INCRBY', K[4], A[2]) end
  redis.call('HSET', K[6], A[1], A[5])
  redis.call('ZADD', K[7], A[3], A[1])
  return {'ok', 'new'}
end
"""

# Replaces a reservation by the real cost, never more than the reservation, once per request id
# (shared like RESERVE_LUA).
# K: reservations, deadlines, settled marker, org period, org reserved, key period, key reserved, credit
# A: request id, actual (units), has key, marker ttl
SETTLE_LUA = """
local function quota_settle(K, A)
  if not redis.call('SET', K[3], '1', 'NX', 'EX', A[4]) then return 0 end
  local has_key = A[3] == '1'
  local actual = A[2]
  local payload = redis.call('HGET', K[1], A[1])
  if payload then
    local amount = cjson.decode(payload)['a']
    if tonumber(actual) > tonumber(amount) then actual = amount end
    if redis.call('EXISTS', K[5]) == 1 then redis.call('DECRBY', K[5], amount) end
    if has_key and redis.call('EXISTS', K[7]) == 1 then redis.call('DECRBY', K[7], amount) end
    redis.call('HDEL', K[1], A[1])
    redis.call('ZREM', K[2], A[1])
  end
  -- A counter rebuilt from the ledger since the reservation already holds this request's cost.
  if redis.call('EXISTS', K[4]) == 1 then redis.call('HINCRBY', K[4], 'spent', actual) end
  if has_key and redis.call('EXISTS', K[6]) == 1 then redis.call('HINCRBY', K[6], 'spent', actual) end
  if redis.call('EXISTS', K[8]) == 1 then redis.call('DECRBY', K[8], actual) end
  return 1
end
"""

_RESERVE = RESERVE_LUA + "return quota_reserve(KEYS, ARGV)"
_SETTLE = SETTLE_LUA + "return quota_settle(KEYS, ARGV)"

# KEYS: reservations, deadlines, org reserved, key reserved; ARGV: request id, has key, now
_RELEASE_EXPIRED = """
local deadline = redis.call('ZSCORE', KEYS[2], ARGV[1])
if not deadline or tonumber(deadline) > tonumber(ARGV[3]) then return 0 end
local payload = redis.call('HGET', KEYS[1], ARGV[1])
if payload then
  local amount = cjson.decode(payload)['a']
  if redis.call('EXISTS', KEYS[3]) == 1 then redis.call('DECRBY', KEYS[3], amount) end
  if ARGV[2] == '1' and redis.call('EXISTS', KEYS[4]) == 1 then redis.call('DECRBY', KEYS[4], amount) end
  redis.call('HDEL', KEYS[1], ARGV[1])
end
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
"""

# KEYS: a hash; ARGV: ttl, then field/value pairs. Writes the hash only if nobody did meanwhile.
_INIT_HASH = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 1
"""

# KEYS: a hash; ARGV: field/value pairs. Changes the hash only if it exists.
_UPDATE_HASH = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"""

_scripts: dict[tuple[int, str], object] = {}


def _script(client, source: str):
    script = _scripts.get((id(client), source))
    if script is None:
        script = _scripts[(id(client), source)] = client.register_script(source)
    return script


# --- rebuilding counters from PostgreSQL ------------------------------------------------------

@dataclass(slots=True, frozen=True)
class _Rebuild:
    key: str
    fields: dict[str, str] | None  # a hash, or
    value: str | None  # a plain counter
    ttl_s: int


def _rebuild_from_database(what: str, organization_id: int, api_key_id: int | None, period: Period) -> _Rebuild:
    close_old_connections()  # NOTE: runs in a worker thread whose connection may have gone stale
    if what == "org":
        account = BillingAccount.objects.for_organization(organization_id)
        cap = to_units(account.spend_cap) if account.spend_cap is not None else -1
        spent = to_units(period_spend(organization_id, period))
        fields = {"spent": str(spent), "cap": str(cap), "prepaid": "1" if account.is_prepaid else "0"}
        return _Rebuild(org_period_key(organization_id, period.key), fields, None, PERIOD_TTL_S)
    if what == "key":
        key_cap = ApiKeySpendCap.objects.filter(api_key_id=api_key_id).values_list("spend_cap", flat=True).first()
        spent = to_units(period_spend(organization_id, period, api_key_id=api_key_id))
        fields = {"spent": str(spent), "cap": str(to_units(key_cap) if key_cap is not None else -1)}
        return _Rebuild(key_period_key(api_key_id, period.key), fields, None, PERIOD_TTL_S)
    if what == "credit":
        available, ttl_s = credit_available(organization_id)
        return _Rebuild(credit_key(organization_id), None, str(to_units(available, ROUND_HALF_UP)), ttl_s)
    raise ValueError(what)


def credit_available(organization_id: int) -> tuple[Decimal, int]:
    """Prepaid credit left now (active grants less usage not yet drawn from them), and for how many
    seconds that figure holds before a grant starts or expires."""
    now = timezone.now()
    account = BillingAccount.objects.for_organization(organization_id)
    grants = list(CreditGrant.objects.filter(organization_id=organization_id))
    active = [grant for grant in grants if grant.is_active(now)]
    undrawn = undrawn_prepaid_spend(account)
    available = sum((grant.remaining for grant in active), Decimal(0)) - max(undrawn, Decimal(0))
    changes = [g.expires_at for g in active if g.expires_at] + [g.granted_at for g in grants if g.granted_at > now]
    ttl_s = CREDIT_FIGURE_MAX_TTL_S
    if changes:
        ttl_s = max(1, min(ttl_s, int((min(changes) - now).total_seconds()) + 1))
    return available, ttl_s


def _write_rebuild(client, rebuild: _Rebuild):
    if rebuild.fields is not None:
        args = [rebuild.ttl_s, *[item for pair in rebuild.fields.items() for item in pair]]
        return _script(client, _INIT_HASH)(keys=[rebuild.key], args=args)
    return client.set(rebuild.key, rebuild.value, nx=True, ex=rebuild.ttl_s)


# --- the gateway's calls ---------------------------------------------------------------------------

def _reserve_keys(organization_id: int, api_key_id: int | None, period_key: str) -> list[str]:
    return [
        org_period_key(organization_id, period_key), org_reserved_key(organization_id),
        key_period_key(api_key_id, period_key), key_reserved_key(api_key_id),
        credit_key(organization_id), RESERVATIONS, DEADLINES,
    ]


def prepare_reservation(*, organization_id: int, api_key_id: int | None, amount: Decimal,
                        request_id: str) -> tuple[Reservation, list[str], list[str]]:
    """A reservation and the keys and arguments of `RESERVE_LUA` that hold it."""
    period = period_containing()
    reservation = Reservation(request_id, organization_id, api_key_id, amount, period.key)
    units = to_units(amount, ROUND_CEILING)
    deadline = time.time() + settings.BILLING_RESERVATION_TTL_S
    payload = json.dumps({"o": organization_id, "k": api_key_id, "a": str(units), "p": period.key})
    keys = _reserve_keys(organization_id, api_key_id, period.key)
    args = [request_id, str(units), f"{deadline:.3f}", "1" if api_key_id is not None else "0", payload]
    return reservation, keys, args


async def rebuild_missing(what: str, reservation: Reservation) -> None:
    """`RESERVE_LUA` answered {'missing', what}: rebuild that counter from PostgreSQL."""
    period = period_containing()
    if period.key != reservation.period_key:
        return  # a new month began meanwhile: the caller prepares the reservation again
    rebuild = await sync_to_async(_rebuild_from_database)(what, reservation.organization_id, reservation.api_key_id, period)
    await _write_rebuild(get_async_redis(), rebuild)


def refusal(status: str, detail: str) -> QuotaExceeded | None:
    """What an answer of `RESERVE_LUA` means for the caller: None when the reservation holds."""
    if status == "ok":
        return None
    if status == "refused":
        return QuotaExceeded(detail)
    raise ValueError(f"not a final answer: {status} {detail}")


async def reserve(*, organization_id: int, api_key_id: int | None, amount: Decimal, request_id: str) -> Reservation:
    """Hold `amount` against the organisation's monthly cap, the key's cap and (prepaid) the credit left.

    Atomic across all gateway processes; reserving the same request id twice holds it once.
    Raises QuotaExceeded when the request could overshoot.
    """
    client = get_async_redis()
    for _attempt in range(4):
        reservation, keys, args = prepare_reservation(
            organization_id=organization_id, api_key_id=api_key_id, amount=amount, request_id=request_id)
        status, detail = await _script(client, _RESERVE)(keys=keys, args=args)
        if status == "missing":
            await rebuild_missing(detail, reservation)
            continue
        if (refused := refusal(status, detail)) is not None:
            raise refused
        return reservation
    raise RuntimeError("billing counters kept vanishing while reserving")


def settle_keys_and_args(reservation: Reservation, actual: Decimal) -> tuple[list[str], list[str]]:
    """The keys and arguments of `SETTLE_LUA` for replacing `reservation` by `actual`."""
    if actual < 0:
        raise ValueError("a cost cannot be negative")
    org, key, period_key = reservation.organization_id, reservation.api_key_id, reservation.period_key
    keys = [
        RESERVATIONS, DEADLINES, settled_key(reservation.request_id),
        org_period_key(org, period_key), org_reserved_key(org),
        key_period_key(key, period_key), key_reserved_key(key), credit_key(org),
    ]
    has_key = "1" if key is not None else "0"
    return keys, [reservation.request_id, str(to_units(actual)), has_key, str(SETTLED_MARKER_TTL_S)]


async def settle(reservation: Reservation, actual: Decimal) -> None:
    """Replace the reservation by the request's real cost. Settling a request twice counts it once."""
    keys, args = settle_keys_and_args(reservation, actual)
    await _script(get_async_redis(), _SETTLE)(keys=keys, args=args)


def settle_sync(reservation: Reservation, actual: Decimal) -> None:
    keys, args = settle_keys_and_args(reservation, actual)
    _script(get_redis(), _SETTLE)(keys=keys, args=args)


# --- upkeep ----------------------------------------------------------------------------------------------

def sweep_expired_reservations(now: float | None = None, *, batch_size: int = 1000) -> int:
    """Release reservations whose deadline passed (their gateway died mid-request). Returns how many."""
    client = get_redis()
    now = time.time() if now is None else now
    released = 0
    while True:
        expired = client.zrangebyscore(DEADLINES, "-inf", now, start=0, num=batch_size)
        if not expired:
            return released
        for request_id in expired:
            payload = client.hget(RESERVATIONS, request_id)
            reservation = json.loads(payload) if payload else {"o": 0, "k": None}
            keys = [RESERVATIONS, DEADLINES, org_reserved_key(reservation["o"]), key_reserved_key(reservation["k"])]
            has_key = "1" if reservation["k"] is not None else "0"
            released += _script(client, _RELEASE_EXPIRED)(keys=keys, args=[request_id, has_key, f"{now:.3f}"])
        if len(expired) < batch_size:
            return released


def refresh_limits(organization_id: int, *, api_key_id: int | None = None) -> None:
    """Make Redis see a changed cap, billing mode or credit grant at once (counters stay as they are)."""
    client = get_redis()
    period = period_containing()
    account = BillingAccount.objects.for_organization(organization_id)
    cap = to_units(account.spend_cap) if account.spend_cap is not None else -1
    _script(client, _UPDATE_HASH)(
        keys=[org_period_key(organization_id, period.key)],
        args=["cap", str(cap), "prepaid", "1" if account.is_prepaid else "0"],
    )
    client.delete(credit_key(organization_id))  # rebuilt from the grants at the next reservation
    if api_key_id is not None:
        key_cap = ApiKeySpendCap.objects.filter(api_key_id=api_key_id).values_list("spend_cap", flat=True).first()
        _script(client, _UPDATE_HASH)(
            keys=[key_period_key(api_key_id, period.key)],
            args=["cap", str(to_units(key_cap) if key_cap is not None else -1)],
        )


def reserved_now(organization_id: int) -> Decimal:
    """Outstanding reservations of an organisation (for the console and tests)."""
    return from_units(int(get_redis().get(org_reserved_key(organization_id)) or 0))


def counted_spend(organization_id: int, period: Period | None = None) -> Decimal | None:
    """Settled spend as Redis counts it this period, or None when the counter is not built."""
    period = period or period_containing()
    spent = get_redis().hget(org_period_key(organization_id, period.key), "spent")
    return from_units(int(spent)) if spent is not None else None

