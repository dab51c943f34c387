"""`Idempotency-Key` on the `/v1` creations that cost money: `POST /v1/batches` and `POST /v1/files`.

A client that timed out and sent its creation again made a second batch: its lines ran, and were billed, twice. A
request naming a key (Stripe's header and rules, which SDKs send on retried `POST`s) now creates at most one object:

- The key is the caller's (`Caller.limit_subject`: the API key, or the console session's user) within its
  organisation, kept `KEPT_FOR` from its first use; the same value from another key, or another organisation, is
  another key. At most 255 printable ASCII characters, else a 400.
- The first request claims it (`begin`: a row inserted under a unique constraint), and the creation saves its answer
  in the transaction that creates the object (`save_answer`): a committed object always has its answer saved, a
  creation that failed saves nothing and frees the key (`held`), so a retry runs afresh. NOTE: Stripe also saves an
  error once its endpoint began; here a refusal or a failure wrote nothing (the creation is one transaction), and
  pinning a transient refusal (quota, open batches, an outage) to the key for a day would only stop the retry.
- A request sending the key again, with the same request (`request_digest`), gets the saved answer: the same status
  and body as the first (the object as it was created, Stripe's replay), with `Idempotent-Replayed: true`; with
  another request, a 422 `idempotency_key_reused`; while the first still runs, a 409 `idempotency_key_in_use`
  (Stripe's answer to concurrent requests; the openai client retries a 409).
- A claim is a lease (`locked_until`, by PostgreSQL's clock) of `IDEMPOTENCY_LEASE_S`, renewed every third of it while
  its creation goes on (`held`): the claim of a process that died lapses within the lease, and the next request takes
  the key over. NOTE: an upload's claim was held an hour (as long as its row may take to be stored): a client whose
  upload's web process died mid-upload got a 409 for its retry for an hour.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.db import DatabaseError, IntegrityError, transaction
from django.db.models import Q
from django.db.models.functions import Now

from endpoints.batches import renewal
from endpoints.batches.models import IdempotentRequest
from endpoints.gateway import errors
from endpoints.gateway.auth import Caller

logger = logging.getLogger("inferplane.batches")

HEADER = "Idempotency-Key"
MAX_KEY_LENGTH = 255
# How long a key names its creation (Stripe keeps them at least 24 hours): swept after by `sweep_expired`.
KEPT_FOR = timedelta(hours=24)
NUM_SWEPT_PER_RUN = 1000


def key_of(headers: Mapping[str, str]) -> str | None:
    """The `Idempotency-Key` of a request whose `headers` are given (Django's `request.headers`, or the gateway's, their
    names lower case; None when it sends none), or a 400 in OpenAI's shape for a value that is not a key (`is_key`)."""
    key = headers.get(HEADER.lower())
    if key is None:
        return None
    if not is_key(key):
        raise errors.invalid_request(
            f"The {HEADER} header must be 1 to {MAX_KEY_LENGTH} printable ASCII characters.",
            param=HEADER,
            code="invalid_idempotency_key",
        )
    return key


def is_key(value: str) -> bool:
    """Whether `value` may be an idempotency key: 1 to 255 printable ASCII characters."""
    return 1 <= len(value) <= MAX_KEY_LENGTH and all(" " <= character <= "~" for character in value)


def request_digest(method: str, path: str, *parts: bytes | str) -> str:
    """What a request asks for, compared when its key is sent again: its method, path and `parts` (a batch's body, an
    upload's purpose and file digest)."""
    digest = hashlib.sha256()
    for part in (method, path, *parts):
        part = part.encode() if isinstance(part, str) else part
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    return digest.hexdigest()


@dataclass(slots=True)
class Claim:
    """A key this request holds while it creates: `save_answer` in the creating transaction, or `release`."""

    pk: int
    token: str
    request_digest: str  # "" until known (an upload's, once its file is read)


@dataclass(slots=True)
class Saved:
    """The answer saved under a key by the request that first used it."""

    request_digest: str
    status: int
    body: dict

    def answer_for(self, digest: str) -> tuple[int, dict]:
        """The saved status and body, for a request asking for the same (`digest`); a 422 for another."""
        if digest != self.request_digest:
            raise reused()
        return self.status, self.body


def reused() -> errors.OpenAIError:
    return errors.OpenAIError(
        422,
        f"This {HEADER} was used with another request: a key may only be sent again with "
        "the same request (method, path and body; for a file, its bytes and purpose).",
        param=HEADER,
        code="idempotency_key_reused",
    )


