"""Usage journal segments shipped to the files bucket while PostgreSQL stays down, and replayed from there.

The usage journal (`billing.usage_journal`) is on the pod's scratch volume: it survives a container restart, not the
pod. A pod deleted during a database outage (a rollout, a scale-down: a pod whose journal is full is not ready, and
Kubernetes removes those first; a lost node) took its journal along, and every call it had answered meanwhile went
unbilled. So once the ledger has refused writes for `INFERPLANE_USAGE_JOURNAL_SHIP_AFTER_S`, and whenever a process
stops with segments it could not replay, each sealed segment this process may take is uploaded to the files bucket
(`usage-journal/<segment name>`, the name unique to its host, process and time) and deleted here only once the bucket
has it. The scheduler's worker replays the bucket's segments every minute (`replay_shipped`, the task
`billing.replay_shipped_usage`) and deletes each after its rows are in the ledger.

Exactly once: every row is written by its request id (the ledger's unique constraint), so a segment replayed twice (a
process killed between its upload and its local delete, a task run twice) counts once. Rows the ledger refuses (their
endpoint is gone) go to `usage-journal-rejected/`, signed, as the local replay's go to `rejected.jsonl`; `manage.py
replay_rejected_usage` replays them (`replay_rejected`), each row once, after a release that reads them.

The bucket is not trusted with money: whoever may write there could otherwise forge usage for any organisation at any
price. Each object is shipped with two HMACs keyed by the platform's secret (`SECRET_KEY`, its fallbacks accepted on
replay), and one whose signature does not match is never written into the ledger: it is kept under the rejected
prefix, with an error logged.
- `KEYED_SIGNATURE` covers its key and its bytes: an object copied under another name with its metadata (a set-aside
  object copied back under the shipped prefix, to be replayed before an operator chose to) is refused. This release
  requires it on every object that carries it.
- `SIGNATURE`, the field the previous release reads, covers the bytes alone (`_LEGACY_SIGNATURE_SALT`), as that
  release wrote it: a worker rolled back past this release still verifies and bills what this one shipped (before,
  it found no signature of its own and set every such object aside unsigned, billed by no release). It is accepted
  alone only on an object without `KEYED_SIGNATURE` (one the previous release wrote).
What this buys, truly: accidental copies (`aws s3 cp` and the like keep an object's metadata) are refused. A deliberate
copier who strips `KEYED_SIGNATURE` is not: that copy is read as the previous release's, but it holds rows this
platform wrote, each billed once by its request id (the ledger's unique constraint): replayed twice, it counts once.
Nobody without `SECRET_KEY` can sign new bytes either way. The legacy field can go (written and read) once no worker
may be rolled back past this release and every bucket has been replayed by it (`replay_shipped_usage` runs every
minute; `replay_rejected_usage` re-signs what it moves).

What a pod's replays set aside (`rejected.jsonl`) may grow large in a long outage: it goes in parts of at most
`SET_ASIDE_PART_BYTES`, one object each, read from the file one part at a time and cut off it once the bucket has
that part (`UsageJournal.hand_over_set_aside`): a put that fails leaves here exactly what the bucket lacks.

A bucket that cannot be reached changes nothing: the segments stay in the local journal, bounded as before. The
client has short timeouts and few retries: shipping runs on the writer's replay loop and in a process's shutdown.
"""

from __future__ import annotations

import functools
import io
import logging
import os
import socket
import time

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError
from django.conf import settings
from django.db import DataError, IntegrityError
from django.utils.crypto import constant_time_compare, salted_hmac

from billing.ledger import UnknownEndpointError, supersede_lost_rows
from billing.quota import replayed
from billing.usage_journal import REJECTED_NAME, UsageJournal, count_set_aside, read_segment, set_aside

logger = logging.getLogger("inferplane.billing")

PREFIX = "usage-journal/"
REJECTED_PREFIX = "usage-journal-rejected/"
REPLAY_BATCH = 500  # rows a statement, as the gateway's writer (`usage_writer.MAX_BATCH`)
CONNECT_TIMEOUT_S, READ_TIMEOUT_S, ATTEMPTS = 3, 10, 2
# The longest one upload is taken to run before it fails (a pod's grace period leaves room for it:
# infra/k8s/base/web.yaml): its attempts' connect and read timeouts and the standard retry mode's pause between them
# (at most 1 s). NOTE: an assumption, not a bound: botocore's timeouts bound each socket operation (a connect is tried
# per address the bucket's name resolves to), not a whole put; the README says what a slower bucket does.
RETRY_PAUSE_MAX_S = 1
ONE_PUT_BOUND_S = ATTEMPTS * (CONNECT_TIMEOUT_S + READ_TIMEOUT_S) + (ATTEMPTS - 1) * RETRY_PAUSE_MAX_S
_CLIENT_CONFIG = Config(connect_timeout=CONNECT_TIMEOUT_S, read_timeout=READ_TIMEOUT_S,
                        retries={"max_attempts": ATTEMPTS, "mode": "standard"})
