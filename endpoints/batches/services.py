"""Writes for files and batches: upload, delete, create, cancel, and a batch's whole run (validate,
run its lines, finalize), each safe to call twice.

A batch is worked on by one worker at a time: `run_batch` claims it with a conditional update on its
lease (`lease_until`, renewed every second while it runs); a worker killed mid-run leaves the lease to
lapse and the batch tick (`tick`) queues a new run, which skips the lines whose results are already in
S3 and re-runs the rest under the same request ids (never billed twice: `runner.line_request_id`).

Nothing a dead run leaves in S3 outlives it unnamed: output and error files have their rows (uploads
in progress until the batch ends with them) before their bytes, and line results are deleted once the
batch has ended, stamped `results_deleted_at`, or later by `sweep_ended_results`.
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import secrets
import time
from collections.abc import Container, Iterable, Iterator
from datetime import UTC, datetime, timedelta

from botocore.exceptions import BotoCoreError, ClientError
from django.conf import settings
from django.db import DatabaseError, close_old_connections, connection, transaction
from django.db.models import BigIntegerField, F, Q, Sum, Window
from django.db.models.expressions import CombinedExpression
from django.db.models.functions import Greatest, Now, RowNumber
from django.utils import timezone

from billing import usage_writer
from billing.models import UsageRecord, UsageStatus
from controlplane.accounts import keys
from controlplane.accounts.models import ApiKey, Membership, Organization, Role, Scope
from controlplane.clock import DatabaseClock, database_now, database_time_ago
from controlplane.redis_client import get_redis
from controlplane.redis_keys import ABANDONED_SWEEP_PAUSED_KEY, batch_dispatch_key
from controlplane.tasks import send_task
from controlplane.text import storable
from controlplane.worker_threads import on_database_thread, run_briefly
from endpoints.adapters import parse_model_name
from endpoints.batches import idempotency, renewal, runner, scheduling, storage
from endpoints.batches.demand import read_demand
from endpoints.batches.models import (
    BATCH_PATHS,
    COMPLETION_WINDOWS,
    FINAL_STATES,
    OPEN_STATES,
    UPLOAD_ABANDONED_AFTER,
    Batch,
    BatchStatus,
    File,
    FilePurpose,
    new_file_id,
)
from endpoints.batches.validation import Line, LineError, first_model, parse_lines, read_lines
from endpoints.events import record_event_once
from endpoints.gateway import embeddings, errors
from endpoints.gateway.auth import Caller
from endpoints.models import Adapter, Endpoint, EventKind, Replica
from gpu_agent.protocol import ReplicaState

logger = logging.getLogger("inferplane.batches")

RUN_BATCH_TASK = "batches.run_batch"
MAX_DISPATCHED_PER_TICK = 500
# How long a queued run of a batch stands for it (`dispatch`): no other is queued meanwhile, and one not started by
# then is dropped by the worker that takes it (`expires`). NOTE: it stood for the lease's 30 s only: a batch waiting
# in a long queue was queued again every 30 s, and one tenant's hundreds of open batches grew the queue without end.
# Ended early by the run's end (`_release`) or its death (`tick`); a queue lost with Redis is refilled after this.
DISPATCH_HELD_S = 300
# A run that found its endpoint's slots all taken by interactive calls (`runner.NO_SLOT_GIVE_UP_S`) gives its worker
# back; its batch is queued again this long after.
FULL_RETRY_S = 10
# A run S3 failed (down, or refusing the fleet an input still stored: `ObjectGone` not `missing`) queues its batch again
# this long after. NOTE: released with no pause, the next tick (`BATCH_TICK_S`, 2 s) queued it again for its whole
# window (a day): ~43,000 S3 reads refused, error logs and worker runs a batch, every batch of the bucket at once.
S3_FAILED_RETRY_S = 60
# The abandoned-upload sweep waits this long after S3 refused or failed one of its deletes (`sweep_abandoned_uploads`).
ABANDONED_SWEEP_PAUSE_S = 300
# A batch whose validation began this many times and never ended (the worker killed or the check
# failing) fails: before, it was queued again every tick for ever. An attempt S3 failed (down, or refusing the
# fleet an input still stored) is not counted: its window ends such a batch (`validate_batch`).
MAX_VALIDATION_ATTEMPTS = 3
# How long a run holds its lease while it reads and checks the input file: the longest read a run is given.
INPUT_READ_LEASE_S = 600
# What a run leaves, after its lines' deadline, for writing the batch's files.
RUN_FINISH_MARGIN_S = 180
# A run task's time limit (`tasks.run_batch`): the input's read, its lines (`runner.LINES_END_WITHIN_S` counted from
# the read's end) and the files.
# NOTE: the lines' time was counted from the task's start: a run whose read of a large input took over 120 s
# (50,000 lines of many short messages: ~25 s to check on a quiet 2-core machine, twice in a batch's first run)
# had no time left to start a line, and every later run read as long: the batch stalled until it expired.
RUN_TIME_LIMIT_S = INPUT_READ_LEASE_S + int(runner.LINES_END_WITHIN_S) + RUN_FINISH_MARGIN_S
# The line results of a batch that ended longer ago than this, still in S3 (its run died, or S3 failed,
# between ending it and deleting them), are deleted by `sweep_ended_results`: longer than a run's time
# limit (`RUN_TIME_LIMIT_S`, 25 minutes), so no worker still writes one.
RESULTS_SWEPT_AFTER = timedelta(minutes=30)
NUM_RESULTS_SWEPT_PER_RUN = 50
# S3's unfinished multipart uploads of files begun longer ago than this are aborted by `sweep_incomplete_uploads`: an
# hour past the longest any live one lasts (an upload's row is swept after `UPLOAD_ABANDONED_AFTER`, whose bytes are
# refused once it ends; a batch's output files go up within its run's `RUN_TIME_LIMIT_S`).
INCOMPLETE_UPLOADS_ABORTED_AFTER = (max(UPLOAD_ABANDONED_AFTER, timedelta(seconds=RUN_TIME_LIMIT_S))
                                    + timedelta(hours=1))


class Refused(Exception):
    """A request the API answers with a 400 (or `status`) naming `param`; `lasting` when a retry within seconds would
    be refused the same (a 409 or 429 the OpenAI clients would otherwise retry by themselves: `api._refusal`)."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400, code: str | None = None,
                 lasting: bool = False):
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.lasting = message, param, status, code, lasting


# --- files -----------------------------------------------------------------------------------

def create_file(*, organization_id: int, purpose: str, filename: str, stream, size: int) -> File:
    """Store a file of `size` bytes read from `stream` within the organisation's storage quota (`max_file_bytes`):
    `start_upload`, its bytes to S3, `finish_upload`. A failed upload takes its row back."""
    refuse_unknown_purpose(purpose)
    file = start_upload(organization_id=organization_id, filename=filename, size=size)
    try:
        with upload_held(file):
            storage.put_stream(file.s3_key, stream)
    except BaseException:
        abandon_upload(file)
        raise
    return finish_upload(file, size=size)


def refuse_unknown_purpose(purpose: str) -> None:
    if purpose != FilePurpose.BATCH:
        raise Refused("Only purpose 'batch' can be uploaded.", param="purpose")


# OpenAI's bounds on a file's `expires_after.seconds`: an hour to 30 days.
FILE_EXPIRY_S = (3600, 30 * 24 * 3600)


def file_expiry(anchor: object, seconds: object, *, param: str = "expires_after") -> timedelta | None:
    """An `expires_after` (OpenAI's, of an upload or a batch's `output_expires_after`: anchor `created_at`, seconds
    within `FILE_EXPIRY_S`, a number or, from a form, its digits) as the time its file lives, or None when none was
    sent; `Refused` naming `param` otherwise.

    NOTE: the field was ignored: a tenant whose client asked for its file to go after an hour had it kept for good."""
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise Refused(f"{param}.anchor must be 'created_at'.", param=param)
    if isinstance(seconds, str) and seconds.isascii() and seconds.isdigit() and len(seconds) <= 9:
        # NOTE: no `int()` of more digits: past 4,300 it raises ValueError (Python's limit), and that was a 500
        seconds = int(seconds)
    low, high = FILE_EXPIRY_S
    if not isinstance(seconds, int) or isinstance(seconds, bool) or not low <= seconds <= high:
        raise Refused(f"{param}.seconds must be a whole number from {low} to {high}.", param=param)
    return timedelta(seconds=seconds)


def start_upload(*, organization_id: int, filename: str, size: int) -> File:
    """The row of an upload of at most `size` bytes about to be stored, or `Refused` past the size limit or the
    organisation's storage quota (`max_file_bytes`).

    The row is an upload in progress that counts `size` against the quota from now on, checked and written under the
    organisation's row lock, so concurrent uploads never overshoot it, for as long as its lease lasts
    (`FILES_UPLOAD_LEASE_S`, renewed while its process works on it: `upload_held`). Its bytes go to S3 after, outside
    any transaction (`file.s3_key`); then `finish_upload`, or `abandon_upload`. One whose process died stops counting
    once its lease lapses, and is swept by `tick`."""
    if size > settings.FILES_MAX_BYTES:
        raise Refused(f"The file is larger than {settings.FILES_MAX_BYTES} bytes.", param="file", status=413)
    file_id = new_file_id()
    with transaction.atomic():
        _refuse_past_storage_quota(organization_id, size, param="file", doing="")
        _refuse_closed(organization_id)  # NOTE: under the row lock the quota's check took
        # NOTE: its start by PostgreSQL's clock, which the abandoned-upload sweep judges its age by
        return File.objects.create(id=file_id, organization_id=organization_id, purpose=FilePurpose.BATCH,
                                   filename=(filename or "upload.jsonl")[:255], bytes=size,
                                   s3_key=storage.file_key(organization_id, file_id), stored_at=None,
                                   upload_lease_until=Now() + _upload_lease(), created_at=database_now())


def upload_held(file: File) -> renewal.Renewal:
    """The lease of an upload in progress, renewed by a thread every third of `FILES_UPLOAD_LEASE_S` from `start` (or
    a `with` block) to `stop`: it keeps counting against the storage quota however long S3 takes with a part or
    with its completion."""
    return renewal.Renewal(lambda: renew_upload(file), lease_s=settings.FILES_UPLOAD_LEASE_S, name=f"upload {file.pk}")


def renew_upload(file: File) -> bool:
    """Lease an upload in progress for `FILES_UPLOAD_LEASE_S` more: it keeps counting against the storage quota. False
    when it is no longer in progress (stored, taken back or swept)."""
    return bool(File.objects.filter(pk=file.pk, stored_at__isnull=True).update(
        upload_lease_until=Now() + _upload_lease()))


