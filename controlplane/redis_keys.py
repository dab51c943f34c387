"""Every Redis key name the platform uses, in one place, laid out so the Lua scripts run on Redis Cluster.

A Redis Cluster runs a script only when every key it is given hashes to one slot. The slot of a key
is the CRC16 of its hash tag (the part between the first `{` and the next `}`) when it has one. So
every key a script call may touch together carries its organisation's tag, `{org:<id>}`:

- the gateway's admission and finish scripts (`endpoints/gateway/admission.py`) touch the caller's
  rate-limit windows, its organisation's and key's quota counters and reservations, the endpoint's
  traffic sets and its replicas' outstanding counters, and this gateway's requests hash. An endpoint,
  its replicas and the key calling it all belong to one organisation, so all of them carry its tag;
- this gateway's requests are one hash per organisation (`gateway_requests_key`), so the scripts that
  release or restore a gateway's requests (`endpoints.gateway.presence`) run once per organisation;
- the autoscaler's load script (`endpoints.autoscaler.read_load`) runs once per slot.

Keys no script touches with another stay global: the gateways set, a gateway's alive key, the set of
recently used endpoints, the wake dedupe, the tick lock. The form throttles' counters share one tag of their own
(`THROTTLE_TAG`): an attempt's are read and counted by one script.

NOTE: a key's name is its contract with every process that reads it: a renamed key is a key lost on
deploy (the counters rebuild from PostgreSQL, the traffic counts from the gateways' heartbeats).
"""

from __future__ import annotations

import redis.crc


def org_tag(organization_id: int) -> str:
    """The hash tag every key of one organisation's data plane carries."""
    return f"{{org:{int(organization_id)}}}"


def once_key(slot_of: str, token: str) -> str:
    """A script call's one-shot token (`controlplane.redis_scripts.Script`'s `once`), in the slot of `slot_of`: its
    hash tag's (every key a script takes together has one), or the whole of a key without braces."""
    start = slot_of.find("{")
    end = slot_of.find("}", start + 1) if start >= 0 else -1
    tag = slot_of[start:end + 1] if end > start + 1 else f"{{{slot_of}}}"
    return f"once:{tag}:{token}"


def key_slot(key: str) -> int:
    """The Redis Cluster slot of `key` (CRC16 of its hash tag, or of the whole key without one)."""
    return redis.crc.key_slot(key.encode())


# --- per-key rate limits (`endpoints.gateway.limits`) ------------------------------------------------

def requests_window_key(organization_id: int, subject: str, minute: int) -> str:
    return f"rl:{org_tag(organization_id)}:req:{subject}:{minute}"


def tokens_window_key(organization_id: int, subject: str, minute: int) -> str:
    return f"rl:{org_tag(organization_id)}:tok:{subject}:{minute}"


def tokens_reserved_key(organization_id: int, subject: str, minute: int) -> str:
    """The tokens each call reserved in the minute (call token -> tokens; '-' once given back)."""
    return f"rl:{org_tag(organization_id)}:tokres:{subject}:{minute}"


# --- spend quota (`billing.quota`) -------------------------------------------------------------------

def org_period_key(organization_id: int, period_key: str) -> str:
    return f"billing:{org_tag(organization_id)}:period:{period_key}"


def org_reserved_key(organization_id: int) -> str:
    return f"billing:{org_tag(organization_id)}:reserved"


def no_key_placeholder(organization_id: int) -> str:
    """The key passed where a request has no API key (never written), in the organisation's slot."""
    return f"billing:{org_tag(organization_id)}:no-key"


def key_period_key(organization_id: int, api_key_id: int | None, period_key: str) -> str:
    if api_key_id is None:
        return no_key_placeholder(organization_id)
    return f"billing:{org_tag(organization_id)}:key:{api_key_id}:period:{period_key}"


def key_reserved_key(organization_id: int, api_key_id: int | None) -> str:
    if api_key_id is None:
        return no_key_placeholder(organization_id)
    return f"billing:{org_tag(organization_id)}:key:{api_key_id}:reserved"


