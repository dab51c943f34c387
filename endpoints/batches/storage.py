"""File bytes in S3: uploads, reads, deletes, and a batch's per-line results.

The bucket is the fleet's (`INFERPLANE_FILES_S3_BUCKET`, at `INFERPLANE_FILES_S3_ENDPOINT_URL` for an
S3-compatible store; credentials from boto3's usual chain). Nothing here touches PostgreSQL: the rows
that name these objects are `endpoints.batches.models`.

Keys: `files/<organisation>/<file id>` for every file; `batches/<organisation>/<batch id>/lines/<index>.json`
for one line's result, written as the line finishes, so a batch taken over after a worker's death
skips what is already done.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import io
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime

import boto3
from asgiref.sync import sync_to_async
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import ClientError
from django.conf import settings

logger = logging.getLogger(__name__)

RESULT_DIGITS = 7
# A batch's input is read in ranged parts of this size (`read_parts`): never whole in memory, and no connection
# held open through a long run.
INPUT_PART_BYTES = 8 * 1024 * 1024
# An upload streams to S3 in parts of this size as it is parsed (`StreamedUpload`; S3's parts but the last are >= 5 MiB).
UPLOAD_PART_BYTES = 8 * 1024 * 1024
# A download is read from S3 and sent on in chunks of this size (`open_stream`).
DOWNLOAD_CHUNK_BYTES = 64 * 1024
FILES_PREFIX = "files/"  # every file's key (`file_key`)
READ_THREADS = 16  # within the client's connection pool (32)
# The most bytes of line results a batch's finalize reads ahead of the one it writes (`result_bodies`), with at least
# one result in flight however large. NOTE: it read 2 × READ_THREADS results ahead whatever their size: lines whose
# answers are 20–30 MB each (`n`, logprobs) held ~1 GB, past a batch worker's 1 GiB shared by four runs, and the
# worker was killed at every try, the batch finalizing for ever (with the other tenants' runs in it).
RESULTS_READ_AHEAD_BYTES = 32 * 1024 * 1024
# A result larger than `INPUT_PART_BYTES` goes into its file in ranged reads of this size, each as the one before is
# used (`result_bodies`): a line's answer may be 64 MiB (`spool`).
RESULT_PART_BYTES = 2 * 1024 * 1024
# A batch's output and error files go up two 8 MiB parts at a time (boto3's default sends ten at once: 80 MiB held).
OUTPUT_TRANSFER = TransferConfig(multipart_chunksize=8 * 1024 * 1024, max_concurrency=2)
# NOTE: and read ahead of the parts going up no more than two (s3transfer's default reads ten ahead of a stream that
# cannot seek: up to 80 MiB held whatever `max_concurrency` is; boto3's own config does not name it).
OUTPUT_TRANSFER.max_in_memory_upload_chunks = 2


@functools.cache
def _client():
    return boto3.client("s3", endpoint_url=settings.FILES_S3_ENDPOINT_URL, region_name=settings.FILES_S3_REGION,
                        config=Config(retries={"max_attempts": 5, "mode": "standard"}, max_pool_connections=32))


# A read made while a client waits for its answer (`read_start`): one try, given up soon. NOTE: the run's client retries
# five times with boto3's 60 s timeouts: a stalled S3 held a batch's creation for minutes, and the openai client, timed
# out, sent it again. NOTE: `total_max_attempts`, not `max_attempts`: boto3 reads the latter as retries after the first
# try, so `max_attempts: 1` made two tries, and a stalled S3 held each quick call for two read timeouts (10 s).
QUICK_READ = Config(retries={"total_max_attempts": 1, "mode": "standard"}, connect_timeout=2, read_timeout=5)


@functools.cache
def _quick_client():
    return boto3.client("s3", endpoint_url=settings.FILES_S3_ENDPOINT_URL, region_name=settings.FILES_S3_REGION,
                        config=QUICK_READ)


def forget_clients() -> None:
    """Drop the S3 clients made so far (`_client`, `_quick_client`): the next call makes them from the settings again
    (a test's S3 server and bucket). NOTE: one place for both: a test that dropped only the run's kept the quick one,
    bound to an S3 server an earlier test had stopped."""
    _client.cache_clear()
    _quick_client.cache_clear()


# How long a `read_start` goes on reading the object's bytes, whatever pace S3 sends them at: it ends within this and
# one `QUICK_READ` read timeout (an S3 sending a byte every 3 s held a batch's creation for ever).
READ_START_WITHIN_S = 5.0
READ_START_CHUNK_BYTES = 64 * 1024


def read_start(key: str, num_bytes: int) -> bytes:
    """The object's first `num_bytes` at most, in one ranged GET that gives up within seconds (`QUICK_READ`, and its
    bytes read a chunk at a time until `READ_START_WITHIN_S` has passed: `TimeoutError`): for a check made while a client
    waits, which may be skipped (its error raised) but never held up."""
    deadline = time.monotonic() + READ_START_WITHIN_S
    try:
        answer = _quick_client().get_object(Bucket=settings.FILES_S3_BUCKET, Key=key, Range=f"bytes=0-{num_bytes - 1}")
    except ClientError as exc:
        if _error_code(exc) == "InvalidRange":
            return b""  # an empty object
        raise
    body = answer["Body"]
    chunks: list[bytes] = []
    num_read = 0
    try:
        while num_read < num_bytes:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the first {num_bytes} bytes of {key} took longer than {READ_START_WITHIN_S} s")
            # NOTE: `read1` answers with what has come (each wait at most `QUICK_READ`'s read timeout): `read(n)` waits
            # for all n bytes, each byte starting the timeout again
            chunk = body._raw_stream.read1(min(READ_START_CHUNK_BYTES, num_bytes - num_read))
            if not chunk:
                break
            chunks.append(chunk)
            num_read += len(chunk)
    finally:
        body.close()
    return b"".join(chunks)


def file_key(organization_id: int, file_id: str) -> str:
    return f"{FILES_PREFIX}{organization_id}/{file_id}"


def put_stream(key: str, stream) -> None:
    """Upload a readable binary stream (multipart for large ones, never whole in memory)."""
    _client().upload_fileobj(stream, settings.FILES_S3_BUCKET, key)


class StreamedUpload:
    """An object written as its bytes arrive (`write`), in parts of `UPLOAD_PART_BYTES` (S3's multipart upload): at
    most a part of it in memory and none on disk. `complete` makes the object; `abort` leaves nothing of it (a killed
    process leaves its parts to `abort_incomplete_uploads`)."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.size = 0
        self._pending = bytearray()
        self._upload_id: str | None = None  # asked with the first full part: a small file is one PUT
        self._parts: list[dict] = []

    def write(self, data: bytes) -> None:
        self._pending += data
        self.size += len(data)
        while len(self._pending) >= UPLOAD_PART_BYTES:
            self._send_part(UPLOAD_PART_BYTES)

    def _send_part(self, num_bytes: int) -> None:
        if self._upload_id is None:
            self._upload_id = _client().create_multipart_upload(Bucket=settings.FILES_S3_BUCKET, Key=self.key)["UploadId"]
        number = len(self._parts) + 1
        answer = _client().upload_part(Bucket=settings.FILES_S3_BUCKET, Key=self.key, UploadId=self._upload_id,
                                       PartNumber=number, Body=bytes(self._pending[:num_bytes]))
        self._parts.append({"PartNumber": number, "ETag": answer["ETag"]})
        del self._pending[:num_bytes]

    def complete(self) -> None:
        if self._upload_id is None:
            put_bytes(self.key, bytes(self._pending))
        else:
            if self._pending:
                self._send_part(len(self._pending))
            _client().complete_multipart_upload(Bucket=settings.FILES_S3_BUCKET, Key=self.key, UploadId=self._upload_id,
                                                MultipartUpload={"Parts": self._parts})
            # NOTE: a completed upload is no longer S3's to abort: an abort after it (its row swept meanwhile, then
            # `abort` as the upload is abandoned) was S3's NoSuchUpload, and the caller's 408 became a 503.
            self._upload_id = None
        self._pending = bytearray()

    def abort(self) -> None:
        self._pending = bytearray()
        if self._upload_id is not None:
            _client().abort_multipart_upload(Bucket=settings.FILES_S3_BUCKET, Key=self.key, UploadId=self._upload_id)
            self._upload_id = None


def abort_incomplete_uploads(*, initiated_before: datetime) -> int:
    """Abort the multipart uploads under `files/` that S3 still holds unfinished, begun before `initiated_before`:
    those of a process killed mid-upload (an upload's parse, a batch's output file going up). Their parts are stored
    and paid for, yet no object nor row names them, and no quota counts them. Returns how many it aborted."""
    num_aborted = 0
    paginator = _client().get_paginator("list_multipart_uploads")
    for page in paginator.paginate(Bucket=settings.FILES_S3_BUCKET, Prefix=FILES_PREFIX):
        for upload in page.get("Uploads", []):
            if not upload["Key"].startswith(FILES_PREFIX) or upload["Initiated"] >= initiated_before:
                continue
            try:
                _client().abort_multipart_upload(Bucket=settings.FILES_S3_BUCKET, Key=upload["Key"],
                                                 UploadId=upload["UploadId"])
            except ClientError as exc:
                if _error_code(exc) != "NoSuchUpload":  # completed or aborted since it was listed
                    raise
                continue
            num_aborted += 1
    return num_aborted


def put_bytes(key: str, data: bytes) -> None:
    _client().put_object(Bucket=settings.FILES_S3_BUCKET, Key=key, Body=data)


class ObjectGone(Exception):
    """The object is not in the bucket, or no longer readable with the fleet's credentials: reading it again will
    not help (unlike a timeout or a 5xx, which boto3 already retried and which are raised as they are). `missing`:
    S3 said the key is not there (the fleet may list the bucket, so that is what a deleted object answers); otherwise
    the object may well be there, unreadable (`AccessDenied`: an IAM policy or KMS key changed; `NoSuchBucket`), and
    readable again once the operator mends it: a caller treats it as S3 failing (a 503, a batch's attempt failed), never
    as gone."""

    def __init__(self, key: str, *, code: str | None = None) -> None:
        super().__init__(key)
        self.missing = code in MISSING_CODES


# S3's codes for an object that is not there (or that the fleet may not read): a GetObject's, and a HEAD's.
GONE_CODES = frozenset({"NoSuchKey", "NoSuchBucket", "AccessDenied", "404", "403"})
# Those of them that say the key is not in the bucket (NOTE: the fleet holds `s3:ListBucket`, `result_keys`, so S3
# answers a missing key with these, never with `AccessDenied`).
MISSING_CODES = frozenset({"NoSuchKey", "404"})


def _error_code(exc: ClientError) -> str | None:
    return exc.response.get("Error", {}).get("Code")


def _get_object(key: str) -> dict:
    """S3's GetObject of `key`: `ObjectGone` when it is not there (or not readable); any other failure as it is."""
    try:
        return _client().get_object(Bucket=settings.FILES_S3_BUCKET, Key=key)
    except ClientError as exc:
        if (code := _error_code(exc)) in GONE_CODES:
            raise ObjectGone(key, code=code) from exc
        raise


def check_object(key: str) -> None:
    """S3's HeadObject of `key` (no bytes read): `ObjectGone` when it is not there (or not readable), as GetObject
    would be (`_get_object`); any other failure as it is. For a HEAD, so that it answers as the GET would."""
    try:
        _client().head_object(Bucket=settings.FILES_S3_BUCKET, Key=key)
    except ClientError as exc:
        if (code := _error_code(exc)) in GONE_CODES:
            raise ObjectGone(key, code=code) from exc
        raise


def read_bytes(key: str) -> bytes:
    return _get_object(key)["Body"].read()


def read_parts(key: str, *, part_bytes: int | None = None) -> Iterator[bytes]:
    """The object's bytes in order, one ranged GET of `part_bytes` at a time, each asked as the one before is used: at
    most a part in memory, and no connection held while the caller works. Every part is of the version the first
    was (`If-Match` its ETag): an object replaced meanwhile is `ObjectGone`, never two versions spliced."""
    part_bytes = part_bytes or INPUT_PART_BYTES
    start, etag = 0, None
    while True:
        asked = {"IfMatch": etag} if etag else {}
        try:
            answer = _client().get_object(Bucket=settings.FILES_S3_BUCKET, Key=key,
                                          Range=f"bytes={start}-{start + part_bytes - 1}", **asked)
        except ClientError as exc:
            code = _error_code(exc)
            if code == "InvalidRange" and start == 0:
                return  # an empty object has no range to ask for
            if code in GONE_CODES or code in ("PreconditionFailed", "412"):
                raise ObjectGone(key, code=code) from exc
            raise
        etag = answer["ETag"]
        data = answer["Body"].read()
        if data:
            yield data
        start += len(data)
        total = int(answer.get("ContentRange", "").rpartition("/")[2] or start)
        if not data or start >= total:
            return


def open_stream(key: str) -> AsyncIterator[bytes]:
    """The object's body as an asynchronous stream of chunks (for a download); the object is opened here, so that a
    missing one fails before the answer begins (`ObjectGone`).

    NOTE: asynchronous, each chunk read in a worker thread: Django under ASGI reads a synchronous iterator whole into
    a list before it sends the first byte (`StreamingHttpResponse.__aiter__`), so a download held its whole file in
    the web process's memory (`tests/batches/test_file_downloads.py`)."""
    return _chunks_of(_get_object(key)["Body"])


async def _chunks_of(body) -> AsyncIterator[bytes]:
    chunks = body.iter_chunks(DOWNLOAD_CHUNK_BYTES)
    read_whole = False
    try:
        while chunk := await sync_to_async(next, thread_sensitive=False)(chunks, b""):
            yield chunk
        read_whole = True
    finally:
        # NOTE: a download cut off: its S3 connection closed now, not whenever the collector finds it. Cut mid-read, a
        # worker thread may still be in `next`, holding the socket's reader lock: closing the body here waited for that
        # read (up to botocore's 60 s on a stalled S3) with the event loop, every request of the process, blocked
        # (found by the review of the web's soak). Its read is cut first (urllib3's `shutdown`, made to be called from
        # another thread), the body then closed off the loop.
        if read_whole:
            body.close()
        else:
            raw = getattr(body, "_raw_stream", None)
            if raw is not None and hasattr(raw, "shutdown"):
                # NOTE: cut after its last bytes were read (and its connection went back to the pool), urllib3 refuses
                with contextlib.suppress(ValueError, RuntimeError, OSError):
                    raw.shutdown()
            closing = asyncio.get_running_loop().run_in_executor(None, body.close)
            closing.add_done_callback(_closed)


def _closed(closing: asyncio.Future) -> None:
    if not closing.cancelled() and (error := closing.exception()) is not None:
        logger.warning("closing a cut download's S3 body failed: %r", error)


def delete(key: str, *, quick: bool = False) -> None:
    """`quick`: one try, given up within seconds (`QUICK_READ`), for a sweep that tries again on its next run."""
    (_quick_client() if quick else _client()).delete_object(Bucket=settings.FILES_S3_BUCKET, Key=key)


# --- a batch's per-line results --------------------------------------------------------------

def _results_prefix(organization_id: int, batch_id: str) -> str:
    return f"batches/{organization_id}/{batch_id}/lines/"


def put_result(organization_id: int, batch_id: str, index: int, row, *, ok: bool) -> None:
    """One finished line, its row of the output (or error) file as it will be written (`<index>.ok.json` or
    `<index>.error.json`: counts come from the listing alone): bytes, or a seekable file of a known `len()` read as it
    is sent (`spool.SpooledRow`: an answer larger than a worker keeps in memory)."""
    put_bytes(f"{_results_prefix(organization_id, batch_id)}{index:0{RESULT_DIGITS}d}.{'ok' if ok else 'error'}.json",
              row)


@dataclass(slots=True, frozen=True)
class StoredResult:
    key: str
    ok: bool
    num_bytes: int


def _result_keys(organization_id: int, batch_id: str) -> dict[int, StoredResult]:
    prefix = _results_prefix(organization_id, batch_id)
    paginator = _client().get_paginator("list_objects_v2")
    found = {}
    for page in paginator.paginate(Bucket=settings.FILES_S3_BUCKET, Prefix=prefix):
        for item in page.get("Contents", []):
            index, outcome, _ = item["Key"][len(prefix):].split(".")
            found[int(index)] = StoredResult(item["Key"], outcome == "ok", item["Size"])
    return found


def result_indices(organization_id: int, batch_id: str) -> dict[int, bool]:
    """The lines finished so far: index -> whether it succeeded."""
    return {index: result.ok for index, result in _result_keys(organization_id, batch_id).items()}


def delete_results(organization_id: int, batch_id: str) -> None:
    """A batch's line results, once its output and error files hold them."""
    paginator = _client().get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=settings.FILES_S3_BUCKET, Prefix=_results_prefix(organization_id, batch_id)):
        keys = [item["Key"] for item in page.get("Contents", [])]  # at most 1,000: S3's most per delete
        if keys:
            answer = _client().delete_objects(Bucket=settings.FILES_S3_BUCKET,
                                              Delete={"Objects": [{"Key": key} for key in keys], "Quiet": True})
            if answer.get("Errors"):
                raise RuntimeError(f"S3 kept {len(answer['Errors'])} line results of {batch_id}: {answer['Errors'][0]}")