def _upload_lease() -> timedelta:
    return timedelta(seconds=settings.FILES_UPLOAD_LEASE_S)


def finish_upload(file: File, *, size: int, claim: idempotency.Claim | None = None,
                  expires_after: timedelta | None = None) -> File:
    """Mark an upload whose bytes are in S3 stored, counting its real `size` (at most what it was started with), to
    expire `expires_after` from its creation (`file_expiry`), and
    save its answer under the request's idempotency key (`claim`) in the same transaction. One whose lease lapsed
    (its renewal late) is checked against the storage quota again: `Refused` past it, its bytes deleted.

    NOTE: a row whose lease lapsed stopped counting, and another upload may have been let in meanwhile; stored without
    a check, two uploads kept twice the quota.
    NOTE: stored by PostgreSQL's clock, as its start (`start_upload`): by the web pod's, one 10 minutes behind stored a
    file 10 minutes before it began."""
    file.stored_at, file.bytes = database_now(), size
    file.expires_at = file.created_at + expires_after if expires_after is not None else None
    try:
        with transaction.atomic():
            leased = _upload_leased(file)
            if _is_closed(file.organization_id):
                # NOTE: its organisation closed while it uploaded (under the row lock `_upload_leased` took): it expires
                # with the others (`endpoints.closing`). Stored as asked, the close's expiry was written over, and it
                # and its bytes were kept for good.
                file.expires_at = file.created_at
            if leased is None or not File.objects.filter(pk=file.pk, stored_at__isnull=True).update(
                    stored_at=file.stored_at, bytes=size, expires_at=file.expires_at):
                # swept as abandoned meanwhile (an upload of over an hour)
                raise Refused("The upload took too long; send it again.", param="file", status=408)
            if not leased:  # counted from now on with its size, beside what came in while it did not count
                _refuse_past_storage_quota(file.organization_id, 0, param="file", doing="")
            if claim is not None:
                idempotency.save_answer(claim, file.as_openai())
    except (Refused, idempotency.InProgress):
        storage.delete(file.s3_key)  # no stored row names its bytes: they go too
        abandon_upload(file)
        raise
    return file


def _upload_leased(file: File) -> bool | None:
    """Whether an upload in progress still holds its lease (None: its row is gone), read under its organisation's row
    lock, taken for the caller's transaction.

    NOTE: by PostgreSQL's clock at this moment (`clock_timestamp()`), not at the transaction's start (`Now()`): every
    upload let in before this took the lock counted the row if its lease outlived that upload's own start, earlier."""
    list(Organization.objects.select_for_update().filter(pk=file.organization_id).values_list("pk", flat=True))
    in_progress = File.objects.filter(pk=file.pk, stored_at__isnull=True)
    if not in_progress.exists():
        return None
    return in_progress.filter(upload_lease_until__gt=DatabaseClock()).exists()


def abandon_upload(file: File) -> None:
    """Take back the row of an upload that failed before it was stored: it stops counting against the quota."""
    File.objects.filter(pk=file.pk, stored_at__isnull=True).delete()


def refuse_upload_past_storage_quota(organization_id: int, size: int) -> None:
    """Refuse an upload of `size` bytes the organisation's storage quota has no room for, before its body is read
    (`Gateway._upload_may_start`): no lock, `start_upload` checks again under it."""
    _refuse_past_storage_quota(organization_id, size, param="file", doing="", lock=False)


def _storage_use(organization_id: int, *, lock: bool = True) -> tuple[int, int, int]:
    """The organisation's `max_file_bytes`, the bytes of its files (uploads in progress too), and the room its open
    batches keep for their outputs (each its input's size, or when larger its results' so far, `num_result_bytes`,
    with the most its error rows of lines without results may take, `num_unrun_row_bytes`).
    Takes the organisation's row lock (unless not `lock`), held by the caller's transaction until what it counts is
    written."""
    organizations = Organization.objects.select_for_update(of=("self",)) if lock else Organization.objects
    organization = organizations.select_related("plan").get(pk=organization_id)
    used = File.objects.held_by(organization_id).aggregate(total=Sum("bytes"))["total"] or 0
    room = Batch.objects.open().filter(organization_id=organization_id).aggregate(
        total=Sum(Greatest("input_file__bytes", F("num_result_bytes") + F("num_unrun_row_bytes"),
                           output_field=BigIntegerField())))["total"] or 0
    return organization.quotas.max_file_bytes, used, room


def _refuse_past_storage_quota(organization_id: int, size: int, *, param: str, doing: str, lock: bool = True) -> None:
    """Refuse `size` more bytes past the organisation's `max_file_bytes` (`_storage_use`), under its row lock (unless
    not `lock`)."""
    limit, used, room = _storage_use(organization_id, lock=lock)
    if used + room + size > limit:
        raise Refused(f"Your organisation keeps {used:,} bytes of files{f' ({room:,} more kept for open batches)' if room else ''}"
                      f" and may keep {limit:,} (quota max_file_bytes){f' {doing}' if doing else ''}: delete files it no "
                      "longer needs, or ask for a larger plan.", param=param, code="storage_quota_exceeded")


def sweep_abandoned_uploads(now=None) -> int:
    """Rows of uploads whose process died before their bytes were stored: their bytes (if any reached
    S3) and rows removed, so they stop counting against the quota. `now`: PostgreSQL's clock if None.

    NOTE: an upload's start is stamped by PostgreSQL's clock (`start_upload`) and its age judged by it: stamped by its
    web pod's clock and judged by this worker's, a web pod 55 minutes behind (or a worker ahead) swept an upload 10
    minutes into its body, the tenant answered 408 once it had sent it all."""
    try:
        if get_redis().exists(ABANDONED_SWEEP_PAUSED_KEY):
            return 0
    except Exception:
        logger.warning("could not read whether the abandoned-upload sweep waits; it runs", exc_info=True)
    before = database_time_ago(UPLOAD_ABANDONED_AFTER.total_seconds()) if now is None else now - UPLOAD_ABANDONED_AFTER
    abandoned = list(File.objects.filter(stored_at__isnull=True, created_at__lt=before).values_list("pk", "s3_key")[:100])
    num_swept = 0
    for file_id, key in abandoned:
        # NOTE: the row first: bytes are never removed from under a row that stays. Its delete is committed once S3's
        # is done: it was committed before, and S3 refusing (down, or a policy without DeleteObject) left the bytes in
        # the bucket for good, named by no row, counted by no quota and swept by nothing; the next sweep tries again.
        # NOTE: S3 refusing or failing one stops the sweep for `ABANDONED_SWEEP_PAUSE_S`: it refuses the others alike,
        # and each tick (2 s) asked again for every row it kept, up to 100, an error and its traceback each (~50 a
        # second for as long as a policy without DeleteObject stood), the tick's dispatch of batches waiting behind.
        try:
            with transaction.atomic():
                if File.objects.filter(pk=file_id, stored_at__isnull=True).delete()[0]:
                    storage.delete(key)
                    num_swept += 1
        except (BotoCoreError, ClientError):
            logger.exception("could not sweep the abandoned upload %s: S3 refused or failed its delete; the sweep "
                             "waits %d s", file_id, ABANDONED_SWEEP_PAUSE_S)
            try:
                get_redis().set(ABANDONED_SWEEP_PAUSED_KEY, "1", ex=ABANDONED_SWEEP_PAUSE_S)
            except Exception:
                logger.warning("could not pause the abandoned-upload sweep", exc_info=True)
            break
        except Exception:
            logger.exception("could not sweep the abandoned upload %s", file_id)
    return num_swept


def sweep_incomplete_uploads(now=None) -> int:
    """Abort the multipart uploads of files that S3 holds unfinished past `INCOMPLETE_UPLOADS_ABORTED_AFTER`: a
    process killed mid-upload (an upload's parse, a run writing its output files) never aborts its own, whose parts
    are stored and paid for for ever, named by no object or row and counted by no quota. Returns how many it aborted.

    NOTE: a bucket lifecycle rule (`AbortIncompleteMultipartUpload`) would do the same, but the bucket is the
    operator's, not created here: its configuration is replaced whole by a put (their own rules lost), and the fleet's
    credentials need not be allowed to set it. The README suggests the rule as well.
    NOTE: judged by this worker's clock against S3's (`Initiated`), neither PostgreSQL's nor Redis's: the hour past the
    longest live upload (`INCOMPLETE_UPLOADS_ABORTED_AFTER`) is the margin; a worker an hour ahead is an ERROR already
    (`controlplane.clock.check`)."""
    return storage.abort_incomplete_uploads(initiated_before=(now or timezone.now()) - INCOMPLETE_UPLOADS_ABORTED_AFTER)


NUM_EXPIRED_FILES_PER_RUN = 100  # a page: the run takes pages until none is full or its time is up
EXPIRED_FILES_SWEEP_S = 45.0  # under the beat's 60 s: two runs do not overlap
# How long past its `expires_at` a file is deleted: a batch created from it an instant before it expired (its lookup
# passed, its row not yet committed) is open by then, and its input kept for it.
EXPIRED_FILES_GRACE = timedelta(minutes=5)


# How long after its creation a batch whose output files a worker of the release before stored without their
# `expires_at` is looked for (`backfill_output_expiry`): past its window (24 h at most) and its last run, with days to
# spare for a beat that only runs the new release's sweep that much later.
OUTPUT_EXPIRY_BACKFILLED_FOR = timedelta(days=7)


def backfill_output_expiry() -> int:
    """Give the output and error files of batches that asked for them to expire (`output_expires_after_s`) their
    `expires_at` where a worker of the release before stored them without it (it knows nothing of the field); returns
    how many files it gave one. Run by each `sweep_expired_files`.

    NOTE: a batch created through a web pod of this release and ended by a worker of the one before kept its files for
    good, though it asked for them to go. Not a data migration: it runs before the rollout, while workers of the
    release before still end batches. Batches of the last `OUTPUT_EXPIRY_BACKFILLED_FOR` only, those an old worker may
    have ended: one scan of those rows a minute, no index needed."""
    batches, files = Batch._meta.db_table, File._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {files} AS f SET expires_at = f.created_at + b.output_expires_after_s * interval '1 second' "
            f"FROM {batches} AS b WHERE b.output_expires_after_s IS NOT NULL AND b.created_at >= %s "
            "AND f.id IN (b.output_file_id, b.error_file_id) AND f.expires_at IS NULL AND f.stored_at IS NOT NULL "
            "AND f.deleted_at IS NULL",
            [database_now() - OUTPUT_EXPIRY_BACKFILLED_FOR])
        return cursor.rowcount