def credit_key(organization_id: int) -> str:
    return f"billing:{org_tag(organization_id)}:credit"


def credit_journaled_key(organization_id: int) -> str:
    """The journaled calls whose settlement the credit figure counted (`billing.quota.replayed`)."""
    return f"billing:{org_tag(organization_id)}:credit:journaled"


def replaying_key(organization_id: int) -> str:
    """Hash: request id -> until when (Redis's clock, seconds) a replay of the journal, or a write that may supersede a
    lost row, may still commit its row and count it, then `.` and the replay's token (`<deadline>.<token>`, a number:
    `billing.quota.replayed.Registration`)."""
    return f"billing:{org_tag(organization_id)}:replaying"


def rebuilding_key(organization_id: int) -> str:
    """Hash: `c:<counter key>` -> until when a rebuild of that counter may write it, `m:<counter key>|<request
    id>` -> the cost a settlement or a replay's count could not add to it, missing then, `d:<counter key>|<request
    id>` -> a superseded row's difference so left (`billing.quota.rebuild`); the calls held again meanwhile are in each
    counter's own set, `held_again_key`."""
    return f"billing:{org_tag(organization_id)}:rebuilding"


def held_again_key(counter_key: str) -> str:
    """Set: the request ids of the calls held again while the counter `counter_key` was rebuilt, only those that count
    in it (`billing.quota.rebuild.HELD_AGAIN_LUA`); in the counter's slot, as it carries its organisation's tag."""
    return f"{counter_key}:held_again"


# The Redis server the spend counters were counted on (`run_id/master_replid2`), and the lease of the beat dropping
# them once Redis is another (`billing.quota.server_change`), in one slot (one script takes both).
TRUSTED_SERVER_KEY = "billing:{server}:trusted"
DROPPING_COUNTERS_KEY = "billing:{server}:dropping-counters"


def limits_refreshed_key(organization_id: int) -> str:
    """Set for a few seconds after a gateway wrote the organisation counter's limits for a version mismatch."""
    return f"billing:{org_tag(organization_id)}:limits_refreshed"


def portal_return_key(organization_id: int) -> str:
    """Set for a while after the billing page read the organisation's Stripe customer on a return from the portal."""
    return f"billing:{org_tag(organization_id)}:portal_return"


def settled_key(organization_id: int, request_id: str) -> str:
    return f"billing:{org_tag(organization_id)}:settled:{request_id}"


def reservations_key(organization_id: int) -> str:
    """Hash: request id -> reservation (JSON)."""
    return f"billing:{org_tag(organization_id)}:reservations"


def progress_key(organization_id: int) -> str:
    """Hash: request id -> the usage so far of a call still running (an encoded `UsageReport`), for the sweeper."""
    return f"billing:{org_tag(organization_id)}:progress"


# The reservation sweeper's index (`billing.quota.sweep_index`): organisation id scored by when its first reservation
# deadline or replay registration may fall due (Redis's clock, s); the marker that it was built whole (lost with it:
# one slot); the next organisation its rolling audit reads.
SWEEP_DUE_KEY = "billing:{sweep}:due"
SWEEP_DUE_BUILT_KEY = "billing:{sweep}:due-built"
SWEEP_AUDIT_CURSOR_KEY = "billing:{sweep}:audit-cursor"


def card_refresh_queued_key(fingerprint: str) -> str:
    """String: a refresh of the card's organisations' limits is queued (`billing.services.queue_card_refresh`)."""
    return f"billing:card-refresh-queued:{fingerprint}"


def erased_mailbox_key(digest: str) -> str:
    """Set: the ids of the accounts deleted lately whose address reached the mailbox of this keyed digest
    (`controlplane.accounts.organizations.remember_erased_mailbox`)."""
    return f"accounts:erased-mailbox:{digest}"