FAILURES = (BotoCoreError, ClientError, OSError)
# The most one object of a pod's set-aside lines holds (`ship_set_aside`): a put of it fits its timeouts, and it is
# read into memory one part at a time. A single line longer than this (the journal writes none: a report is ~1 KiB)
# goes whole, alone.
SET_ASIDE_PART_BYTES = 8 * 1024 * 1024
# The object's metadata. NOTE: `SIGNATURE` keeps the name and the meaning (the bytes alone) the previous release reads.
SIGNATURE = "inferplane-signature"
KEYED_SIGNATURE = "inferplane-keyed-signature"  # `_signature` of its key and bytes
_SIGNATURE_SALT = "billing.journal_shipping.keyed"
_LEGACY_SIGNATURE_SALT = "billing.journal_shipping"


def _signature(key: str, data: bytes, secret: str | None = None) -> str:
    """The HMAC of an object's key and bytes: the key's length first, so no key and bytes read as another's."""
    named = f"{len(key)}:{key}\n".encode() + data
    return salted_hmac(_SIGNATURE_SALT, named, secret=secret, algorithm="sha256").hexdigest()


def _legacy_signature(data: bytes, secret: str | None = None) -> str:
    """The HMAC of an object's bytes alone, as the previous release signs and verifies it."""
    return salted_hmac(_LEGACY_SIGNATURE_SALT, data, secret=secret, algorithm="sha256").hexdigest()


def _signatures(key: str, data: bytes) -> dict[str, str]:
    """The metadata of an object this platform writes: both signatures (see the module's docstring)."""
    return {KEYED_SIGNATURE: _signature(key, data), SIGNATURE: _legacy_signature(data)}


def _signed(key: str, data: bytes, metadata: dict[str, str]) -> bool:
    """Whether `metadata` holds this platform's signature of `data` under `key`; the bytes-only one counts only on an
    object without a keyed one (the previous release's)."""
    secrets = (settings.SECRET_KEY, *settings.SECRET_KEY_FALLBACKS)
    if KEYED_SIGNATURE in metadata:
        return any(constant_time_compare(metadata[KEYED_SIGNATURE], _signature(key, data, secret)) for secret in secrets)
    return any(constant_time_compare(metadata.get(SIGNATURE, ""), _legacy_signature(data, secret)) for secret in secrets)


@functools.cache
def _client():
    return boto3.client("s3", endpoint_url=settings.FILES_S3_ENDPOINT_URL, region_name=settings.FILES_S3_REGION,
                        config=_CLIENT_CONFIG)


def enabled() -> bool:
    return settings.USAGE_JOURNAL_SHIP


# Set once this process stops (`stop_shipping_by`): no upload begins, in any thread, that could end past it.
_stopping_by: float | None = None


def stop_shipping_by(deadline: float) -> None:
    """This process stops: from now no upload begins, in any thread, that could end past `deadline`
    (`time.monotonic()`).

    NOTE: before, a replay loop that had begun shipping an outage's segments (`UsageWriter`, after
    `USAGE_JOURNAL_SHIP_AFTER_S`) went on in its executor thread when its task was cancelled at the gateway's stop, past
    the stop's bound, and the loop's close waited for that thread (uvloop/asyncio join their default executor) until
    the grace period's SIGKILL cut an upload (found by this stop's third review)."""
    global _stopping_by
    _stopping_by = deadline if _stopping_by is None else min(_stopping_by, deadline)


def no_time_for_a_put(deadline: float | None = None) -> bool:
    """Whether an upload begun now could end past `deadline` or this process's stop (`stop_shipping_by`)."""
    bounds = [bound for bound in (deadline, _stopping_by) if bound is not None]
    return bool(bounds) and min(bounds) - time.monotonic() < ONE_PUT_BOUND_S


