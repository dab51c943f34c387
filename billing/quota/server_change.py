"""Spend counters dropped once Redis is another server than the one they were counted on: a replica promoted by a
failover, or the same one restarted from its append-only file or snapshot. Either may lack the last writes (a replica
behind by its replication lag; `appendfsync everysec` loses up to a second on a machine's crash, a snapshot what came
after it), and a count added to a counter that still exists leaves no other trace: a settlement with no hold, a journal
replay's count (its registration comes back, nothing counts it again). The counter stayed short for the month, and
the caps and the prepaid credit could be passed by that cost.

The gateway's beat (`endpoints.gateway.presence.beat`) asks Redis which server it is (`check_server`: `run_id`, new at
every start, and `master_replid2`, the replication id a promoted replica took over, new at every promotion: a primary
failed over and back keeps its `run_id`). The first beat to find another than the one the counters were trusted on
(`TRUSTED_SERVER_KEY`) takes the drop (`DROPPING_KEY`, for `DROP_LEASE_S`, renewed at each scan batch; a drop that
fails gives it back at once, one killed leaves it to the first beat after `DROP_LEASE_S`) and drops every
organisation's period counters and credit figure, as a flush drops them: the next call of each rebuilds it from the
ledger (`billing.quota.rebuild`), which has every row, once. Nothing per call: one script per beat and process, and
the drop once per failover or restart (a scan of the keyspace).

NOTE: `master_replid` is not taken: a primary takes a new one when a replica first attaches (Redis 6.2 creates its
backlog), which loses nothing. A Redis with no trusted server yet (a new one, one restarted without persistence or
flushed: no counter is left) takes itself as trusted, dropping nothing.
"""

from __future__ import annotations

import contextlib
import logging
import re
import secrets

from django.conf import settings

from controlplane.redis_client import as_text
from controlplane.redis_keys import (
    DROPPING_COUNTERS_KEY,
    TRUSTED_SERVER_KEY,
    credit_journaled_key,
    organization_of_key,
)
from controlplane.redis_scripts import Script

logger = logging.getLogger("inferplane.billing")

# How long a beat's drop holds the lease, renewed at each batch, before another beat may take it over (it was killed,
# or Redis failed over again).
DROP_LEASE_S = 10
# Keys read per SCAN step and dropped per round trip.
DROP_BATCH = 1000

# Which server a script runs on (the one definition: `billing.quota.rebuild` takes it too): `run_id` (new at every
# start) and `master_replid2` (the id a promoted replica took over from its primary; all zeros on one never promoted,
# and again once a primary with no replica frees its backlog, after `repl-backlog-ttl`: it lost nothing, so
# `same_server` takes `<run_id>/000…` for the server `<run_id>/<any>` was).
SERVER_LUA = """
local function server_identity()
  local server = string.match(redis.call('INFO', 'server'), 'run_id:(%w+)') or ''
  local previous = string.match(redis.call('INFO', 'replication'), 'master_replid2:(%w+)') or ''
  return server .. '/' .. previous
end
local function same_server(known, server)
  if known == server then return true end
  local run_id = string.match(server, '^(%w+)/0+$')
  return run_id ~= nil and string.match(known or '', '^(%w+)/') == run_id
end
"""

# KEYS: the trusted server, the drop's lease; ARGV: the lease's ttl, the caller's token. Returns {'same'|'drop'|'busy',
# this server}: 'drop' takes the lease (its caller drops the counters, then `_TRUSTED`). NOTE: the lease holds the
# caller's token, so redis-py's retry after a lost reply answers 'drop' again, not 'busy' (no drop for a lease's time).
_CHECK = Script(SERVER_LUA + """
local server = server_identity()
local trusted = redis.call('GET', KEYS[1])
if not trusted then
  redis.call('SET', KEYS[1], server)
  return {'same', server}
end
if same_server(trusted, server) then return {'same', server} end
local lease = redis.call('GET', KEYS[2])
if lease == ARGV[2] or not lease then
  redis.call('SET', KEYS[2], ARGV[2], 'EX', ARGV[1])
  return {'drop', server}
end
return {'busy', server}
""")

# KEYS: the drop's lease; ARGV: the caller's token, the lease's ttl (0: give it back). Acts only on a lease the caller
# still holds; returns 1 when it did. Run again, it changes nothing more.
_LEASE = Script("""
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if tonumber(ARGV[2]) > 0 then redis.call('EXPIRE', KEYS[1], ARGV[2]) else redis.call('DEL', KEYS[1]) end
return 1
""")

# KEYS: the trusted server, the drop's lease; ARGV: the server the counters were dropped on, the caller's token.
# Trusts it if the script still runs on it (a failover meanwhile leaves the next beat another drop); returns 1 when
# trusted. Run again, it changes nothing more.
_TRUSTED = Script(SERVER_LUA + """
if not same_server(ARGV[1], server_identity()) then return 0 end
redis.call('SET', KEYS[1], ARGV[1])
if redis.call('GET', KEYS[2]) == ARGV[2] then redis.call('DEL', KEYS[2]) end
return 1
""")

# The counters a call's admission rebuilds when missing (`controlplane.redis_keys`): an organisation's and a key's
# period counters, the credit figure (dropped with its journaled calls, in one command: `rebuild._INIT_CREDIT` writes
# them together).
_COUNTER = re.compile(r"^billing:\{org:\d+\}:(?:key:\d+:)?period:\d+$")
_CREDIT = re.compile(r"^billing:\{org:\d+\}:credit$")


async def check_server(redis) -> int | None:
    """Drop every spend counter if Redis is another server than the one they were counted on (see the module's
    docstring); returns how many were dropped, None when nothing was to drop (or another beat drops them). Not on Redis
    Cluster (each node has its own ids; not covered yet)."""
    if settings.REDIS_CLUSTER:
        return None
    token = secrets.token_hex(8)
    status, server = (as_text(part) for part in await _CHECK(keys=[TRUSTED_SERVER_KEY, DROPPING_COUNTERS_KEY],
                                                           args=[DROP_LEASE_S, token]))
    if status != "drop":
        return None
    logger.warning("Redis is another server than the spend counters were counted on (%s): dropping them, each "
                   "rebuilt from the ledger by its next call", server)
    try:
        dropped = await _drop_counters(redis, lambda: _LEASE(keys=[DROPPING_COUNTERS_KEY], args=[token, DROP_LEASE_S]))
    except BaseException:
        with contextlib.suppress(Exception):  # Redis itself gone: the lease's short ttl gives it back
            await _LEASE(keys=[DROPPING_COUNTERS_KEY], args=[token, 0])
        raise
    await _TRUSTED(keys=[TRUSTED_SERVER_KEY, DROPPING_COUNTERS_KEY], args=[server, token])
    return dropped


async def _drop_counters(redis, renew_lease) -> int:
    dropped = scanned = 0
    batch: list[str] = []
    async for key in redis.scan_iter(match="billing:{org:*", count=DROP_BATCH):
        scanned += 1
        if scanned % DROP_BATCH == 0:
            await renew_lease()
        if _COUNTER.match(key) or _CREDIT.match(key):
            batch.append(key)
        if len(batch) >= DROP_BATCH:
            dropped += await _unlink(redis, batch)
            batch = []
    if batch:
        dropped += await _unlink(redis, batch)
    return dropped


async def _unlink(redis, keys: list[str]) -> int:
    async with redis.pipeline(transaction=False) as pipe:
        for key in keys:
            if _CREDIT.match(key):
                pipe.unlink(key, credit_journaled_key(organization_of_key(key)))
            else:
                pipe.unlink(key)
        return len([answer for answer in await pipe.execute() if answer])