class InProgress(errors.OpenAIError):
    """Another request holds the key: it is creating now (or took the key over from this one, whose claim lapsed)."""

    def __init__(self):
        super().__init__(
            409,
            f"A request with this {HEADER} is still in progress: send it again later to get its answer.",
            param=HEADER,
            code="idempotency_key_in_use",
            headers={"retry-after": "1"},
        )


def begin(caller: Caller, key: str, *, digest: str) -> Claim | Saved:
    """Claim `key` for a creation this request makes (`Claim`, leased for `IDEMPOTENCY_LEASE_S`: create under `held`),
    or the answer saved under it (`Saved`). Raises `InProgress` while another request holds it, and the 422 of
    `reused` when that one is known to ask for something else. A key past `KEPT_FOR`, or whose lease lapsed, is taken
    over."""
    token, lease = secrets.token_hex(16), _lease()
    try:
        with transaction.atomic():
            row = IdempotentRequest.objects.create(
                organization_id=caller.organization_id,
                subject=caller.limit_subject,
                key=key,
                request_digest=digest,
                token=token,
                locked_until=Now() + lease,
            )
        return Claim(row.pk, token, digest)
    except IntegrityError:
        pass  # NOTE: the unique constraint: another request inserted it first (it waited for that one's commit)
    rows = IdempotentRequest.objects.filter(
        organization_id=caller.organization_id, subject=caller.limit_subject, key=key
    )
    row = rows.first()
    if row is None:  # swept between the insert and this read: the next request claims it
        raise InProgress()
    stale = Q(created_at__lt=Now() - KEPT_FOR) | Q(response_status__isnull=True, locked_until__lt=Now())
    if (
        rows.filter(pk=row.pk, token=row.token)
        .filter(stale)
        .update(
            token=token,
            request_digest=digest,
            locked_until=Now() + lease,
            created_at=Now(),
            response_status=None,
            response_body=None,
        )
    ):
        return Claim(row.pk, token, digest)
    row.refresh_from_db()
    if row.response_status is None:
        if digest and row.request_digest and digest != row.request_digest:
            raise reused()
        raise InProgress()
    return Saved(row.request_digest, row.response_status, row.response_body)


def save_answer(claim: Claim, body: dict, *, status: int = 200) -> None:
    """Save the answer of the object created under `claim`, in the transaction that creates it; raises `InProgress`
    (rolling the creation back) when the claim lapsed and another request took the key over."""
    if not IdempotentRequest.objects.filter(
        pk=claim.pk, token=claim.token, response_status__isnull=True
    ).update(
        request_digest=claim.request_digest, response_status=status, response_body=body, locked_until=Now()
    ):
        raise InProgress()


def release(claim: Claim) -> None:
    """Free the key of a creation that failed (it saved nothing): the next request with it runs afresh."""
    try:
        IdempotentRequest.objects.filter(
            pk=claim.pk, token=claim.token, response_status__isnull=True
        ).delete()
    except DatabaseError:
        logger.warning("could not free idempotency key %s: it lapses with its claim", claim.pk, exc_info=True)


def renew(claim: Claim) -> bool:
    """Lease the key of a creation still going on for `IDEMPOTENCY_LEASE_S` more; False when its claim is no longer
    this creation's (its answer saved, the key freed, or taken over once its lease lapsed)."""
    return bool(
        IdempotentRequest.objects.filter(pk=claim.pk, token=claim.token, response_status__isnull=True).update(
            locked_until=Now() + _lease()
        )
    )


@contextmanager
def held(claim: Claim | None):
    """The creation under `claim` (or under no key): its claim renewed every third of `IDEMPOTENCY_LEASE_S` while it
    goes on (an upload streams to S3 for as long as it takes), the key freed when it fails."""
    if claim is None:
        yield None
        return
    try:
        with renewal.Renewal(
            lambda: renew(claim), lease_s=settings.IDEMPOTENCY_LEASE_S, name=f"idempotency key {claim.pk}"
        ):
            yield claim
    except BaseException:
        release(claim)
        raise


def _lease() -> timedelta:
    return timedelta(seconds=settings.IDEMPOTENCY_LEASE_S)


def sweep_expired() -> int:
    """Delete keys used over `KEPT_FOR` ago (by PostgreSQL's clock), the oldest `NUM_SWEPT_PER_RUN`; a request reads
    them as gone already, so this only frees their room. Returns how many it deleted."""
    expired = IdempotentRequest.objects.filter(created_at__lt=Now() - KEPT_FOR)
    oldest = list(expired.order_by("created_at").values_list("pk", flat=True)[:NUM_SWEPT_PER_RUN])
    return expired.filter(pk__in=oldest).delete()[0] if oldest else 0