def ship(journal: UsageJournal, *, deadline: float | None = None) -> int:
    """Upload every segment of `journal`'s folder this process may take (sealed: its own, and dead processes'),
    deleting each here once the bucket has it, then what was set aside (`ship_set_aside`); returns how many segments
    went. A live writer's segment is left to it. With a `deadline` (`time.monotonic()`, a process about to stop): no
    upload begins that could end past it (`ONE_PUT_BOUND_S`), and the set-aside lines are left to the caller
    (`usage_writer.ship_what_is_left`). Blocking I/O: call it from a worker thread."""
    if not enabled():
        return 0
    num_shipped = 0
    for path in journal.list_segments():
        if no_time_for_a_put(deadline):
            logger.warning("usage journal: no time left to ship %s before this process stops; it stays here",
                           path.name)
            return num_shipped
        with journal.claim(path) as handle:
            if handle is None:
                continue
            handle.seek(0)
            data = handle.read()
            if data:
                try:
                    _client().put_object(Bucket=settings.FILES_S3_BUCKET, Key=PREFIX + path.name, Body=data,
                                         Metadata=_signatures(PREFIX + path.name, data))
                except FAILURES as exc:
                    logger.warning("usage journal: could not ship %s to the files bucket (%r); it stays here",
                                   path.name, exc)
                    return num_shipped
            journal.done(path, [])
            num_shipped += 1
            logger.warning("usage journal: %s (%d bytes) shipped to the files bucket; the worker replays it",
                           path.name, len(data))
    if deadline is None and _stopping_by is None:
        ship_set_aside(journal)
    return num_shipped


class _NoTimeLeft(Exception):
    """A set-aside part not begun: its upload could end past this process's stop (`stop_shipping_by`)."""


def ship_set_aside(journal: UsageJournal) -> int:
    """Upload what this pod's replays set aside (`rejected.jsonl`, on the pod's volume, gone with it) to the rejected
    prefix, signed, in parts of at most `SET_ASIDE_PART_BYTES` each under a name of this host's, process's and time's,
    cutting each part off the file once the bucket has it; returns the bytes shipped. A put that fails leaves here
    exactly the lines no object holds. Once this process stops (`stop_shipping_by`), no part begins whose upload could
    end past it: the rest stays here. `manage.py replay_rejected_usage` replays them. Blocking I/O: call it from a
    worker thread."""
    if not enabled():
        return 0
    num_shipped = [0]

    def upload(data: bytes) -> None:
        # NOTE: before each part, in whichever thread ships them: before, once begun (a replay loop's `ship` in an
        # outage, the daemon shipper) every part went, each up to `ONE_PUT_BOUND_S`, past the stop's bound, and the
        # loop's close waited for its executor thread (found by the fourth review of this shipping).
        if no_time_for_a_put():
            raise _NoTimeLeft
        key = f"{REJECTED_PREFIX}{socket.gethostname()}-{os.getpid()}-{time.time_ns()}-{REJECTED_NAME}"
        _client().put_object(Bucket=settings.FILES_S3_BUCKET, Key=key, Body=data,
                             Metadata=_signatures(key, data))
        num_shipped[0] += len(data)

    try:
        num_bytes = journal.hand_over_set_aside(upload, max_part_bytes=SET_ASIDE_PART_BYTES)
    except _NoTimeLeft:
        logger.warning("usage journal: no time left to ship the rest of %s before this process stops (%d bytes went); "
                       "it stays here", REJECTED_NAME, num_shipped[0])
        return num_shipped[0]
    except FAILURES as exc:
        logger.warning("usage journal: could not ship all of %s to the files bucket (%r; %d bytes went); the rest "
                       "stays here", REJECTED_NAME, exc, num_shipped[0])
        return num_shipped[0]
    if num_bytes:
        logger.warning("usage journal: %s (%d bytes) shipped to the bucket's %s", REJECTED_NAME, num_bytes,
                       REJECTED_PREFIX)
    return num_bytes


def replay_shipped() -> int:
    """Write every shipped segment's rows into the ledger and delete it from the bucket; returns the rows written
    now. Raises while the database or the bucket cannot be read: the next run tries again."""
    if not enabled():
        return 0
    num_written = 0
    paginator = _client().get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=settings.FILES_S3_BUCKET, Prefix=PREFIX):
        for item in page.get("Contents", []):
            num_written += _replay_one(item["Key"])
    return num_written


def _gone(exc: ClientError) -> bool:
    return exc.response.get("Error", {}).get("Code") in {"NoSuchKey", "404"}