def allowance_refresh_queued_key(organization_id: int, user_id: int) -> str:
    """String: a refresh of the limits of the organisation and the person's organisations is queued, after a change of
    the person's membership of it (`billing.services.queue_allowance_refresh`)."""
    return f"billing:allowance-refresh-queued:{organization_id}:{user_id}"


def deadlines_key(organization_id: int) -> str:
    """Sorted set: request id scored by the time its reservation lapses."""
    return f"billing:{org_tag(organization_id)}:reservation_deadlines"


# --- gateway traffic (`endpoints.gateway.traffic`, `presence`, `cold_start`) ------------------------

RECENT_ENDPOINTS_KEY = "gw:recent_endpoints"  # endpoint id scored by its last request (written by heartbeats)
GATEWAYS_KEY = "gw:gateways"  # the requests hashes of gateway processes that hold (or held) requests
_REQUESTS_PART = ":requests:"


def inflight_key(organization_id: int, endpoint_id: str) -> str:
    return f"gw:{org_tag(organization_id)}:inflight:{endpoint_id}"


def waiting_key(organization_id: int, endpoint_id: str) -> str:
    return f"gw:{org_tag(organization_id)}:waiting:{endpoint_id}"


def last_request_key(organization_id: int, endpoint_id: str) -> str:
    return f"gw:{org_tag(organization_id)}:last_request:{endpoint_id}"


def outstanding_key(organization_id: int, replica_id: str) -> str:
    return f"gw:{org_tag(organization_id)}:outstanding:{replica_id}"


def no_replica_placeholder(organization_id: int) -> str:
    """The counter passed where a request holds no replica's count (never written)."""
    return outstanding_key(organization_id, "-")


def gateway_requests_key(organization_id: int, gateway: str) -> str:
    """Hash of one gateway process's requests of one organisation: request id -> "<endpoint>|<counter>"."""
    return f"gw:{org_tag(organization_id)}{_REQUESTS_PART}{gateway}"


def gateway_of_requests_key(requests_key: str) -> str:
    """The gateway whose requests hash `requests_key` is."""
    return requests_key.partition(_REQUESTS_PART)[2]


def organization_of_key(key: str) -> int:
    """The organisation whose hash tag `key` carries."""
    tag = key[key.index("{org:") + len("{org:"):]
    return int(tag[:tag.index("}")])


def gateway_alive_key(gateway: str) -> str:
    return f"gw:alive:{gateway}"


def held_key(organization_id: int) -> str:
    """Sorted set of the organisation's requests held for a cold start, scored by when each place lapses."""
    return f"gw:{org_tag(organization_id)}:held"


def endpoint_held_key(organization_id: int, endpoint_id: str) -> str:
    """Sorted set of the endpoint's requests held for a cold start (the same members and scores as `held_key`'s)."""
    return f"gw:{org_tag(organization_id)}:held:{endpoint_id}"


def wake_key(endpoint_id: str) -> str:
    return f"gw:wake:{endpoint_id}"


# --- form throttles (`controlplane.accounts.throttle`: one script reads and counts an attempt's every counter) -----

# NOTE: one hash tag for them all, so that one script may touch an attempt's counters together on Redis Cluster
# (an address's and an account's): one slot, for the little traffic forms make.
THROTTLE_TAG = "{forms}"


def throttle_key(limit_name: str, subject_digest: str, window: int) -> str:
    return f"throttle:{THROTTLE_TAG}:{limit_name}:{subject_digest}:{window}"


# --- autoscaler ------------------------------------------------------------------------------------

