"""An upload's file part, sent to S3 as Django parses the body: `/v1/files` (`api`) and the console's batch form
(`views`) store a file the same way, with one copy of it on the web pod's disk.

NOTE: Django's ASGI handler has already written the whole body to a temporary file, in `/tmp` past 2.5 MB; its
`TemporaryFileUploadHandler` wrote the file a second time beside it, so that one upload of 130 MiB passed the web
pod's 256 MiB `/tmp` volume and had the pod evicted. The body's copy is now the only one on the disk
(`Gateway._upload_may_start` bounds how many there are on `/v1/files`).
"""

from __future__ import annotations

import hashlib
import logging

from botocore.exceptions import BotoCoreError, ClientError
from django.conf import settings
from django.core.files.uploadhandler import FileUploadHandler

from endpoints.batches import idempotency, renewal, services, storage
from endpoints.batches.models import File
from endpoints.gateway.upload_places import MULTIPART_OVERHEAD_BYTES  # noqa: F401  (the gateway's, used by api, views)

logger = logging.getLogger("inferplane.batches")

FILE_FIELD = "file"


def counted_bytes(declared: int) -> int:
    """What an upload whose body declared `declared` bytes (0: none) counts against its organisation's storage quota
    while it streams in.

    NOTE: its whole body (its file's size is known only at its end), at most the size limit (all of it for a body of
    no declared length); once stored, the file's own size."""
    return min(declared or settings.FILES_MAX_BYTES, settings.FILES_MAX_BYTES)


class SizeLimit(FileUploadHandler):
    """Refuses an upload (413, `services.Refused`) as soon as it passes the limit, before the rest is read."""

    def receive_data_chunk(self, raw_data, start):
        if start + len(raw_data) > settings.FILES_MAX_BYTES:
            raise services.Refused(f"The file is larger than {settings.FILES_MAX_BYTES} bytes.", param="file",
                                   status=413)
        return raw_data

    def file_complete(self, file_size):
        return None


class FileDigest(FileUploadHandler):
    """The SHA-256 of the body's `file` part (`digest`, None when it has none), read as Django parses the body; other
    file parts are dropped. Install it (`handle`) before anything reads `request.POST` or `request.FILES`."""

    def __init__(self, request):
        super().__init__(request)
        self.sha256 = None

    @classmethod
    def handle(cls, request, **kwargs):
        """The request's upload handlers made `SizeLimit` and a new handler of this class, which it returns."""
        handler = cls(request, **kwargs)
        request.upload_handlers = [SizeLimit(request), handler]
        return handler

    @property
    def digest(self) -> str | None:
        return self.sha256.hexdigest() if self.sha256 is not None else None

    def new_file(self, field_name, file_name, *args, **kwargs):
        super().new_file(field_name, file_name, *args, **kwargs)
        if field_name != FILE_FIELD:
            return
        if self.sha256 is not None:
            raise services.Refused("Send one file, as the field 'file'.", param="file")
        self.sha256 = hashlib.sha256()

    def receive_data_chunk(self, raw_data, start):
        if self.field_name == FILE_FIELD:
            self.sha256.update(raw_data)
        return None

    def file_complete(self, file_size):
        return None


class StreamToStorage(FileDigest):
    """Sends the body's `file` part to S3 as Django parses it (`storage.StreamedUpload`), its row started
    (`services.start_upload`: the quota checked) as the part begins, its lease held till it is stored or taken back
    (`services.upload_held`), its digest taken on the way (`FileDigest`). Install it (`handle`) before anything reads
    `request.POST` or `request.FILES`; then `finish` it, or `abandon` it on every other way out (`finished` says
    which)."""

    def __init__(self, request, *, organization_id: int, reserved: int):
        super().__init__(request)
        self.organization_id, self.reserved = organization_id, reserved
        self.file: File | None = None
        self.stream: storage.StreamedUpload | None = None
        self.finished = False
        self.held: renewal.Renewal | None = None

    def new_file(self, field_name, file_name, *args, **kwargs):
        super().new_file(field_name, file_name, *args, **kwargs)
        if field_name != FILE_FIELD:
            return
        self.file = services.start_upload(organization_id=self.organization_id, filename=file_name, size=self.reserved)
        self.stream = storage.StreamedUpload(self.file.s3_key)
        # NOTE: renewed by a thread, not between the body's chunks: S3 slow with a part, or with the last part and the
        # completion (`finish`), outlasted the lease, and a concurrent upload was let in beside it past the quota.
        self.held = services.upload_held(self.file).start()

    def receive_data_chunk(self, raw_data, start):
        super().receive_data_chunk(raw_data, start)
        if self.field_name == FILE_FIELD:
            self.stream.write(raw_data)
        return None

    def finish(self, *, claim: idempotency.Claim | None = None, expires_after=None) -> File:
        """Store the file, to expire `expires_after` from its creation (`services.file_expiry`), its answer saved under
        the request's idempotency key (`claim`)."""
        try:
            self.stream.complete()
            file = services.finish_upload(self.file, size=self.stream.size, claim=claim, expires_after=expires_after)
        finally:
            self.held.stop()
        self.finished = True
        return file

    def abandon(self) -> None:
        """Leave nothing of an upload that will not be stored: its parts in S3 first, then its row.

        NOTE: the parts went after the row: a failure to take the row back (PostgreSQL away) left them in S3 for
        ever; now a failure to abort them is logged and left to `services.sweep_incomplete_uploads`."""
        if self.file is None or self.finished:
            return
        self.held.stop()
        try:
            self.stream.abort()
        except (BotoCoreError, ClientError):
            logger.warning("could not abort the upload of %s: its parts are swept later", self.file.pk, exc_info=True)
        services.abandon_upload(self.file)
