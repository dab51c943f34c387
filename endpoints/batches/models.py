"""Files and batches: metadata only. A file's bytes, a batch's per-line results and its output and
error files live in S3 (`endpoints.batches.storage`), never in PostgreSQL."""

from __future__ import annotations

import secrets
from datetime import timedelta

from django.db import models
from django.db.models.functions import Now
from django.utils import timezone

from controlplane.text import storable

COMPLETION_WINDOWS = {"24h": timedelta(hours=24)}
# An upload whose row is older than this and still not stored died with its process: swept by the batch tick
# (`services.sweep_abandoned_uploads`). The longest an upload may take: one of a row with no lease counts until then.
UPLOAD_ABANDONED_AFTER = timedelta(hours=1)
# The paths a batch line may call (OpenAI's `endpoint`), and the gateway's kind of each.
BATCH_PATHS = {"/v1/chat/completions": "chat", "/v1/completions": "completion", "/v1/embeddings": "embedding",
               "/v1/responses": "responses"}


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


def new_batch_id() -> str:
    return f"batch_{secrets.token_hex(12)}"


class FilePurpose(models.TextChoices):
    BATCH = "batch", "Batch input"
    BATCH_OUTPUT = "batch_output", "Batch output"


class NamedQuerySet(models.QuerySet):
    def named(self, identifier: str):
        """The row a caller names (a path segment or a body's string): one no id can be, with a NUL or a
        lone surrogate in it, finds nothing (PostgreSQL refuses them: an error, not a miss)."""
        return self.filter(pk=identifier) if storable(identifier) else self.none()


class FileQuerySet(NamedQuerySet):
    def for_org(self, organization_id: int):
        """The organisation's stored files that are not deleted nor past their `expires_at`: every user-facing lookup
        starts here (an expired file is gone to its tenant at once; `services.sweep_expired_files` deletes it)."""
        return self.filter(models.Q(expires_at__isnull=True) | models.Q(expires_at__gt=Now()),
                           organization_id=organization_id, stored_at__isnull=False, deleted_at__isnull=True)

    def held_by(self, organization_id: int):
        """What counts against the organisation's storage quota: its files not deleted, and its uploads in progress
        while their lease is live (`File.upload_lease_until`), or, with no lease, for `UPLOAD_ABANDONED_AFTER` from
        their start.

        NOTE: a row with no lease is an upload started by code older than leases (a rolling deploy), which never
        renews one: it counts as that code counted it, until the sweep's age. Counted only once stored, a second
        upload was let in beside it past the quota, and older code stores without checking again."""
        return self.filter(models.Q(stored_at__isnull=False) | models.Q(upload_lease_until__gt=Now())
                           | models.Q(upload_lease_until__isnull=True, created_at__gt=Now() - UPLOAD_ABANDONED_AFTER),
                           organization_id=organization_id, deleted_at__isnull=True)


class File(models.Model):
    id = models.CharField(primary_key=True, max_length=40, default=new_file_id, editable=False)
    organization = models.ForeignKey("controlplane.Organization", on_delete=models.PROTECT, related_name="+")
    purpose = models.CharField(max_length=16, choices=FilePurpose.choices)
    filename = models.CharField(max_length=255)
    bytes = models.BigIntegerField()
    s3_key = models.CharField(max_length=300)
    created_at = models.DateTimeField(default=timezone.now)
    # None while its bytes are being uploaded: the row holds its place in the storage quota first. The
    # database's default (now) keeps a row written any other way stored, by older code during a deploy too.
    stored_at = models.DateTimeField(null=True, blank=True, db_default=Now())
    deleted_at = models.DateTimeField(null=True, blank=True)
    # An upload in progress counts against the storage quota until then (PostgreSQL's clock), a lease renewed while
    # its process works on it (`services.upload_held`). NOTE: the row of an upload whose process died counted its whole
    # declared size until the hourly sweep (`services.sweep_abandoned_uploads`), which still removes it; now it
    # stops counting once its lease lapses. None: older code's upload (`FileQuerySet.held_by`), or a batch's output
    # file being written (0 bytes until the batch ends).
    upload_lease_until = models.DateTimeField(null=True, blank=True)
    # OpenAI's `expires_after` (anchor `created_at`): past it the file is gone to its tenant and deleted, its bytes
    # with it (`services.sweep_expired_files`). None: kept until deleted.
    expires_at = models.DateTimeField(null=True, blank=True)

    objects = FileQuerySet.as_manager()

    class Meta:
        indexes = [
            models.Index(fields=["organization", "created_at"], name="file_org_created"),
            models.Index(fields=["created_at"], condition=models.Q(stored_at__isnull=True), name="file_uploading"),
            models.Index(fields=["expires_at"], condition=models.Q(expires_at__isnull=False, deleted_at__isnull=True),
                         name="file_expiring"),
            # each organisation's expired files, oldest first (`services.sweep_expired_files`, batches/0013)
            models.Index(fields=["organization", "expires_at", "id"],
                         condition=models.Q(expires_at__isnull=False, deleted_at__isnull=True),
                         name="file_org_expiring"),
        ]

    def __str__(self) -> str:
        return self.id

    def as_openai(self) -> dict:
        """OpenAI's file object."""
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": int(self.created_at.timestamp()),
                "filename": self.filename, "purpose": self.purpose, "status": "processed",
                "expires_at": int(self.expires_at.timestamp()) if self.expires_at is not None else None,
                "status_details": None}


