"""Credentials known to be real by every process, not only the one that looked them up: shared through Redis.

A gateway process looks up a key it has never seen under `CredentialLookups`' few slots, with the flood of made-up
keys anyone may send (`controlplane.credential_lookups`). Known only per process, a real key was a stranger to every
process that had not served it yet: a key just minted, a key after a deploy or a scale-up, a key the load balancer
sent to another pod. Under a flood each of those waited behind the made-up ones and was answered 503 for as long as
the flood lasted. So a key that matched a real one in any process, or was just issued, is marked here, by its SHA-256
(the credential never leaves the process that holds it), for `SHARED_KNOWN_FOR_S`, each match renewing it; a process
that finds the mark looks the key up without waiting for a slot. Still looked up: a revoked key stops at once, and its
refusal takes the mark away.

Node secrets likewise (`endpoints.fleet.services.NODE_SECRETS_KNOWN`): after a deploy of the web pods, every node's
heartbeat was a stranger's in each new process. The digest is the one the database keeps (`tokens.hash_token`), so a
retire takes the mark away from the row alone.

NOTE: only a match (or an issue) ever sets a mark, so no made-up credential skips the slots, however many are sent;
and a mark only lets a lookup skip the queue, never answers one. A mark holds its credential's owner (an API key's
organisation), so a surface may bound the lookups of marked credentials fairly between owners (the gateway's
`auth.MAX_KNOWN_KEY_LOOKUPS`): an organisation's many real keys are no more a flood than made-up ones. Redis away: every credential is unknown here, and
waits for its slot as before (each failure costs a caller nothing more than that).
"""

from __future__ import annotations

import logging

import redis

from controlplane.redis_client import get_async_redis, get_redis
from controlplane.redis_keys import known_credential_key

logger = logging.getLogger(__name__)

# How long a mark lasts after the credential's last match: a key called at least weekly never queues behind a flood.
# NOTE: bounded by the live credentials (a mark is set only for a real one), ~100 bytes each.
SHARED_KNOWN_FOR_S = 7 * 24 * 3600


class SharedKnownCredentials:
    """Marks of one kind of credential's real SHA-256 digests, in Redis (see the module's docstring)."""

    def __init__(self, kind: str):
        self.kind = kind

    def add(self, digest: str, owner: int | str = 1) -> None:
        """Marks `digest` known, as `owner`'s (an API key's organisation's id; what `owner_async` answers)."""
        try:
            get_redis().set(known_credential_key(self.kind, digest), owner, ex=SHARED_KNOWN_FOR_S)
        except (OSError, redis.RedisError):
            logger.warning("could not mark a %s known in Redis", self.kind, exc_info=True)

    def discard(self, digest: str) -> None:
        try:
            get_redis().delete(known_credential_key(self.kind, digest))
        except (OSError, redis.RedisError):
            logger.warning("could not unmark a %s in Redis", self.kind, exc_info=True)

    async def discard_async(self, digest: str) -> None:
        try:
            await get_async_redis().delete(known_credential_key(self.kind, digest))
        except (OSError, redis.RedisError):
            logger.warning("could not unmark a %s in Redis", self.kind, exc_info=True)

    def contains(self, digest: str) -> bool:
        try:
            return bool(get_redis().exists(known_credential_key(self.kind, digest)))
        except (OSError, redis.RedisError):
            return False

    async def contains_async(self, digest: str) -> bool:
        try:
            return bool(await get_async_redis().exists(known_credential_key(self.kind, digest)))
        except (OSError, redis.RedisError):
            return False

    async def owner_async(self, digest: str) -> str | None:
        """The owner `digest` was marked known as (`add`), or None where it is not marked (or Redis is away)."""
        try:
            return await get_async_redis().get(known_credential_key(self.kind, digest))
        except (OSError, redis.RedisError):
            return None