def _replay_one(key: str) -> int:
    try:
        answer = _client().get_object(Bucket=settings.FILES_S3_BUCKET, Key=key)
    except ClientError as exc:
        # NOTE: another run replayed (and deleted) it since it was listed: the beat's `replay_shipped_usage` taking
        # the segment `replay_rejected_usage` had just moved back. Its rows are written: nothing left to do here.
        if not _gone(exc):
            raise
        logger.info("usage journal: the bucket's %s was replayed by another run", key)
        return 0
    body = answer["Body"].read()
    if not _signed(key, body, answer.get("Metadata") or {}):
        logger.error("usage journal: the bucket's %s is not signed by this platform: not written, kept in %s", key,
                     REJECTED_PREFIX)
        _set_aside(key, body, signed=False)
        _client().delete_object(Bucket=settings.FILES_S3_BUCKET, Key=key)
        return 0
    handle = io.BytesIO(body)
    handle.name = key
    segment = read_segment(handle)
    reports = segment.reports
    num_written, rejected = 0, []
    for first in range(0, len(reports), REPLAY_BATCH):
        batch = reports[first:first + REPLAY_BATCH]
        registration = None
        try:
            registration = replayed.register_replaying_sync(batch)
        except Exception as exc:  # noqa: BLE001 - the ledger comes first: a counter rebuilt meanwhile may count one twice
            logger.warning("usage journal: %d shipped row(s) replayed unregistered (%r)", len(batch), exc)
        try:
            written = replayed.record_registered_batch(batch)
        except UnknownEndpointError as exc:
            written = exc.written_ids
            refused = set(exc.refused_ids)
            rejected += [report for report in batch if report.request_id in refused]
        except (DataError, IntegrityError) as exc:
            # NOTE: rows the ledger refuses for what they hold are set aside, as the local replay does: left, the
            # segment failed every run, and every segment listed after it waited for ever.
            logger.error("usage journal: a shipped batch refused by the ledger (%r) set aside", exc)
            rejected += batch
            continue
        num_written += len(written)
        # NOTE: as the gateway's replay (`usage_writer`): what was written now, and what a killed replay left owed
        replayed.count_replayed(written, batch=batch, registration=registration)
        with replayed.bounded_write():  # raises past its timeout: the segment waits, registered again next run
            lost_costs = supersede_lost_rows(batch, written)
        replayed.count_superseded(lost_costs, registered=registration is not None)
    if rejected or segment.unreadable:
        _set_aside(key, set_aside(rejected, segment.unreadable))
        count_set_aside(rejected, segment.unreadable)
        logger.error("usage journal: %d shipped report(s) refused by the ledger and %d line(s) unreadable kept in %s",
                     len(rejected), len(segment.unreadable), REJECTED_PREFIX)
    _client().delete_object(Bucket=settings.FILES_S3_BUCKET, Key=key)
    logger.info("usage journal: %d report(s) replayed from the bucket's %s (%d new)", len(reports), key, num_written)
    return num_written


def _set_aside(key: str, data: bytes, *, signed: bool = True) -> None:
    """Keep `data` under the rejected prefix; signed (as a shipped segment) unless it came unsigned: only a signed one
    is ever replayed (`replay_rejected`)."""
    kept = REJECTED_PREFIX + key.removeprefix(PREFIX)
    metadata = _signatures(kept, data) if signed else {}
    _client().put_object(Bucket=settings.FILES_S3_BUCKET, Key=kept, Body=data, Metadata=metadata)


def replay_rejected() -> tuple[int, list[str]]:
    """Replay what the rejected prefix keeps (`manage.py replay_rejected_usage`): lines an older version could not read,
    rows the ledger refused (their endpoint gone) and the gateways' own set-aside (`ship`). Each signed object goes back
    under the shipped prefix and is replayed as a shipped segment (`_replay_one`): what this version reads is written,
    each row once (the ledger's request ids: replayed twice, or already written, it counts once); what it still cannot
    read, or the ledger still refuses, is set aside again. Returns the rows written and the keys left as they were
    (not signed by this platform: never billed)."""
    if not enabled():
        return 0, []
    num_written, unsigned = 0, []
    paginator = _client().get_paginator("list_objects_v2")
    keys = [item["Key"] for page in paginator.paginate(Bucket=settings.FILES_S3_BUCKET, Prefix=REJECTED_PREFIX)
            for item in page.get("Contents", [])]
    for key in keys:
        try:
            answer = _client().get_object(Bucket=settings.FILES_S3_BUCKET, Key=key)
        except ClientError as exc:  # another `replay_rejected_usage` moved it since the listing
            if not _gone(exc):
                raise
            continue
        body = answer["Body"].read()
        if not _signed(key, body, answer.get("Metadata") or {}):
            unsigned.append(key)
            continue
        shipped = PREFIX + key.removeprefix(REJECTED_PREFIX)
        # NOTE: shipped before the rejected copy goes: a run stopped between the two replays it (each row once).
        # Signed again for its new key: the signature binds an object to its name.
        _client().put_object(Bucket=settings.FILES_S3_BUCKET, Key=shipped, Body=body,
                             Metadata=_signatures(shipped, body))
        _client().delete_object(Bucket=settings.FILES_S3_BUCKET, Key=key)
        num_written += _replay_one(shipped)
    return num_written, unsigned