# One organisation's expired files that the sweep may delete, oldest first, by `file_org_expiring` (organisation,
# expiry, id): the scan stops at the LIMIT. Past it: uploads in progress (not stored) and inputs of open batches.
_EXPIRED_OF_ORGANIZATION = (
    "SELECT f.id, f.expires_at FROM {files} AS f WHERE f.organization_id = o.id AND f.deleted_at IS NULL "
    "AND f.expires_at IS NOT NULL AND f.expires_at <= now() - %(grace)s AND f.stored_at IS NOT NULL "
    "AND NOT EXISTS (SELECT 1 FROM {batches} AS b WHERE b.input_file_id = f.id AND b.status = ANY(%(open)s)) "
    "ORDER BY f.expires_at, f.id LIMIT {limit}")
# The organisations with an expired file to delete: those with a live expiring file, walked one index probe each (a
# loose index scan of `file_org_expiring`: the next organisation after the last), each probed for an expired one
# (LATERAL ... LIMIT 1); never a scan of every organisation's expired files, nor of every organisation.
# NOTE: ordered by the organisation alone, the walk was planned on the foreign key's index (organization_id), every
# deleted or unexpiring file (the rows of deleted files are kept) read and filtered out at each step: ordered by the
# whole of `file_org_expiring`'s key, only that index gives the order.
_ORGANIZATIONS_WITH_EXPIRED = (
    "WITH RECURSIVE o(id) AS ("
    "(SELECT f.organization_id FROM {files} AS f WHERE f.deleted_at IS NULL AND f.expires_at IS NOT NULL "
    "ORDER BY f.organization_id, f.expires_at, f.id LIMIT 1) UNION ALL "
    "SELECT (SELECT f.organization_id FROM {files} AS f WHERE f.deleted_at IS NULL AND f.expires_at IS NOT NULL "
    "AND f.organization_id > o.id ORDER BY f.organization_id, f.expires_at, f.id LIMIT 1) FROM o WHERE o.id IS NOT NULL) "
    "SELECT o.id FROM o CROSS JOIN LATERAL (" + _EXPIRED_OF_ORGANIZATION + ") AS e WHERE o.id IS NOT NULL")
# Each of those organisations' oldest `per_organization`, numbered in their turn: every one's first, then second...
_EXPIRED_IN_TURN = (
    "SELECT e.id, o.id FROM unnest(%(organizations)s::bigint[]) AS o(id) CROSS JOIN LATERAL ("
    "SELECT x.id, x.expires_at, row_number() OVER (ORDER BY x.expires_at, x.id) AS turn FROM ("
    + _EXPIRED_OF_ORGANIZATION + ") AS x) AS e ORDER BY e.turn, e.expires_at, e.id LIMIT %(page)s")