class BatchStatus(models.TextChoices):
    """OpenAI's lifecycle: validating → in_progress → finalizing → completed; or failed (bad input, its input gone,
    or, through finalizing, its answers past the storage quota), expired (the completion window ended first),
    cancelling → cancelled."""

    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


# States in which a worker still has something to do (validate, run lines, or write the files).
OPEN_STATES = (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING, BatchStatus.CANCELLING)
FINAL_STATES = (BatchStatus.FAILED, BatchStatus.COMPLETED, BatchStatus.EXPIRED, BatchStatus.CANCELLED)


class BatchQuerySet(NamedQuerySet):
    def for_org(self, organization_id: int):
        return self.filter(organization_id=organization_id)

    def open(self):
        return self.filter(status__in=OPEN_STATES)


class Batch(models.Model):
    id = models.CharField(primary_key=True, max_length=40, default=new_batch_id, editable=False)
    organization = models.ForeignKey("controlplane.Organization", on_delete=models.PROTECT, related_name="+")
    # Who created it: its lines run with this key's limits (a console session's batch: the user's).
    api_key = models.ForeignKey("controlplane.ApiKey", on_delete=models.SET_NULL, null=True, blank=True, related_name="+")
    created_by = models.ForeignKey("auth.User", on_delete=models.SET_NULL, null=True, blank=True, related_name="+")
    # The endpoint every line names (`body.model`); known once the input is validated.
    endpoint = models.ForeignKey("endpoints.Endpoint", on_delete=models.PROTECT, null=True, blank=True, related_name="batches")
    request_path = models.CharField(max_length=64)  # OpenAI's `endpoint`, e.g. "/v1/chat/completions"
    input_file = models.ForeignKey(File, on_delete=models.PROTECT, related_name="+")
    output_file = models.ForeignKey(File, on_delete=models.SET_NULL, null=True, blank=True, related_name="+")
    error_file = models.ForeignKey(File, on_delete=models.SET_NULL, null=True, blank=True, related_name="+")
    completion_window = models.CharField(max_length=8, default="24h")
    # OpenAI's `output_expires_after.seconds`: its output and error files expire this long after their creation
    # (`File.expires_at`); None: kept until deleted.
    output_expires_after_s = models.PositiveIntegerField(null=True, blank=True)
    metadata = models.JSONField(null=True, blank=True)
    status = models.CharField(max_length=16, choices=BatchStatus.choices, default=BatchStatus.VALIDATING)
    errors = models.JSONField(null=True, blank=True)  # OpenAI's `errors.data`: one entry per bad line
    num_total = models.PositiveIntegerField(default=0)
    num_completed = models.PositiveIntegerField(default=0)
    num_failed = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField()  # the completion window's deadline
    in_progress_at = models.DateTimeField(null=True, blank=True)
    finalizing_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    failed_at = models.DateTimeField(null=True, blank=True)
    expired_at = models.DateTimeField(null=True, blank=True)
    cancelling_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)
    # The worker running it holds it until `lease_until` (renewed while it runs): a killed worker's
    # batch is taken over once that passes.
    lease_until = models.DateTimeField(null=True, blank=True)
    lease_token = models.CharField(max_length=32, blank=True)
    # Runs that began validating it: a file whose check keeps dying (a killed worker, a bug) fails the
    # batch after `services.MAX_VALIDATION_ATTEMPTS` instead of holding a place in every tick.
    num_validation_attempts = models.PositiveSmallIntegerField(default=0, db_default=0)
    # Bytes of its line results stored so far (each row and its line's end: what its output and error files will
    # hold), counted against the organisation's `max_file_bytes` before each is stored (`services._take_result_room`).
    num_result_bytes = models.PositiveBigIntegerField(default=0, db_default=0)
    # The most bytes the error rows of its lines without a result may take in its error file as it ends (each line's
    # longest such row, `services._unrun_rows_bytes`), set as its check ends: room it keeps beside its results, so that
    # an expiry's rows never take the organisation past its `max_file_bytes`. 0: a batch checked before it was kept.
    num_unrun_row_bytes = models.PositiveBigIntegerField(default=0, db_default=0)
    # When its line results (`storage.put_result`) were deleted, once it ended; None while they may be in
    # S3: `services.sweep_ended_results` deletes those of batches ended a while ago (a run that died first).
    results_deleted_at = models.DateTimeField(null=True, blank=True)
    # Written by its runs (`runner.Progress`): since when every try of its lines has been refused (429, 5xx: left
    # pending), None once a line finished after them, and the last refusal. Batch work refused for
    # `scheduling.STALL_S` holds and wakes no replica (`demand.read_demand`).
    refused_since = models.DateTimeField(null=True, blank=True)
    last_refused_at = models.DateTimeField(null=True, blank=True)
    # The lines its last run kept in flight over the minute before `line_concurrency_at`, none refused
    # (`scheduling.LineUse`): the most READY replicas its work holds (/ target concurrency, one at least).
    line_concurrency = models.FloatField(null=True, blank=True)
    line_concurrency_at = models.DateTimeField(null=True, blank=True)

    objects = BatchQuerySet.as_manager()

    class Meta:
        indexes = [
            models.Index(fields=["organization", "created_at"], name="batch_org_created"),
            models.Index(fields=["status"], name="batch_status"),
            models.Index(fields=["created_at"], condition=models.Q(results_deleted_at__isnull=True),
                         name="batch_results_kept"),
            # the batches whose output files are given their expiry (`services.backfill_output_expiry`, batches/0013)
            models.Index(fields=["created_at"], condition=models.Q(output_expires_after_s__isnull=False),
                         name="batch_output_expiring"),
        ]

    def __str__(self) -> str:
        return self.id

    @property
    def num_pending(self) -> int:
        return max(0, self.num_total - self.num_completed - self.num_failed)

    def as_openai(self) -> dict:
        """OpenAI's batch object."""

        def unix(moment):
            return int(moment.timestamp()) if moment is not None else None

        return {
            "id": self.id, "object": "batch", "endpoint": self.request_path,
            "errors": {"object": "list", "data": self.errors} if self.errors else None,
            "input_file_id": self.input_file_id, "completion_window": self.completion_window, "status": self.status,
            "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
            "created_at": unix(self.created_at), "in_progress_at": unix(self.in_progress_at),
            "expires_at": unix(self.expires_at), "finalizing_at": unix(self.finalizing_at),
            "completed_at": unix(self.completed_at), "failed_at": unix(self.failed_at),
            "expired_at": unix(self.expired_at), "cancelling_at": unix(self.cancelling_at),
            "cancelled_at": unix(self.cancelled_at),
            "request_counts": {"total": self.num_total, "completed": self.num_completed, "failed": self.num_failed},
            "metadata": self.metadata,
        }