def result_keys(organization_id: int, batch_id: str) -> dict[int, StoredResult]:
    """The lines finished so far: index -> its result (key, whether it succeeded, size), in line order."""
    return dict(sorted(_result_keys(organization_id, batch_id).items()))


def result_bodies(keys: dict[int, StoredResult], *, ok: bool) -> Iterator[bytes | Iterator[bytes]]:
    """The JSON of each result in `keys` that succeeded (or failed), as written, in line order; up to `READ_THREADS`
    read at a time, and those read ahead of the one handed on never more than `RESULTS_READ_AHEAD_BYTES` together
    (but one at least): a batch's results are never all in memory at once, however large each is. One larger than
    `INPUT_PART_BYTES` is handed on as its parts of `RESULT_PART_BYTES`, each read as the one before is used
    (`read_parts`): a line's answer may be 64 MiB (`spool`), and was read whole beside the file's upload."""
    wanted = [result for result in keys.values() if result.ok == ok]
    with ThreadPoolExecutor(READ_THREADS) as pool:
        ahead: deque[tuple[Future, int]] = deque()
        num_ahead_bytes = 0
        for result in wanted:
            large = result.num_bytes > INPUT_PART_BYTES
            while ahead and (large or len(ahead) >= 2 * READ_THREADS
                             or num_ahead_bytes + result.num_bytes > RESULTS_READ_AHEAD_BYTES):
                future, num_bytes = ahead.popleft()
                num_ahead_bytes -= num_bytes
                yield future.result()
            if large:
                yield read_parts(result.key, part_bytes=RESULT_PART_BYTES)
                continue
            ahead.append((pool.submit(read_bytes, result.key), result.num_bytes))
            num_ahead_bytes += result.num_bytes
        while ahead:
            yield ahead.popleft()[0].result()