TICK_LOCK_KEY = "as:tick-lock"
# Since when the control plane has heard heartbeats again after a gap in the sweeps (`endpoints.scheduler.sweep_stuck`;
# when they last ended is kept in PostgreSQL, `endpoints.nodes.models.NodeSweep`).
LISTENING_SINCE_KEY = "sweep:listening-since"
# Since when (the sweeps' clock) every node has been silent at once (`endpoints.scheduler.whole_fleet_silent`).
FLEET_SILENT_SINCE_KEY = "sweep:fleet-silent-since"
# How many beats web processes have made (`endpoints.gateway.presence.beat`), and the count the sweeps last saw with
# when they first saw it: the web tier, which hears the agents' heartbeats, is down when the count stops moving
# (`endpoints.scheduler.web_tier_silent`). NOTE: a count, not times: only the sweeps' clock is read.
WEB_BEATS_KEY = "web:beats"
WEB_BEATS_SEEN_KEY = "sweep:web-beats-seen"
# What each Celery process (beat, a worker) found its clock ahead of Redis's, when it last checked (`controlplane.clock`).
CLOCK_SKEWS_KEY = "clock:skews"
# The rollups held for an operator, by reason, as the push task last counted them (`billing.held_rollups`).
HELD_ROLLUPS_KEY = "billing:held-rollups"


def unplaced_logged_key(endpoint_id: str) -> str:
    """The reason staff's log last gave for not placing a replica of the endpoint (`endpoints.replicas.place_replica`):
    its fleet figure is logged once per change of it, not every tick."""
    return f"as:unplaced-logged:{endpoint_id}"


def idle_deadline_key(endpoint_id: str, deadline: float) -> str:
    """Set once the reconcile at this idle deadline is scheduled (`endpoints.scheduler.schedule_idle_deadlines`)."""
    return f"as:idle-deadline:{endpoint_id}:{deadline:.3f}"


def samples_key(organization_id: int, endpoint_id: str) -> str:
    return f"as:{org_tag(organization_id)}:samples:{endpoint_id}"


def capacity_key(organization_id: int, endpoint_id: str) -> str:
    """Sequences one replica's engine ran when it last queued (held for the stable window)."""
    return f"as:{org_tag(organization_id)}:capacity:{endpoint_id}"


# --- batches (`endpoints.batches.services`) ----------------------------------------------------------

def batch_dispatch_key(batch_id: str) -> str:
    """Set while a run of the batch is queued or running: the batch tick queues one run at a time."""
    return f"batch:dispatched:{batch_id}"


# Set while the abandoned-upload sweep waits after S3 refused or failed a delete (`services.ABANDONED_SWEEP_PAUSE_S`).
ABANDONED_SWEEP_PAUSED_KEY = "batch:abandoned-sweep-paused"


def batch_engine_failures_key(batch_id: str, index: int) -> str:
    """A batch line's tries its engine failed (`endpoints.batches.runner.MAX_ENGINE_FAILURES`): a hash of their number
    and the first's unix time, kept across runs until the batch's window ends."""
    return f"batch:engine-failures:{batch_id}:{int(index)}"


# --- node pools ------------------------------------------------------------------------------------

# Held by one `billing.stripe_sync.push_pending_rollups` run at a time (a token lock: redis-py's `Lock`).
PUSH_RUN_LOCK_KEY = "billing:push-run-lock"
# One run at a time of the ending of closed organisations' subscriptions (`billing.closed_subscriptions`).
CLOSED_SUBSCRIPTIONS_RUN_LOCK_KEY = "billing:closed-subscriptions-run-lock"
POOLS_TICK_LOCK_KEY = "pools:tick-lock"  # held by one `endpoints.fleet.pools.provision_tick` at a time
# When each pool's tick last started (a hash: pool id -> Redis time): the tick takes the pools least recently started first.
POOLS_TICK_STARTED_KEY = "pools:tick-started"
# The same for the stray sweep (`endpoints.fleet.pool_strays.sweep_stray_machines`): when each pool's sweep last started.
POOLS_SWEEP_STARTED_KEY = "pools:sweep-started"


# --- credentials known to be real (`controlplane.accounts.known_credentials`) ---------------------------------------


def known_credential_key(kind: str, digest: str) -> str:
    """Set while a credential of `kind` whose SHA-256 is `digest` matched a real one in any process (or was just
    issued): never the credential itself, never set for one that matched none."""
    return f"known:{kind}:{digest}"