def _expired_files_in_turn(page: int) -> list[File]:
    """Up to `page` files past their `expires_at` and `EXPIRED_FILES_GRACE` that the sweep may delete: every
    organisation's oldest first, then every one's second, and so on, as batches are dispatched.

    NOTE: in one queue by expiry, one tenant's backlog of tiny files with the shortest expiry (bounded by bytes, not by
    count) kept every other tenant's expired files in S3, counted against their quota, behind it. Numbered by a window
    over every expired file instead, each page of each run read and sorted all of them, every organisation's: a
    backlog of millions made a page slow enough to spend the run's budget. Now: the organisations with one (an index
    probe or two each), then each one's oldest `ceil(page / organisations)` by the index (`file_org_expiring`).

    NOTE: those shares alone made a page short of full where some organisations had fewer than their share (2 + 1 + 1
    of a page of 5), and the run stops at its first page short of full: a tenant's backlog drained by its share a
    minute while other tenants' files trickled in. A short page whose organisations filled their share is read again
    with larger shares (at least doubled: a few reads at most) until it is full or no organisation has more."""
    names = {"files": File._meta.db_table, "batches": Batch._meta.db_table}
    params = {"grace": EXPIRED_FILES_GRACE, "open": [state.value for state in OPEN_STATES]}
    with connection.cursor() as cursor:
        cursor.execute(_ORGANIZATIONS_WITH_EXPIRED.format(limit=1, **names), params)
        organizations = [row[0] for row in cursor.fetchall()]
        if not organizations:
            return []
        per_organization = -(-page // len(organizations))
        while True:
            cursor.execute(_EXPIRED_IN_TURN.format(limit=per_organization, **names),
                           {**params, "organizations": organizations, "page": page})
            rows = cursor.fetchall()
            # a full page holds every organisation's files up to the page's last turn; short, it holds all of each
            # organisation's up to its share: those with their share may have more
            counts = collections.Counter(organization for _, organization in rows)
            filled = sum(1 for num in counts.values() if num >= per_organization)
            if len(rows) >= page or not filled or per_organization >= page:
                break
            per_organization = min(page, max(2 * per_organization,
                                             per_organization + -(-(page - len(rows)) // filled)))
        ids = [row[0] for row in rows]
    files = File.objects.in_bulk(ids)
    return [files[file_id] for file_id in ids if file_id in files]


def sweep_expired_files(*, budget_s: float = EXPIRED_FILES_SWEEP_S) -> int:
    """Delete files past their `expires_at` (`file_expiry`), their bytes from S3 with them (`delete_file`), a page of
    `NUM_EXPIRED_FILES_PER_RUN` at a time (each organisation's in turn) for up to `budget_s`, `EXPIRED_FILES_GRACE`
    after they expired; returns how many went. Their tenant sees them gone from the moment they expire (`FileQuerySet.for_org`). One an open batch reads is kept until that batch ends; one S3
    refuses to delete stays to the next run, as a tenant's delete refused does.

    NOTE: one page a run (100 files a minute) left a backlog that only grew once files expired faster than that, each
    kept in S3 and counted against its tenant's storage quota, though gone to them."""
    deadline = time.monotonic() + budget_s
    num_deleted = 0
    try:
        if num_backfilled := backfill_output_expiry():
            logger.info("gave %d output files of batches ended by a worker of the release before their expiry",
                        num_backfilled)
    except DatabaseError:
        logger.exception("could not give the output files of batches ended by a worker of the release before their "
                         "expiry; the next sweep tries again")
    while True:
        # NOTE: the inputs of open batches left out in the query: 100 of them expired first would hold every later one
        # back. A page's files are deleted (or, read by a batch opened since, left out of the next query) before it.
        # NOTE: deleted the moment it expired, a file was deleted under a batch created from it then, answered 200
        # NOTE: every organisation's oldest expired file first, then every one's second, and so on, as batches are
        # dispatched: in one queue by expiry, one tenant's backlog of tiny files with the shortest expiry (bounded by
        # bytes, not by count) kept every other tenant's expired files in S3, counted against their quota, behind it.
        expired = _expired_files_in_turn(NUM_EXPIRED_FILES_PER_RUN)
        for file in expired:
            try:
                # NOTE: with the run's client (five tries, 60 s timeouts) a stalled S3 held one delete for minutes,
                # past the budget and the beat's next runs
                num_deleted += delete_file(file, quick=True)
            except Refused:
                continue  # read by a batch opened since the query: deleted once it ends
            except (BotoCoreError, ClientError):
                logger.exception("could not delete the expired file %s: S3 refused or failed; the next sweep tries "
                                 "again", file.pk)
                return num_deleted
            # NOTE: looked at only between pages, the budget let a page of slow deletes (a slow S3, a second each) run
            # 100 s, past the beat's next run, which took the same files again
            if time.monotonic() >= deadline:
                return num_deleted
        if len(expired) < NUM_EXPIRED_FILES_PER_RUN:
            return num_deleted


def delete_file(file: File, *, quick: bool = False) -> bool:
    """Delete a file: its row is marked (batches keep naming it) and its bytes removed from S3.

    Refused (409) while a batch that has not ended reads it as its input: a run reads the input again for the lines
    it has still to run, and a batch whose input went never ended (its endpoint kept warm for it). A batch that
    finds its input gone all the same (a delete racing its creation, an object lost) ends (`_end_without_input`)."""
    reader = Batch.objects.open().filter(input_file_id=file.pk).values_list("pk", flat=True).first()
    if reader is not None:
        raise Refused(f"The file is the input of batch {reader}, which has not ended: cancel it or wait for it to "
                      "end before deleting the file.", param="file_id", status=409, code="file_in_use",
                      lasting=True)
    if not File.objects.filter(pk=file.pk, deleted_at__isnull=True).update(deleted_at=(deleted_at := timezone.now())):
        return False
    try:
        storage.delete(file.s3_key, quick=quick)
    except Exception:
        # NOTE: S3 refusing the delete (down, or an IAM policy without DeleteObject) left the row marked deleted: the
        # 503 sent again was a 404, and the tenant's bytes stayed in the bucket for good, named by no file they could
        # see or delete. The row is theirs again, to delete once S3 takes it.
        File.objects.filter(pk=file.pk, deleted_at=deleted_at).update(deleted_at=None)
        raise
    return True


def _store_output(organization_id: int, filename: str, rows: Iterable[bytes]) -> File:
    """A batch's output or error file of JSON lines `rows`: its row is written first, as an upload in progress, then
    its bytes go to S3 a part at a time; `finalize_batch` marks it stored, with its size, as it ends the batch. A run
    killed in between leaves a row that `sweep_abandoned_uploads` removes with its bytes, never bytes no row names.
    NOTE: its size is written as the batch ends: till then the batch's room (`num_result_bytes`) counts those bytes,
    and counted twice they made other batches' lines and uploads refused while it finalized."""
    file_id = new_file_id()
    file = File.objects.create(id=file_id, organization_id=organization_id, purpose=FilePurpose.BATCH_OUTPUT,
                               filename=filename, bytes=0, s3_key=storage.file_key(organization_id, file_id),
                               stored_at=None, created_at=database_now())  # as an upload's: the sweep's clock
    file.bytes = storage.put_lines(file.s3_key, rows)
    return file


def _is_closed(organization_id: int) -> bool:
    return Organization.objects.filter(pk=organization_id, closed_at__isnull=False).exists()


def _refuse_closed(organization_id: int, doing: str = "stores no more files") -> None:
    if _is_closed(organization_id):
        raise Refused(f"This organisation is closed: it {doing}.", status=403, code="organization_closed",
                      lasting=True)


def _output_expiry(batch: Batch, file: File):
    """When a batch's output or error file expires: its `output_expires_after` from the file's creation, or never; at
    once where its organisation was closed (`endpoints.closing`: a batch it cancelled ends after, and its files go
    with the expired-file sweep as the organisation's others did)."""
    if _is_closed(batch.organization_id):
        return file.created_at
    if batch.output_expires_after_s is None:
        return None
    return file.created_at + timedelta(seconds=batch.output_expires_after_s)


def _discard_outputs(files: list[File]) -> None:
    """Output files a run wrote but did not keep (another run ended the batch first): the bytes first,
    so that a failure leaves a row for `sweep_abandoned_uploads`, never bytes without one."""
    for file in files:
        try:
            storage.delete(file.s3_key)
            File.objects.filter(pk=file.pk, stored_at__isnull=True).delete()
        except Exception:
            logger.exception("could not discard the output file %s (swept as abandoned later)", file.pk)


# --- batches ---------------------------------------------------------------------------------

def create_batch(*, organization_id: int, api_key_id: int | None, user_id: int | None, input_file_id: str,
                 request_path: str, completion_window: str, metadata: dict | None,
                 claim: idempotency.Claim | None = None, output_expires_after: object = None) -> Batch:
    """A new batch, `validating`; a worker checks its lines and runs it. Its answer is saved under the request's
    idempotency key (`claim`) in the transaction that creates it: never a batch whose key forgot it. Its output and
    error files expire as OpenAI's `output_expires_after` asks (`file_expiry`), else are kept until deleted."""
    if request_path not in BATCH_PATHS:
        raise Refused(f"endpoint must be one of {', '.join(BATCH_PATHS)}.", param="endpoint")
    if completion_window not in COMPLETION_WINDOWS:
        raise Refused(f"completion_window must be one of {', '.join(COMPLETION_WINDOWS)}.", param="completion_window")
    if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > 16 or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 and storable(k) and storable(v)
            for k, v in metadata.items())):
        raise Refused("metadata must be at most 16 string pairs (keys up to 64, values up to 512 characters, without "
                      "NUL characters or lone surrogates).", param="metadata")
    if output_expires_after is not None and not isinstance(output_expires_after, dict):
        raise Refused("output_expires_after must be an object with 'anchor' and 'seconds'.", param="output_expires_after")
    # NOTE: an object without its anchor (`{}`) is refused as OpenAI does: taken as none sent, the outputs were kept for good
    outputs_live = file_expiry(output_expires_after.get("anchor") or "", output_expires_after.get("seconds"),
                               param="output_expires_after") if output_expires_after is not None else None
    input_file = File.objects.for_org(organization_id).named(input_file_id).first()
    if input_file is None:
        raise Refused(f"No such File object: {input_file_id}", param="input_file_id", status=404)
    if input_file.purpose != FilePurpose.BATCH:
        raise Refused("The input file's purpose must be 'batch'.", param="input_file_id")
    _refuse_a_model_of_another_task(organization_id, input_file, request_path)
    # NOTE: its window by PostgreSQL's clock, which judges it (`run_batch`, `tick`): by the web pod's, one 10 minutes
    # ahead gave a batch 24 h 10 min
    now = database_now()
    with transaction.atomic():
        _refuse_past_storage_quota(organization_id, input_file.bytes, param="input_file_id",
                                   doing="and each open batch keeps room for its output")
        # NOTE: under the row lock the quota's check took, as the close takes it (`endpoints.closing`): the input file
        # was found before it, so a close committed meanwhile left a batch open in the closed organisation, run after it
        _refuse_closed(organization_id, "starts no more batches")
        # NOTE: under the organisation's row lock (just taken): concurrent creates never pass the cap together. One
        # tiny input reused kept almost no room, so nothing bounded how many batches one organisation kept open (each
        # a run queued and a row the tick reads every 2 s).
        num_open = Batch.objects.open().filter(organization_id=organization_id).count()
        if num_open >= settings.BATCH_MAX_OPEN_PER_ORG:
            raise Refused(f"Your organisation has {num_open} batches that have not ended, the most it may have "
                          f"({settings.BATCH_MAX_OPEN_PER_ORG}): wait for some to end, or cancel some.",
                          param="input_file_id", status=429, code="batch_limit_reached", lasting=True)
        batch = Batch.objects.create(organization_id=organization_id, api_key_id=api_key_id, created_by_id=user_id,
                                     request_path=request_path, input_file=input_file, completion_window=completion_window,
                                     metadata=metadata, created_at=now,
                                     expires_at=now + COMPLETION_WINDOWS[completion_window],
                                     output_expires_after_s=int(outputs_live.total_seconds()) if outputs_live else None)
        if claim is not None:
            idempotency.save_answer(claim, batch.as_openai())
    _dispatch_after_commit(batch.pk)
    return batch


# What of an input is read at a batch's creation (`_refuse_a_model_of_another_task`): the first line of most files; a
# longer one is left to the validation.
FIRST_LINE_BYTES = 1024 * 1024


def _refuse_a_model_of_another_task(organization_id: int, input_file: File, request_path: str) -> None:
    """Refuse (400 naming `endpoint`) a batch whose first line's model serves another task than its `endpoint` asks
    (an embedding model's batch for `/v1/chat/completions`, a chat model's for `/v1/embeddings`): before, it was
    created, validated and run, and every line failed as it ran. The rest of the file is the validation's to check
    (each line against the same model's task: `_LineModels`); an input that cannot be read now is left to it too."""
    try:
        start = storage.read_start(input_file.s3_key, FIRST_LINE_BYTES)
    except Exception:  # NOTE: a check ahead of the validation's: S3 failing here must not refuse (or 500) a create
        logger.warning("batch of %s: its first line could not be read at creation", input_file.pk, exc_info=True)
        return
    model = first_model(start, is_whole_file=len(start) < FIRST_LINE_BYTES)
    refusal = _LineModels(organization_id, BATCH_PATHS[request_path]).task_refusal(model) if model else None
    if refusal is not None:
        raise Refused(f"{refusal.message} The batch's endpoint, {request_path}, does not serve it.", param="endpoint",
                      code=refusal.code)


class _LineModels:
    """The models a batch's lines may name (`validation.ModelCheck`): the organisation's live endpoints serving the
    batch's kind of call, as `"<endpoint>"` or `"<endpoint>:<adapter>"` (the gateway's naming,
    `adapters.parse_model_name`; what the runner resolves as the gateway does, `adapter_hold.resolve`). Another
    organisation's endpoint or adapter is unknown here, as it is to the gateway: `model_not_found`."""

    def __init__(self, organization_id: int, kind: str):
        self.organization_id, self.kind = organization_id, kind
        self._endpoints: dict[str, tuple[Endpoint, set[str]] | None] = {}

    def endpoint(self, name: str) -> Endpoint | None:
        return (self._found(name) or (None,))[0]

    def _found(self, name: str) -> tuple[Endpoint, set[str]] | None:
        if name not in self._endpoints:
            endpoint = Endpoint.objects.live().filter(organization_id=self.organization_id, name=name).first()
            self._endpoints[name] = (endpoint, set(Adapter.objects.filter(endpoint=endpoint).values_list(
                "name", flat=True))) if endpoint is not None else None
        return self._endpoints[name]

    def __call__(self, model: str) -> errors.OpenAIError | None:
        names = parse_model_name(model)
        found = self._found(names[0]) if names is not None else None
        if found is None or (names[1] and names[1] not in found[1]):
            return errors.model_not_found(model)
        return self.task_refusal(model)

    def task_refusal(self, model: str) -> errors.OpenAIError | None:
        """The refusal of a call of this kind to the endpoint `model` names, when it serves the other task."""
        names = parse_model_name(model)
        endpoint = self.endpoint(names[0]) if names is not None else None
        return embeddings.wrong_task(self.kind, endpoint.serving_task, endpoint.name) if endpoint is not None else None


def cancel_batch(batch: Batch) -> Batch:
    """Stop starting new lines; lines in flight finish and what finished is kept (its files written). A batch already
    `cancelling` is answered as it is; one that has ended, or is `finalizing` (every line ran: nothing is left to
    stop), is refused as OpenAI refuses it: a 409 naming its status.

    NOTE: a cancel of an ended batch answered 200 with the batch as it was (`completed`), and the openai client took
    it for a cancel that was accepted."""
    now = database_now()  # NOTE: a batch's steps by PostgreSQL's clock, as its creation and window (`finalize_batch`)
    if not Batch.objects.filter(pk=batch.pk, status__in=[BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS]).update(
            status=BatchStatus.CANCELLING, cancelling_at=now):
        status = Batch.objects.filter(pk=batch.pk).values_list("status", flat=True).get()
        if status != BatchStatus.CANCELLING:
            raise Refused(f"Cannot cancel a batch with status '{status}'.", status=409, lasting=True)
    _dispatch_after_commit(batch.pk)
    return Batch.objects.get(pk=batch.pk)


def _dispatch_after_commit(batch_id: str) -> None:
    """Queue a run of the batch once the caller's transaction commits, if Redis and the broker take it now.

    NOTE: best-effort: the batch is written whatever happens here, and `tick` queues any open batch without a live run
    within `BATCH_TICK_S`. A queueing that failed answered 500 or 503 for a batch that was created (requests are not
    atomic: the callback ran right after the commit, in the request), and the openai client, which sends a request
    again after a 5xx, created three batches, each run and billed."""

    def queue() -> None:
        try:
            dispatch(batch_id)
        except Exception:
            logger.warning("batch %s: its run could not be queued now; the batch tick queues it", batch_id,
                           exc_info=True)

    transaction.on_commit(queue)


def dispatch(batch_id: str) -> bool:
    """Queue a run of the batch unless one is queued or running (or its last run found no free slot lately)."""
    key = batch_dispatch_key(batch_id)
    if not get_redis().set(key, "1", nx=True, ex=DISPATCH_HELD_S):
        return False
    try:
        send_task(RUN_BATCH_TASK, args=[batch_id], expires=DISPATCH_HELD_S)
    except Exception:
        # NOTE: the key stands for a run in the queue: left with none there, it kept the tick from queueing the batch
        # for `DISPATCH_HELD_S`.
        try:
            get_redis().delete(key)
        except Exception:
            logger.warning("batch %s: its dispatch key stays until it lapses", batch_id, exc_info=True)
        raise
    return True


def tick() -> int:
    """Queue a run of every open batch that has something to do now and no live worker: validating,
    cancelling or finalizing ones, and running ones whose endpoint has a READY replica or whose
    completion window has ended. Running batches of a sleeping endpoint wait for the autoscaler
    (`scheduling.apply` wakes it when their deadline needs it). Sweeps abandoned uploads and idempotency keys past
    their day first."""
    sweep_abandoned_uploads()
    idempotency.sweep_expired()
    unleased = Batch.objects.open().filter(_lease_lapsed())
    warm = Replica.objects.filter(state=ReplicaState.READY).values("endpoint_id")
    # NOTE: and running ones whose endpoint was deleted (its replicas drained): they waited for a READY replica until
    # their window ended, a day, each an open batch of its organisation keeping its storage room (`_end_without_endpoint`)
    due = unleased.filter(~Q(status=BatchStatus.IN_PROGRESS) | Q(endpoint_id__in=warm) | Q(expires_at__lte=DatabaseClock())
                          | Q(endpoint__deleted_at__isnull=False))
    # NOTE: every organisation's oldest batch first, then every one's second, and so on: one organisation's
    # backlog (hundreds of batches, stuck or not) never fills the slice and starves all the others.
    turn = Window(RowNumber(), partition_by=[F("organization_id")], order_by=[F("created_at").asc(), F("id").asc()])
    rows = list(due.annotate(turn=turn).order_by("turn", "created_at", "id")
                .values_list("pk", "lease_token")[:MAX_DISPATCHED_PER_TICK])
    # NOTE: a lease that lapsed with its token still set is a run that died (a released one clears it): its queued
    # run stands for nothing any more, and its batch is queued again now, not `DISPATCH_HELD_S` later.
    died = [batch_id for batch_id, token in rows if token]
    if died:
        get_redis().delete(*(batch_dispatch_key(batch_id) for batch_id in died))
        # NOTE: the dead run's token goes with its queued run (unless a new run claimed the batch meanwhile): left
        # there, the batch read as a dead run's at every tick and was queued again every 2 s until a worker took it.
        Batch.objects.filter(pk__in=died).filter(_lease_lapsed()).update(lease_token="")
    return sum(dispatch(batch_id) for batch_id, _ in rows)


def _lease_lapsed() -> Q:
    """Batches no run holds: never leased, released, or their lease lapsed by PostgreSQL's clock."""
    return Q(lease_until__isnull=True) | Q(lease_until__lt=Now())


def _lease_for(seconds: float) -> CombinedExpression:
    """A lease's end `seconds` from now by PostgreSQL's clock.

    NOTE: leases are set and compared on the database's clock, never a worker's: each worker wrote and judged them by
    its own, and one 60 s ahead took over a batch whose run was alive and renewing, running its lines in flight again
    (GPU work twice, their answers counted twice against the storage quota)."""
    return Now() + timedelta(seconds=seconds)


def _claim(batch_id: str) -> str | None:
    token = secrets.token_hex(8)
    claimed = Batch.objects.open().filter(pk=batch_id).filter(_lease_lapsed()).update(
        lease_until=_lease_for(settings.BATCH_LEASE_S), lease_token=token)
    return token if claimed else None


def _release(batch_id: str, token: str, *, queue_again_in_s: int = 0) -> None:
    Batch.objects.filter(pk=batch_id, lease_token=token).update(lease_until=None, lease_token="")
    if queue_again_in_s:
        get_redis().set(batch_dispatch_key(batch_id), "1", ex=queue_again_in_s)
    else:
        get_redis().delete(batch_dispatch_key(batch_id))


def _hold_lease_through_a_long_step(batch_id: str, token: str) -> None:
    """A run reads and checks the whole input file (validation, or a run's list of lines), and writes a batch's files
    from every line's result, without renewing its lease: a large batch takes longer than `BATCH_LEASE_S`, and
    another worker took the batch over meanwhile (counting a validation attempt each time, until a valid batch
    failed; writing its files twice at once). Held this long first."""
    Batch.objects.filter(pk=batch_id, lease_token=token).update(
        lease_until=_lease_for(max(settings.BATCH_LEASE_S, INPUT_READ_LEASE_S)))


def run_batch(batch_id: str) -> str:
    """One worker's turn at a batch: validate it, run lines for up to `BATCH_RUN_SLICE_S`, and write its
    files once nothing is left to run. Returns what happened (for logs and tests)."""
    started = time.monotonic()  # the run task's time limit counts from about here
    token = _claim(batch_id)
    if token is None:
        return "busy"
    outcome = ""
    try:
        batch = Batch.objects.select_related("input_file", "endpoint").get(pk=batch_id)
        if batch.status == BatchStatus.VALIDATING:
            _hold_lease_through_a_long_step(batch_id, token)
            batch = validate_batch(batch)
        outcome = batch.status
        if batch.status == BatchStatus.IN_PROGRESS:
            try:
                outcome = _run_lines(batch, token, started=started)
            except storage.ObjectGone as gone:
                # NOTE: only a missing object ends it: one S3 will not let the fleet read (an IAM policy, a KMS key,
                # the bucket's name: the operator's to mend, its bytes still stored) failed every running batch for
                # good, their lines not yet run listed nowhere. This run fails, as with S3 down; the next tries again,
                # and once its window has passed it ends `expired` below, with the lines that ran.
                if not gone.missing:
                    _log_input_unreadable(batch, gone)
                    if batch.expires_at > database_now():
                        raise
                    outcome = "input unreadable"
                else:
                    _hold_lease_through_a_long_step(batch_id, token)
                    _end_without_input(batch)
                    return "input gone"
            batch.refresh_from_db()
            if outcome == "unstored":
                # NOTE: lines answered (billed) whose answers PostgreSQL kept from being stored: ended now, the batch's
                # files lacked them for good; the next run runs them again, under their ids (billed once)
                return outcome
        final = None
        if batch.status == BatchStatus.IN_PROGRESS and outcome == "gone":
            # NOTE: deleted, not renamed (its old name then another endpoint's, or none in this process's cache yet):
            # the next run reads its name again
            if Endpoint.objects.filter(pk=batch.endpoint_id, deleted_at__isnull=False).exists():
                _hold_lease_through_a_long_step(batch_id, token)
                _end_without_endpoint(batch)
            return outcome
        # NOTE: by PostgreSQL's clock, as its window was stamped (`create_batch`): by the worker's, one 10 minutes ahead
        # expired a batch with 5 minutes left, its lines never run
        if batch.status == BatchStatus.IN_PROGRESS and batch.expires_at <= database_now():
            final = BatchStatus.EXPIRED
        elif batch.status == BatchStatus.CANCELLING:
            final = BatchStatus.CANCELLED
        elif batch.status == BatchStatus.FINALIZING and batch.errors:  # stopped by its errors (`_fail_past_storage_quota`)
            final = BatchStatus.FAILED
        elif batch.status == BatchStatus.FINALIZING or (batch.status == BatchStatus.IN_PROGRESS and batch.num_pending == 0):
            final = BatchStatus.COMPLETED
        if final is not None:
            _hold_lease_through_a_long_step(batch_id, token)
            finalize_batch(batch, final)
        return outcome
    except (storage.ObjectGone, BotoCoreError, ClientError):
        outcome = "s3 failed"
        raise
    finally:
        _release(batch_id, token, queue_again_in_s=(FULL_RETRY_S if outcome == "full"
                                                    else S3_FAILED_RETRY_S if outcome == "s3 failed" else 0))


def validate_batch(batch: Batch) -> Batch:
    """Check every line (`validation.parse_lines`, a part of the file at a time) and the model they name: `in_progress`,
    or `failed` with one error per bad line. Nothing runs from a bad file. A batch whose check began
    `MAX_VALIDATION_ATTEMPTS` times and never ended fails."""
    Batch.objects.filter(pk=batch.pk, status=BatchStatus.VALIDATING).update(
        num_validation_attempts=F("num_validation_attempts") + 1)
    batch.refresh_from_db()
    if batch.status != BatchStatus.VALIDATING:
        return batch
    if batch.num_validation_attempts > MAX_VALIDATION_ATTEMPTS:
        return _fail_validation(batch, [LineError(1, "validation_failed", f"The input file could not be checked "
                                                  f"({MAX_VALIDATION_ATTEMPTS} attempts failed); check its lines and "
                                                  "create the batch again.")])
    models = _LineModels(batch.organization_id, BATCH_PATHS[batch.request_path])
    try:
        checked = parse_lines(storage.read_parts(batch.input_file.s3_key), request_path=batch.request_path,
                              kind=BATCH_PATHS[batch.request_path], max_lines=settings.BATCH_MAX_LINES,
                              check_model=models)
    except (storage.ObjectGone, BotoCoreError, ClientError) as failed:
        if isinstance(failed, storage.ObjectGone) and failed.missing:
            logger.warning("batch %s: its input file is gone", batch.pk)
            return _fail_validation(batch, [LineError(1, "file_not_found", "The input file could not be read.")])
        # NOTE: S3 failing, or not letting the fleet read the input (an IAM policy, a KMS key, the bucket's name: the
        # operator's to mend, its bytes still stored), fails this attempt alone, and counts none of the attempts a
        # dying worker is given: the batch is checked again by the next tick until its window ends. Before, such an
        # object failed every validating batch at once as `file_not_found`, and S3 failing through three attempts (a refusal
        # is not retried by boto3: three ticks, ~6 s) failed them as `validation_failed`.
        Batch.objects.filter(pk=batch.pk, status=BatchStatus.VALIDATING).update(
            num_validation_attempts=F("num_validation_attempts") - 1)
        if isinstance(failed, storage.ObjectGone):
            _log_input_unreadable(batch, failed)
        if batch.expires_at <= database_now():
            return _fail_validation(batch, [LineError(1, "validation_failed", INPUT_UNREADABLE_MESSAGE)])
        raise
    else:
        checked_errors, endpoint = checked.errors, None
        if not checked_errors:
            endpoint = models.endpoint(checked.model)
    if checked_errors:
        return _fail_validation(batch, checked_errors)
    num_unrun_row_bytes = _unrun_rows_bytes(batch.pk, checked.num_lines, checked.num_custom_id_bytes)
    try:
        with transaction.atomic():
            # NOTE: the room its error file may take should it expire before any line runs, kept from now on beside its
            # results (`_storage_use`) or refused now: those rows were written past the quota, and a file of many short
            # lines, each an error row longer than itself, left ~2.1 times its size past it (200 lines: 41,780 for 19,490)
            # NOTE: only the room past what it keeps already (its input's size, `_storage_use`), and only when there is
            # some: an organisation already past its quota (a smaller plan since) failed a batch that wanted none
            if num_unrun_row_bytes > batch.input_file.bytes:
                _refuse_past_storage_quota(
                    batch.organization_id, num_unrun_row_bytes - batch.input_file.bytes, param="input_file_id",
                    doing=f"beside this batch's error file, which may take {num_unrun_row_bytes:,} bytes (a row for each "
                          f"of its {checked.num_lines:,} requests, should it expire before they run)")
            Batch.objects.filter(pk=batch.pk, status=BatchStatus.VALIDATING).update(
                status=BatchStatus.IN_PROGRESS, in_progress_at=DatabaseClock(), endpoint=endpoint,
                num_total=checked.num_lines, num_unrun_row_bytes=num_unrun_row_bytes)
    except Refused as refused:
        return _fail_validation(batch, [LineError(1, "storage_quota_exceeded", refused.message)])
    batch.refresh_from_db()
    return batch


INPUT_UNREADABLE_MESSAGE = ("The input file could not be read from storage before the batch's completion window "
                            "ended; create the batch again.")


def _log_input_unreadable(batch: Batch, gone: storage.ObjectGone) -> None:
    """For staff: S3 refuses the fleet a batch's input that is still stored (not `missing`)."""
    cause = gone.__cause__
    code = cause.response.get("Error", {}).get("Code") if isinstance(cause, ClientError) else None
    logger.error("batch %s: S3 will not let the fleet read its input %s (%s): check the fleet's IAM policy, the KMS "
                 "key and FILES_S3_BUCKET; the batch is tried again until its window ends", batch.pk,
                 batch.input_file.s3_key, code)


def _fail_validation(batch: Batch, problems: list[LineError]) -> Batch:
    """End a batch that failed its check with its errors (no line ran: it has no results to delete).
    Errors PostgreSQL still refuses give way to one that says so: a batch never stays validating."""
    now = database_now()
    ended = {"status": BatchStatus.FAILED, "failed_at": now, "results_deleted_at": now}
    try:
        with transaction.atomic():
            Batch.objects.filter(pk=batch.pk, status=BatchStatus.VALIDATING).update(
                errors=[problem.as_openai() for problem in problems], **ended)
    except DatabaseError:
        logger.exception("batch %s: its validation errors could not be stored", batch.pk)
        Batch.objects.filter(pk=batch.pk, status=BatchStatus.VALIDATING).update(
            errors=[LineError(1, "invalid_request", "The input file has errors that could not be recorded; check "
                                                    "its lines.").as_openai()], **ended)
    batch.refresh_from_db()
    return batch


INPUT_GONE_MESSAGE = ("The input file was deleted or can no longer be read; the lines that ran are in the output "
                      "and error files.")


def _end_without_input(batch: Batch) -> None:
    """A running batch whose input file is gone (no line left to run can be read): ended as `failed`, with the files
    of the lines that ran. Before, every run failed reading it and the batch never ended, its endpoint kept warm."""
    logger.warning("batch %s: its input file is gone; ending it with the lines that ran", batch.pk)
    finalize_batch(batch, BatchStatus.FAILED, errors=[LineError(1, "file_not_found", INPUT_GONE_MESSAGE).as_openai()])


ENDPOINT_GONE_MESSAGE = ("The batch's endpoint was deleted; the lines that ran are in the output and error files.")


def _end_without_endpoint(batch: Batch) -> None:
    """A running batch whose endpoint was deleted: ended as `failed` with the files of the lines that ran (a cancel
    that came first ends it `cancelled` instead, `run_batch`).

    NOTE: its line results were deleted with no file written from them: the lines that ran, billed, were lost."""
    finalize_batch(batch, BatchStatus.FAILED,
                   errors=[LineError(1, "model_not_found", ENDPOINT_GONE_MESSAGE, "body.model").as_openai()])


def _input_lines(batch: Batch, *, skip: Container[int] = ()) -> Iterator[Line]:
    """The batch's lines but those in `skip`, read from its input a part at a time as they are asked for
    (`storage.ObjectGone` once it is gone), its first `num_total` alone: the requests its check counted.

    NOTE: a line past them is never run: a release that counted one more line as a request (a line of whitespace
    alone) shifted the indexes of a batch checked by the one before, and its run read every line it was given, a line
    already answered ran and was billed again, and the batch ended with more lines completed than it had."""
    return itertools.takewhile(lambda line: line.index < batch.num_total,
                               read_lines(storage.read_parts(batch.input_file.s3_key), skip=skip))


def caller_of(batch: Batch) -> Caller | None:
    """Who a batch's lines run as: the key that created it (its rate limits), or the console user; None
    once they may no longer call `/v1` as the gateway would judge them: the key revoked, expired, deleted
    or without the inference scope, or its creator (the console user) gone from the organisation,
    inactive or a viewer. A leaked key's batches stop with the key."""
    if batch.api_key_id:
        # NOTE: its expiry by PostgreSQL's clock, read by the key's own query as `keys.find_api_key` reads it (no round
        # trip more on each lease renewal): by the worker's, one 10 minutes behind ran a batch of an expired key 10
        # minutes more, one ahead stopped a live key's batch
        key = (ApiKey.objects.select_related("created_by").filter(pk=batch.api_key_id)
               .annotate(judged_at=DatabaseClock()).first())
        if key is None or not key.is_usable(key.judged_at) or not key.has_scope(Scope.INFERENCE):
            return None
        role = keys.creator_role(key)
    else:
        key = None
        role = Membership.objects.filter(organization_id=batch.organization_id, user_id=batch.created_by_id,
                                         user__is_active=True).values_list("role", flat=True).first()
    if role is None or role == Role.VIEWER:
        return None
    return Caller(organization_id=batch.organization_id, api_key_id=batch.api_key_id, user_id=batch.created_by_id,
                  can_infer=True, role=role, requests_per_minute=key.requests_per_minute if key else None,
                  tokens_per_minute=key.tokens_per_minute if key else None)


def _moment(unix: float | None) -> datetime | None:
    return None if unix is None else datetime.fromtimestamp(unix, UTC)


def _stop_as_its_caller_may_not_spend(batch: Batch) -> None:
    """End the batch as a cancel does (lines in flight finish; what finished is kept, billed and written)."""
    if Batch.objects.filter(pk=batch.pk, status=BatchStatus.IN_PROGRESS).update(status=BatchStatus.CANCELLING,
                                                                                 cancelling_at=DatabaseClock()):
        record_event_once(batch.endpoint, EventKind.BATCH, f"Batch {batch.pk} stopped: the key or member that created it "
                          "may no longer call the API (revoked, expired, removed or a viewer)", batch_id=batch.pk)


def _on_this_clock(moment: datetime, ahead_s: float | None = None) -> float:
    """`moment`, a time by PostgreSQL's clock, as a unix time on this process's clock (`time.time()`, the runner's);
    `ahead_s`: how far this process's clock is ahead of PostgreSQL's (`_ahead_of_the_database_s`), read if None.

    NOTE: a batch's window ends by PostgreSQL's clock (`create_batch`); compared with a worker's own as it stood, a worker
    10 minutes ahead started no line in a batch's last 10 minutes."""
    return moment.timestamp() + (_ahead_of_the_database_s() if ahead_s is None else ahead_s)


def _ahead_of_the_database_s() -> float:
    """How far this process's clock (`time.time()`) is ahead of PostgreSQL's, in seconds (behind: negative)."""
    return time.time() - database_now().timestamp()


def _run_lines(batch: Batch, token: str, *, started: float) -> str:
    """Run the lines not yet done, read from the input as slots free, each waited for at most
    `runner.LINES_END_WITHIN_S` from the first one's read, and all of them ended within the task's time limit,
    counted from `started` (before the input's check, in a batch's first run), less `RUN_FINISH_MARGIN_S`."""
    if batch.endpoint.deleted_at is not None:
        return "gone"
    caller = caller_of(batch)
    if caller is None:
        _stop_as_its_caller_may_not_spend(batch)
        return "cancel"
    if not usage_writer.usage_recordable():
        # NOTE: its journal past its limit (PostgreSQL took no writes for a while), the worker replays what it may and
        # counts the folder again first: only a replay or a count clears it, and a run that went no further never
        # made one, so the worker's batches waited for ever with the journal's rows unwritten.
        run_briefly(usage_writer.replay_before_the_loop_ends(runner.REPLAY_JOURNAL_FOR_S))
    if not usage_writer.usage_recordable() or run_briefly(runner.free_slots(
            batch.organization_id, batch.endpoint_id, target_concurrency=batch.endpoint.target_concurrency)) == 0:
        return "full"  # NOTE: before its input is read: a run per `FULL_RETRY_S` must not read 200 MB each time
    _hold_lease_through_a_long_step(batch.pk, token)  # renewed each second once its lines run
    done = storage.result_indices(batch.organization_id, batch.pk)
    todo = _input_lines(batch, skip=done)
    num_todo = max(0, batch.num_total - len(done))
    lines_end_by = started + RUN_TIME_LIMIT_S - RUN_FINISH_MARGIN_S
    # NOTE: its refusals' times (`scheduling.stalled`) are stored by PostgreSQL's clock, as its window's end, and read
    # on this worker's (the runner's): stamped and gone on from by each run's own, a run on a worker 250 s ahead of the
    # last took 100 s of refusals as 350 s, past `STALL_S`, and the batch was left out of the demand as stalled.
    ahead_s = _ahead_of_the_database_s()

    def here(moment: datetime | None) -> float | None:
        return None if moment is None else _on_this_clock(moment, ahead_s)

    def stored(unix: float | None) -> datetime | None:
        return None if unix is None else _moment(unix - ahead_s)

    progress = runner.Progress(num_completed=sum(1 for ok in done.values() if ok),
                               num_failed=sum(1 for ok in done.values() if not ok),
                               refused_since=here(batch.refused_since), last_refused_at=here(batch.last_refused_at))
    endpoint = batch.endpoint
    work = runner.Work(batch_id=batch.pk, organization_id=batch.organization_id, endpoint_id=str(endpoint.pk),
                       model=endpoint.name,
                       kind=BATCH_PATHS[batch.request_path], request_path=batch.request_path, caller=caller,
                       price_fraction=endpoint.batch_price_fraction, target_concurrency=endpoint.target_concurrency,
                       expires_at=_on_this_clock(batch.expires_at, ahead_s))
    if num_todo and lines_end_by - runner.LINE_MIN_WAIT_S <= time.monotonic():
        record_event_once(endpoint, EventKind.BATCH, f"Batch {batch.pk}: checking its input took {time.monotonic() - started:.0f} s, "
                          "too long for this run to start a line in time; the next run starts them", batch_id=batch.pk)
    elif num_todo:
        record_event_once(endpoint, EventKind.BATCH, f"Batch {batch.pk}: {num_todo} line(s) fill spare slots of READY replicas "
                             f"(engine priority {scheduling.BATCH_ENGINE_PRIORITY})", batch_id=batch.pk)

    def keep_going(progress: runner.Progress) -> str:
        measured = {} if progress.line_concurrency is None else {
            "line_concurrency": progress.line_concurrency, "line_concurrency_at": stored(progress.line_concurrency_at)}
        renewed = Batch.objects.filter(pk=batch.pk, lease_token=token).update(
            lease_until=_lease_for(settings.BATCH_LEASE_S),
            num_completed=progress.num_completed, num_failed=progress.num_failed,
            refused_since=stored(progress.refused_since), last_refused_at=stored(progress.last_refused_at),
            **measured)
        if not renewed:
            return "lease"
        status, endpoint_deleted_at = Batch.objects.filter(pk=batch.pk).values_list(
            "status", "endpoint__deleted_at").first() or (None, None)
        if status != BatchStatus.IN_PROGRESS:
            return "cancel"
        if endpoint_deleted_at is not None:
            return "gone"
        if caller_of(batch) is None:
            _stop_as_its_caller_may_not_spend(batch)
            return "cancel"
        return ""

    refused: list[int] = []  # the lines whose answers were not kept, past the storage quota

    def store(outcome: runner.LineOutcome) -> runner.Stored:
        try:
            return _store(outcome)
        except LeaseLost:
            # NOTE: another run holds the batch (its lease lapsed through an outage longer than it): that run counts
            # and writes its lines; this one's answer, counted too, took the storage quota twice for one file row
            return runner.Stored(ok=False, kept=False, stop="lease")

    # NOTE: its ORM on the run's database threads (`BATCH_DB_SESSIONS`), its S3 put where it is called (`runner.run`'s
    # worker thread): a slow put holds none of the few threads the lease's checks need
    take_result_room = on_database_thread(_take_result_room)
    give_back_unrun_row_room = on_database_thread(_give_back_unrun_row_room)

    def _store(outcome: runner.LineOutcome) -> runner.Stored:
        row = outcome.row
        unrun_row_room = _unrun_row_room(batch.pk, outcome.line) if batch.num_unrun_row_bytes else 0
        if take_result_room(batch, len(row) + 1, token=token, num_unrun_row_bytes_freed=unrun_row_room):
            put_result(outcome.line.index, row, ok=outcome.status_code == 200, unrun_row_room=unrun_row_room)
            return runner.Stored(ok=outcome.status_code == 200)
        # NOTE: its answer is dropped, not stored past the quota: the run stops starting lines (each would be billed
        # for an answer it could not keep) and the batch fails with the lines that ran (`_fail_past_storage_quota`).
        error = runner.error_row(batch.pk, outcome.line.index, outcome.line.custom_id, code="storage_quota_exceeded",
                                 message=f"This request's answer ({len(row):,} bytes) was not kept: it would take your "
                                         "organisation's files past its storage quota (max_file_bytes). It ran, and is "
                                         "billed as any request that ran. Delete files the organisation no longer "
                                         "needs, or ask for a larger plan, and send the request again.")
        take_result_room(batch, len(error) + 1, past_quota=True, token=token, num_unrun_row_bytes_freed=unrun_row_room)
        put_result(outcome.line.index, error, ok=False, unrun_row_room=unrun_row_room)
        refused.append(outcome.line.index)
        return runner.Stored(ok=False, stop="quota")

    def put_result(index: int, row: bytes, *, ok: bool, unrun_row_room: int) -> None:
        try:
            storage.put_result(batch.organization_id, batch.pk, index, row, ok=ok)
        except Exception:
            try:
                if unrun_row_room:
                    give_back_unrun_row_room(batch, unrun_row_room)
            except Exception:
                # NOTE: the put's error is the one the run acts on, not this one (PostgreSQL away: the store tried
                # again would give up the line's room once more)
                logger.exception("batch %s: line %d's error row room could not be kept again", batch.pk, index)
            raise

    try:
        progress = run_briefly(runner.run(work, todo, progress, slice_s=settings.BATCH_RUN_SLICE_S,
                                          keep_going=keep_going, store=store, lines_end_by=lines_end_by),
                               num_database_threads=settings.BATCH_DB_SESSIONS)
    finally:
        # NOTE: minutes on, this thread's connection may have been cut meanwhile (a PostgreSQL restart the run went
        # through): checked before its next query, as between two requests, also when the run raised (else the
        # dead connection's error in `_release` hid the run's own)
        close_old_connections()
    if progress.stopped == "cold":
        # NOTE: the endpoint's demand as the autoscaler reads it (its keys' rate, its stalled batches left out)
        demand = read_demand([str(endpoint.pk)]).get(str(endpoint.pk))
        wake = None if demand is None else scheduling.wake_time(
            demand, target_concurrency=endpoint.target_concurrency, cold_start_s=endpoint.cold_start_timeout_s,
            seconds_per_line=settings.BATCH_SECONDS_PER_LINE)
        if wake is None:
            why = ("its lines' tries were all refused lately" if demand is None else
                   "its keys may send too few lines a minute to keep a replica busy")
            record_event_once(endpoint, EventKind.BATCH, f"Batch {batch.pk} waits: no READY replica, and batch work does "
                              f"not wake the endpoint: {why}; it runs when other traffic keeps a replica warm",
                              batch_id=batch.pk)
        else:
            record_event_once(endpoint, EventKind.BATCH, f"Batch {batch.pk} waits: no READY replica, and batch work does "
                              f"not wake the endpoint before {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(wake))} "
                              "(its deadline's need)", batch_id=batch.pk)
    elif progress.stopped == "quota":
        _fail_past_storage_quota(batch, min(refused))
    return progress.stopped or "ran"


# The longest a line's store waits for its organisation's row lock (`_take_result_room`): well within a lease.
STORE_LOCK_WAIT_S = 2.0


class LeaseLost(Exception):
    """The batch's lease is no longer the run's (`lease_token`): another run holds it."""


def _take_result_room(batch: Batch, num_bytes: int, *, token: str, past_quota: bool = False,
                      num_unrun_row_bytes_freed: int = 0) -> bool:
    """Count `num_bytes` more of the batch's results (`num_result_bytes`) against its organisation's `max_file_bytes`,
    under its row lock; False, counting nothing, when they would take it past the quota (unless `past_quota`: a line's
    error row, a few hundred bytes). Results within the room the batch kept at its creation (its input's size) always
    fit, and so do the rows its end writes for lines without results (room kept beside them, `num_unrun_row_bytes`).
    The result of a line gives back the room its row kept there (`num_unrun_row_bytes_freed`, `_unrun_row_room`), in
    the same update: a line with a result has no such row (a put that fails keeps it again,
    `_give_back_unrun_row_room`). NOTE: each line's room was kept beside its result too, and a batch whose results fit
    the quota was refused answers it had been billed for, and failed.
    `LeaseLost`, counting nothing, once the batch's lease is not `token` (the run's). NOTE: a batch kept room for
    its output equal to its input only, and its outputs were stored unchecked: a 300-byte line's answer may be 64 MiB,
    and 50,000 such lines took an organisation's S3 use far past its quota.

    Its locks are waited for `STORE_LOCK_WAIT_S` at most (`lock_timeout`): then an `OperationalError` (55P03), which
    the run treats as PostgreSQL away (`runner.DATABASE_AWAY`): the answer is stored again after its next check. NOTE:
    a store blocked on the organisation's row (another run's store, an upload) held one of the run's few database
    threads for as long as the lock was held."""
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SELECT set_config('lock_timeout', %s, true)", [f"{int(STORE_LOCK_WAIT_S * 1000)}ms"])
        limit, used, room = _storage_use(batch.organization_id)
        num_input_bytes, num_result_bytes, num_unrun_row_bytes, lease_token = Batch.objects.filter(
            pk=batch.pk).values_list("input_file__bytes", "num_result_bytes", "num_unrun_row_bytes", "lease_token").get()
        if lease_token != token:
            raise LeaseLost(batch.pk)
        freed = min(num_unrun_row_bytes, num_unrun_row_bytes_freed)
        # the room kept for the rows of the lines an expiry finds without results, beside the results so far
        kept = max(num_input_bytes, num_result_bytes + num_unrun_row_bytes)
        wanted = max(num_input_bytes, num_result_bytes + num_bytes + num_unrun_row_bytes - freed)
        if not past_quota and wanted > kept and used + room - kept + wanted > limit:
            return False
        if not Batch.objects.filter(pk=batch.pk, lease_token=token).update(
                num_result_bytes=F("num_result_bytes") + num_bytes,
                num_unrun_row_bytes=Greatest(F("num_unrun_row_bytes") - freed, 0)):
            raise LeaseLost(batch.pk)
    return True


def _give_back_unrun_row_room(batch: Batch, num_bytes: int) -> None:
    """The room a line's row kept (`_unrun_row_room`), given up as its result was counted (`_take_result_room`), kept
    again: its result's put failed, and the batch's end may write its row (`result_not_stored`, billed) unless a
    later run stores it. The batch ended meanwhile keeps none."""
    Batch.objects.open().filter(pk=batch.pk).update(num_unrun_row_bytes=F("num_unrun_row_bytes") + num_bytes)


def _fail_past_storage_quota(batch: Batch, index: int) -> None:
    """A batch whose line `index`'s answer did not fit its organisation's storage quota: finalized as `failed`, with the
    lines that ran (`run_batch` ends it), unless a cancel came first."""
    message = (f"The batch stopped at line {index + 1}: its answer would have taken your organisation's files past its "
               "storage quota (max_file_bytes). The lines that ran are in the output and error files; delete files "
               "the organisation no longer needs, or ask for a larger plan, and send the others again.")
    if Batch.objects.filter(pk=batch.pk, status=BatchStatus.IN_PROGRESS).update(
            status=BatchStatus.FINALIZING, finalizing_at=DatabaseClock(),
            errors=[LineError(index + 1, "storage_quota_exceeded", message).as_openai()]):
        record_event_once(batch.endpoint, EventKind.BATCH, f"Batch {batch.pk} failed: line {index + 1}'s answer would "
                          "have taken its organisation's files past its storage quota", batch_id=batch.pk)


def _delete_results(batch: Batch) -> bool:
    """A batch's line results, once it has ended (its output and error files hold what it keeps), and
    the moment they went (`results_deleted_at`); left to `sweep_ended_results` when S3 fails."""
    try:
        storage.delete_results(batch.organization_id, batch.pk)
    except Exception:
        logger.exception("could not delete the line results of %s", batch.pk)
        return False
    Batch.objects.filter(pk=batch.pk).update(results_deleted_at=DatabaseClock())
    return True


def sweep_ended_results(now=None) -> int:
    """Delete the line results still kept of batches that ended over `RESULTS_SWEPT_AFTER` ago (their
    run died, or S3 failed, between ending them and deleting them), oldest first, at most
    `NUM_RESULTS_SWEPT_PER_RUN`. Returns how many batches it emptied. `now`: PostgreSQL's clock if None, as the
    batches' ends are stamped (`finalize_batch`)."""
    before = database_time_ago(RESULTS_SWEPT_AFTER.total_seconds()) if now is None else now - RESULTS_SWEPT_AFTER
    ended = (Batch.objects.filter(status__in=FINAL_STATES, results_deleted_at__isnull=True)
             .filter(Q(completed_at__lt=before) | Q(failed_at__lt=before) | Q(expired_at__lt=before)
                     | Q(cancelled_at__lt=before))
             .order_by("created_at").only("id", "organization_id")[:NUM_RESULTS_SWEPT_PER_RUN])
    return sum(_delete_results(batch) for batch in ended)


def _billed_unstored(batch: Batch, done: Container[int]) -> set[int]:
    """The indexes of the batch's lines that ran and were billed (a usage row under `runner.line_request_id`) but
    whose result is not among `done`: S3 refused its put, and the batch ended before a run ran it again.

    NOTE: read through `usage_org_batch` (the organisation's rows of this batch, an index of batch rows alone), with no
    clock window: before, a filter on `batch_id` alone read the whole ledger, every tenant's, at each cancel or expiry,
    which any tenant could repeat at will; then the organisation's rows from an hour before the batch started, which
    read all of them in that range and missed a billed line when the worker that started the batch (its clock) was over
    an hour ahead of the process that wrote the row (its own). A batch that never reached in_progress ran no line."""
    if batch.in_progress_at is None:
        return set()
    prefix = runner.line_request_id(batch.pk, 0).removesuffix("0")
    billed = (UsageRecord.objects.filter(organization_id=batch.organization_id, batch_id=batch.pk)
              .filter(Q(status=UsageStatus.OK) | Q(cost__gt=0)).values_list("request_id", flat=True))
    indexes = (int(request_id.removeprefix(prefix)) for request_id in billed.iterator()
               if request_id.startswith(prefix) and request_id.removeprefix(prefix).isdigit())
    return {index for index in indexes if index not in done}


# The error file's message for a line an ended batch has no result for (`_unrun_rows`), by its code.
UNRUN_MESSAGES = {
    "result_not_stored": "This request ran and was billed, but its answer could not be stored.",
    "batch_expired": "This request could not be executed before the completion window expired.",
}


def _unrun_row(batch_id: str, index: int, custom_id: str | None, *, code: str) -> bytes:
    """The error file's row of line `index`, which has no result (`UNRUN_MESSAGES`); one whose input is gone has no
    `custom_id` (None), and its message names the line by its place in the input (its requests: blank lines are
    none)."""
    message = UNRUN_MESSAGES[code]
    if custom_id is None:
        message += (f" Its custom_id is unknown (the input file is gone): request {index + 1} of the input file (blank "
                    "lines not counted).")
    return runner.error_row(batch_id, index, custom_id, code=code, message=message)


def _longest_unrun_row(batch_id: str, index: int) -> int:
    """The bytes of line `index`'s longest row `_unrun_rows` may write, but its custom id's and its line's end: with its
    custom id, or with none (`null`, its input gone: no longer than a custom id of one character and a byte). It
    changes with the index by the number of digits of the index (its `id`) and of the index + 1 (its message) alone."""
    return max(max(len(_unrun_row(batch_id, index, "", code=code)) - len('""'),
                   len(_unrun_row(batch_id, index, None, code=code)) - len('"x"'))
               for code in UNRUN_MESSAGES)


def _unrun_row_room(batch_id: str, line: Line) -> int:
    """The room `line` keeps in its batch's `num_unrun_row_bytes` (`_unrun_rows_bytes`) until it has a result: its
    longest row, its custom id as JSON (as `Checked` counted it) and its line's end."""
    return _longest_unrun_row(batch_id, line.index) + len(json.dumps(line.custom_id)) + 1


def _unrun_rows_bytes(batch_id: str, num_lines: int, num_custom_id_bytes: int) -> int:
    """The most bytes the rows `_unrun_rows` may write for a batch of `num_lines` requests whose custom ids take
    `num_custom_id_bytes` as JSON (`Checked`): the sum of each line's `_unrun_row_room` (given back one by one as their
    results are counted, to 0 once each has one), its longest row computed once for each run of indexes whose rows are
    as long (0-8, 9, 10-98, 99, ...)."""
    total, first = num_custom_id_bytes + num_lines, 0
    while first < num_lines:
        # the indexes with as many digits as `first`, whose number (index + 1) has as many as its
        last = min(num_lines - 1, 10 ** len(str(first)) - 1, 10 ** len(str(first + 1)) - 2)
        total += (last - first + 1) * _longest_unrun_row(batch_id, first)
        first = last + 1
    return total


def _unrun_rows(batch: Batch, done: Container[int], lost: Container[int], *, expired: bool) -> Iterator[bytes]:
    """The error file's row of each line an ended batch has no result for, read from its input as the file is
    written: a line that ran and was billed but whose answer could not be stored (`result_not_stored`, whatever
    ended the batch: `lost`, from `_billed_unstored`), and, once it expired, each line it never ran (`batch_expired`).
    Once its input is gone, the lines not yet read have their rows all the same, without their custom ids.

    NOTE: a line billed whose result S3 refused to store is run again by the next run; a batch cancelled, expired or
    failed before that had it in neither file, or listed it as never run (`batch_expired`), though it was billed.
    NOTE: a line whose input was gone (deleted, or its object lost, after the batch began) was counted failed with no
    row: counts and files disagreed."""
    if not lost and not expired:
        return
    num_read = 0  # the lines read from the input so far (each with its row, or done)
    try:
        for line in _input_lines(batch, skip=done):
            num_read = line.index + 1
            if line.index in lost:
                yield _unrun_row(batch.pk, line.index, line.custom_id, code="result_not_stored")
            elif expired:
                yield _unrun_row(batch.pk, line.index, line.custom_id, code="batch_expired")
    except storage.ObjectGone:
        logger.warning("batch %s ended with its input file gone: its lines without results from request %d on are "
                       "listed without their custom ids", batch.pk, num_read + 1)
        for index in range(num_read, batch.num_total):
            if index in lost:
                yield _unrun_row(batch.pk, index, None, code="result_not_stored")
            elif expired and index not in done:
                yield _unrun_row(batch.pk, index, None, code="batch_expired")


def finalize_batch(batch: Batch, final: str, *, errors: list[dict] | None = None) -> None:
    """Write the output and error files from the line results kept in S3 and end the batch as
    `final` (completed, expired, cancelled, or failed with `errors`). Safe to repeat: a batch already ended is left
    as it is; one cancelled while its files were written ends `cancelled` instead.

    NOTE: a cancel is the one change another process makes to a running batch (the API, `cancel_batch`), and it may
    land after `final` was decided: the batch's end is written only from the state it was decided from. Before, a
    cancel arriving while an expiry's files were written ended the batch `expired` with `cancelling_at` set.
    NOTE: its steps (and its files' `stored_at`) by PostgreSQL's clock, as its creation and window (`create_batch`):
    stamped by the worker's, one 10 minutes behind showed the tenant a batch in progress and ended 10 minutes before it
    was created, and its results were swept 10 minutes late (`sweep_ended_results`)."""
    now = database_now()

    def finalizing() -> None:
        Batch.objects.filter(pk=batch.pk, status=BatchStatus.IN_PROGRESS).update(status=BatchStatus.FINALIZING,
                                                                                 finalizing_at=now)

    # NOTE: `finalizing` before its results are listed (seconds, for a large batch): a cancel meanwhile was taken,
    # and ended a batch whose every line had run `cancelled`; it is a 409 (`cancel_batch`)
    if final == BatchStatus.COMPLETED:
        finalizing()
    # NOTE: each result read, written on and dropped (`storage.result_bodies`): a batch's results were all parsed in
    # memory, with both files whole beside them, and a large batch's took its worker past its memory limit (with the
    # other tenants' runs in it) at every try, its lines billed and its files never written.
    keys = storage.result_keys(batch.organization_id, batch.pk)
    if final == BatchStatus.EXPIRED and len(keys) >= batch.num_total:
        # NOTE: every line has its result (the last ones answered after the deadline, before this run wrote the files):
        # `completed`, as its files say. It ended `expired`, with no line expired.
        final = BatchStatus.COMPLETED
        finalizing()
    num_ok = sum(1 for result in keys.values() if result.ok)
    # counted failed; a completed batch has every line's result
    lost = _billed_unstored(batch, keys) if final != BatchStatus.COMPLETED else set()
    unrun = _unrun_rows(batch, keys, lost, expired=final == BatchStatus.EXPIRED)
    first_unrun = next(unrun, None)
    if first_unrun is not None:
        unrun = itertools.chain((first_unrun,), unrun)
    output = (_store_output(batch.organization_id, f"{batch.pk}_output.jsonl", storage.result_bodies(keys, ok=True))
              if num_ok else None)
    error = (_store_output(batch.organization_id, f"{batch.pk}_error.jsonl",
                           itertools.chain(storage.result_bodies(keys, ok=False), unrun))
             if len(keys) > num_ok or first_unrun is not None else None)
    files = [file for file in (output, error) if file is not None]
    # NOTE: a line is counted failed where the error file has its row: an expiry's rows are every line without a
    # result (`_unrun_rows`), counted failed as OpenAI counts its `batch_expired` lines. Before, only the billed but
    # unstored ones were: an expired batch of 3 lines never run said 0 failed of 3, with 3 rows in its error file.
    num_failed = (batch.num_total if final == BatchStatus.EXPIRED else len(keys) + len(lost)) - num_ok
    stamp = {BatchStatus.COMPLETED: "completed_at", BatchStatus.EXPIRED: "expired_at",
             BatchStatus.CANCELLED: "cancelled_at", BatchStatus.FAILED: "failed_at"}[final]
    with transaction.atomic():
        locked = Batch.objects.select_for_update().get(pk=batch.pk)
        ended_first = locked.status in FINAL_STATES
        cancelled_meanwhile = locked.status == BatchStatus.CANCELLING and final != BatchStatus.CANCELLED
        if not ended_first and not cancelled_meanwhile:
            if sum(File.objects.filter(pk=file.pk, stored_at__isnull=True).update(
                    stored_at=now, bytes=file.bytes, expires_at=_output_expiry(batch, file)) for file in files) != len(files):
                raise RuntimeError(f"the output files of {batch.pk} were swept as abandoned: the next run writes them")
            Batch.objects.filter(pk=batch.pk).update(
                status=final, output_file=output, error_file=error, num_completed=num_ok,
                num_failed=num_failed,
                **{stamp: now},
                **({"errors": errors} if errors is not None else {}))
    if ended_first or cancelled_meanwhile:  # another run finished it first (its files stand), or it was cancelled
        _discard_outputs(files)
        if cancelled_meanwhile:
            finalize_batch(locked, BatchStatus.CANCELLED)  # its files as a cancel writes them (no `batch_expired` rows)
        return
    _delete_results(batch)