class _JsonLines(io.RawIOBase):
    """A file to read from an iterator of JSON texts, one per line: what `upload_fileobj` reads a part at a time. A row
    is bytes, or an iterator of its pieces in order (a large result read a part at a time: `result_bodies`).

    NOTE: each row is copied straight into the reader's buffer: they were gathered in a buffer of their own first
    and sliced out of it, three copies of a part held at once, and a row of 60 MiB (a long answer) a fourth."""

    def __init__(self, rows: Iterable[bytes | Iterator[bytes]]) -> None:
        self._rows = iter(rows)
        self._pieces: deque[memoryview] = deque()  # what is left of the row being read, and its line's end
        self._parts: Iterator[bytes] | None = None  # the pieces still to come of a row handed on in pieces
        self.size = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        num = 0
        while num < len(view):  # NOTE: full reads but the last: S3's parts but the last are >= 5 MiB
            if not self._pieces and self._parts is not None:
                part = next(self._parts, None)
                if part is None:
                    self._parts = None
                    self._pieces.append(memoryview(b"\n"))
                else:
                    self._pieces.append(memoryview(part))
                continue
            if not self._pieces:
                row = next(self._rows, None)
                if row is None:
                    break
                if isinstance(row, bytes):
                    self._pieces.extend((memoryview(row), memoryview(b"\n")))
                else:  # its pieces, read as they are used: one part held at a time
                    self._parts = iter(row)
                continue
            piece = self._pieces.popleft()
            taken = min(len(piece), len(view) - num)
            view[num:num + taken] = piece[:taken]
            num += taken
            if taken < len(piece):
                self._pieces.appendleft(piece[taken:])
        self.size += num
        return num


def put_lines(key: str, rows: Iterable[bytes]) -> int:
    """Upload `rows` as JSON lines, a part at a time (never whole in memory); returns the object's size."""
    body = _JsonLines(rows)
    _client().upload_fileobj(body, settings.FILES_S3_BUCKET, key, Config=OUTPUT_TRANSFER)
    return body.size