class IdempotentRequest(models.Model):
    """A creation sent with an `Idempotency-Key` (`endpoints.batches.idempotency`): claimed by the request making it
    (`token`, until `locked_until`), then the answer it gave, replayed to a request sending the key again.

    NOTE: one row per organisation, caller and key, held by the database's unique constraint: of two requests sending
    one key at once, one inserts the row and the other finds it, never both creating."""

    organization = models.ForeignKey("controlplane.Organization", on_delete=models.CASCADE, related_name="+")
    # The caller that sent the key (`Caller.limit_subject`: `key:<id>`, or `user:<id>` for a console session).
    subject = models.CharField(max_length=40)
    key = models.CharField(max_length=255)
    # What the request asked for (`idempotency.request_digest`); "" until an upload's file has been read.
    request_digest = models.CharField(max_length=64, blank=True)
    token = models.CharField(max_length=32)
    # The claim lapses then, by PostgreSQL's clock (a process that died creating): another request takes the key over.
    locked_until = models.DateTimeField()
    # The answer of the object created, None while the creation runs (failures save nothing: the key is freed).
    response_status = models.PositiveSmallIntegerField(null=True, blank=True)
    response_body = models.JSONField(null=True, blank=True)
    # Set by PostgreSQL's clock; the key is kept `idempotency.KEPT_FOR` from then.
    created_at = models.DateTimeField(db_default=Now())

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["organization", "subject", "key"], name="idempotent_request_key"),
        ]
        indexes = [models.Index(fields=["created_at"], name="idempotent_request_created")]

    def __str__(self) -> str:
        return f"{self.subject} {self.key}"
