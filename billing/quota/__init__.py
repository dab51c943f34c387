"""Spend caps and prepaid credit, enforced atomically in Redis before a request is proxied.

A request's largest possible cost (`endpoints.gateway.estimate`) is reserved before it is proxied,
and after its ledger row is written the reservation is settled with the real cost, never more than
the reservation (`SETTLE_LUA` caps it: a request can never take a cap or the credit past zero). The
checks and holds are Lua functions (`RESERVE_LUA`, `SETTLE_LUA`), run atomically inside the
gateway's admission and finish scripts (`endpoints/gateway/admission.py`), so concurrent calls from
any number of gateway processes can never overshoot a cap.

- `counters`: the Redis keys, the Lua parts and their keys and arguments, and `refresh_limits` when
  a cap, billing mode or credit grant changes;
- `rebuild`: a missing counter rebuilt from PostgreSQL (the ledger's spend, the credit left);
- `sweeper`: reservations whose gateway died, released after their deadline (a call with progress billed from it);
- `replayed`: usage rows replayed from the journal, counted in the counters rebuilt without them;
- `server_change`: every counter dropped once Redis is another server (a promoted replica, a restart) that may lack
  the last counts;
- `reads`: what Redis counts now (for the console and tests).

Redis holds, in nano-dollars (integers, exact in Lua's doubles up to $9M):
  billing:{org:<id>}:period:<YYYYMM>              hash {spent, cap (-1 = none), capr (the refusal at the cap:
                                                   `billing.standing.SPEND_LIMIT_REASONS`), prepaid (0/1),
                                                   hold (past_due, disputed or empty)}
  billing:{org:<id>}:key:<key id>:period:<YYYYMM>  hash {spent, cap}
  billing:{org:<id>}:reserved, billing:{org:<id>}:key:<key id>:reserved   sums of outstanding reservations
  billing:{org:<id>}:credit   prepaid credit left after settled spend; expires at the next grant expiry
  billing:{org:<id>}:credit:journaled   journaled calls the credit figure counted (a period hash's: `j:<id>` fields)
  billing:{org:<id>}:reservations   request id -> reservation (JSON); billing:{org:<id>}:reservation_deadlines (zset)
  billing:{org:<id>}:progress       request id -> a running call's usage so far (`counters.record_progress`)
  billing:{org:<id>}:replaying      request id -> until when a replay of the journal writes and counts its row
  billing:{org:<id>}:rebuilding     counters being rebuilt, and the costs replays could not add to them (`replayed`)

Every name is built in `controlplane.redis_keys`; one organisation's keys share its hash tag, so the
scripts run on Redis Cluster.

NOTE: a call spends in the period the ledger bills it in, that of its row's `finished_at`, which is not
the period it was reserved in when it runs past midnight at a month's end (the reserved sums are not per
period). The gateway writes the ledger row *before* settling: a settlement that finds no counter adds
nothing (the counter is rebuilt from the ledger, which has the row), and a counter rebuilt between the two
leaves out the cost of the calls still reserved and not settled, which their settlements add.
"""
