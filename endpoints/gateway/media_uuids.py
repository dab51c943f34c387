"""A media part's `uuid`, scoped to the calling key before it reaches the engine.

vLLM lets a chat content part name its media with a `uuid` (on `image_url`, `input_audio`, `video_url` and the
other media parts, `str()`-ed, any type of part) and uses it as the item's identity in place of a hash of its bytes
(`vllm/multimodal/processing/inputs.py`: the uuid itself, or hashed with the model's processor arguments when it has
any). That identity keys the engine's cache of processed media and the prefix cache's blocks that follow the item,
and a part with a `uuid` and no media (`"image_url": null`) is answered from the cached item of that uuid. Passed
through, a uuid named an item any other caller of the endpoint had sent: another key of the organisation, or one of
its customers' keys, got an answer about an image, a recording or a video it never sent (found by a review).

OpenAI's API has no such field and its clients never send it, so refusing it would cost them nothing; but callers
that use vLLM's caching on purpose would lose it. So the gateway keeps it and rewrites each one to an HMAC of the
given uuid keyed by the calling key (`Caller.limit_subject`): a key's repeated uuid still names its own item, on
every gateway process and replica, and can never name another key's. No secret is needed: every uuid reaches an
engine through `scoped`, so the values a caller can produce are its own key's HMACs, and matching another key's
(or a hash vLLM computes of media bytes) would take finding a preimage.

A body's `cache_salt` (vLLM's, for chat and completions) is the same kind of name: prefix-cache blocks are shared
only between requests with the same salt, which is how a caller keeps its prompts' cached blocks (and the timing
they reveal) from others. Passed through, another key that sent the same salt shared them. It is scoped the same way
(`scoped_cache_salt`), after the checks vLLM makes of it (a 400 here, as the engine would answer).
"""

from __future__ import annotations

import hashlib
import hmac

from endpoints.gateway import errors

FIELD = "uuid"
CACHE_SALT = "cache_salt"
# vLLM's own bounds of a salt (`vllm/entrypoints/generate/base/protocol.py`), checked before it is rewritten.
CACHE_SALT_MAX_LENGTH = 128
CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")


def check_part(part: dict, param: str) -> bool:
    """Whether a content part names a uuid (a 400 naming it when it is not a string)."""
    value = part.get(FIELD)
    if value is None:
        return False
    if not isinstance(value, str):
        raise errors.invalid_request(
            f"Invalid type for '{param}.{FIELD}': expected a string.",
            param=f"{param}.{FIELD}",
            code="invalid_type",
        )
    return True


def named_in(payload: dict) -> bool:
    """Whether any content part of a chat body names a uuid (the body is checked already)."""
    for message in payload.get("messages") or ():
        content = message.get("content")
        if isinstance(content, list) and any(part.get(FIELD) is not None for part in content):
            return True
    return False


def scoped_uuid(scope: str, uuid: str) -> str:
    """What the engine gets for `uuid` named by the caller `scope`: the same for the same two, never another's."""
    # NOTE: "surrogatepass": JSON may carry a lone surrogate ("\ud800"), which plain UTF-8 refuses.
    return hmac.new(scope.encode(), uuid.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()


def scoped(payload: dict, scope: str) -> dict:
    """A copy of a chat body whose content parts' uuids are `scoped_uuid(scope, uuid)`; the body itself is left as
    it is (a batch line may run again)."""
    messages = []
    for message in payload["messages"]:
        content = message.get("content")
        if isinstance(content, list) and any(part.get(FIELD) is not None for part in content):
            content = [
                part | {FIELD: scoped_uuid(scope, part[FIELD])} if part.get(FIELD) is not None else part
                for part in content
            ]
            message = message | {"content": content}
        messages.append(message)
    return payload | {"messages": messages}


def check_cache_salt(payload: dict) -> bool:
    """Whether a body names a `cache_salt` (a 400 when vLLM would refuse it)."""
    salt = payload.get(CACHE_SALT)
    if salt is None:
        return False
    if not isinstance(salt, str) or not salt or len(salt) > CACHE_SALT_MAX_LENGTH or not CACHE_SALT_FORBIDDEN.isdisjoint(
            salt):
        raise errors.invalid_request(
            f"'{CACHE_SALT}' must be a non-empty string of at most {CACHE_SALT_MAX_LENGTH} characters, without '@', "
            "'/', '\\' or NUL.",
            param=CACHE_SALT,
        )
    return True


def scoped_cache_salt(payload: dict, scope: str) -> dict:
    """A copy of a body whose `cache_salt` is scoped to the caller `scope`, as a media part's uuid is."""
    return payload | {CACHE_SALT: scoped_uuid(scope, payload[CACHE_SALT])}
