"""Where model weights come from: parsing a model source, listing its files, reading ranges of each.

Sources:
    s3://bucket/prefix       boto3; listed with the objects' keys, sizes and ETags
    hf:org/name[@revision]   the Hub's HTTP API; listed at the commit the revision points at
    /absolute/path           used in place, never copied (`weights_paths.check_local_model_dir`)

A listing names every file with its size before anything is downloaded (`weights_paths` checks the
names), so the cache can size the model against its disk budget first. `open_range` reads part of
one listed file, pinned to the listed version, and says how large the store holds the file to be;
`s3_checksum` and the Hub listing's digests say what a whole file must hash to. The transfer
(`weights_transfer`) writes the parts; the cache (`weights.WeightsCache`) decides where the files go
and whether a download is needed at all; the clients and the errors a customer may see come from
`weights_access`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import quote

import botocore.exceptions
import urllib3.exceptions

from gpu_agent.runtime.weights_access import (
    ModelTooLarge,
    SourceUnreadable,
    WeightsError,
    fetch_stopped,
    hf_errors,
    hf_raise_for_status,
    s3_errors,
    unreadable,
)
from gpu_agent.runtime.weights_paths import check_model_file_names
from gpu_agent.runtime.weights_watchdog import (
    FIRED_DEADLINE,
    FIRED_STOPPED,
    RequestGuard,
    guarded,
    watch_new_connections,
)

_CHUNK_BYTES = 8 * 1024 * 1024
MAX_MODEL_FILES = 10_000  # a listing of a million tiny objects would exhaust inodes, not bytes
# An S3 listing is read from a store the tenant may run. A page holds at most 1,000 keys of at most 1,024
# bytes: well under 4 MiB of XML. botocore reads a whole answer into memory, then parses it at several times
# its size, so a larger page is refused while it arrives; pages beyond what MAX_MODEL_FILES needs (a store
# answering endless continuation tokens) and a listing slower than its deadline are refused too.
MAX_LISTING_PAGE_BYTES = 4 * 1024 * 1024
MAX_LISTING_PAGES = MAX_MODEL_FILES // 1000 + 5
LISTING_TIMEOUT_S = 300.0
_LISTING_READ_BYTES = 64 * 1024
_HEX64 = re.compile(r"[0-9a-f]{64}")
_HEX40 = re.compile(r"[0-9a-f]{40}")
_HF_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass(slots=True)
class ModelSource:
    kind: str  # "s3", "hf", "local"
    location: str  # bucket/prefix, org/name, or the path
    revision: str = ""

    @classmethod
    def parse(cls, source: str) -> ModelSource:
        if source.startswith("s3://"):
            rest = source[len("s3://") :].strip("/")
            if not rest:
                raise ValueError(f"bad S3 source {source!r}")
            return cls("s3", rest)
        if source.startswith("hf:"):
            name, _, revision = source[len("hf:") :].partition("@")
            if not _HF_REPO_ID.fullmatch(name) or ".." in name:
                raise ValueError(f"bad Hugging Face source {source!r}: expected hf:org/name[@revision]")
            if any(ord(ch) <= 32 or ord(ch) == 127 for ch in revision):
                raise ValueError(f"bad Hugging Face revision in {source!r}")
            return cls("hf", name, revision or "main")
        if os.path.isabs(source):
            return cls("local", source)
        raise ValueError(f"unknown model source {source!r}")

    @property
    def bucket_and_prefix(self) -> tuple[str, str]:
        bucket, _, prefix = self.location.partition("/")
        return bucket, prefix


@dataclass(slots=True, frozen=True)
class RemoteFile:
    name: str  # relative to the model folder, checked by `check_model_file_names`
    parts: tuple[str, ...]
    size_bytes: int
    location: str  # the S3 object key, or the Hub URL of the file at the listed commit
    etag: str = ""
    digest: tuple[str, str] | None = None  # ("sha256" | "git-blob-sha1", hex), where the Hub lists one


@dataclass(slots=True)
class Download:
    """A model being downloaded: the fetchers advance it, heartbeats report it."""

    source: str
    cache_key: str
    size_bytes: int = 0
    downloaded_bytes: int = 0
    scope: str = ""  # the weights_scope it is read in
    disk_bytes: int = 0  # what it is charged on disk (`weights_paths.disk_bytes`), at least size_bytes


class FileRange:
    """The bytes `start`..`end` (inclusive) of one listed file, as the store sends them.

    `total_bytes` is the whole file's size as the store states it (None when it does not say);
    `chunks` yields the range's bytes, and never reads past the range.
    """

    def __init__(self, chunks, total_bytes: int | None, num_skipped_bytes: int = 0) -> None:
        self.chunks = chunks
        self.total_bytes = total_bytes
        self.num_skipped_bytes = num_skipped_bytes  # sent before the range by a store that ignored it


@contextlib.contextmanager
def open_range(parsed: ModelSource, client, remote: RemoteFile, start: int, end: int) -> Iterator[FileRange]:
    """Read part of one listed file (`weights_transfer` writes it where it belongs)."""
    if parsed.kind == "s3":
        with _s3_range(client, parsed, remote, start, end) as part:
            yield part
    else:
        with _hf_range(client, parsed, remote, start, end) as part:
            yield part


def _total_from_content_range(value: str | None) -> int | None:
    """`bytes 0-9/100` -> 100 (None for `*` or a malformed header)."""
    total = (value or "").rpartition("/")[2]
    return int(total) if total.isdigit() else None


# -- S3 -------------------------------------------------------------------------


def s3_listing(client, parsed: ModelSource, source: str, *, timeout_s: float = LISTING_TIMEOUT_S,
               stop: threading.Event | None = None) -> list[RemoteFile]:
    """The objects under the prefix (every name checked, "folder" markers skipped); `stop` ends it with `FetchStopped`.

    NOTE: bounded whatever the store answers: each page's bytes (read as they arrive), the number of
    pages and the time the whole listing takes (`MAX_LISTING_PAGE_BYTES`, `MAX_LISTING_PAGES`, `timeout_s`),
    headers included, which a client made by `weights_access.s3_client` lets the watchdog enforce mid-read.
    """
    bucket, prefix = parsed.bucket_and_prefix
    prefix = prefix.rstrip("/") + "/" if prefix else ""
    deadline = time.monotonic() + timeout_s
    # NOTE: botocore has no public hook that reads an answer before it is buffered whole: this one sends
    # the request on the client's own connection pool and reads the answer itself (registered once per client).
    client.meta.events.register(
        "before-send.s3.ListObjectsV2", functools.partial(_send_listing_page, client._endpoint.http_session),
        unique_id="inferplane-bounded-listing",
    )
    objects = []
    guard = RequestGuard((stop,) if stop is not None else (), deadline)
    with (_refusal_naming(source), _why_guard_fired(guard, source, timeout_s), s3_errors(source),
          _listing_deadline(deadline), guarded(guard)):
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        for num_pages, page in enumerate(_entries_checked(pages, guard), start=1):
            if num_pages > MAX_LISTING_PAGES:
                raise ListingRefused(f"its store answered more than {MAX_LISTING_PAGES} listing pages")
            if time.monotonic() > deadline:
                raise ListingRefused(f"listing it took longer than {timeout_s:.0f} s")
            for item in page.get("Contents", []):
                key, size = item.get("Key"), item.get("Size")
                if not isinstance(key, str) or not isinstance(size, int) or size < 0:
                    raise ListingRefused(_MALFORMED_ENTRY)
                if key.endswith("/") and size == 0:  # a console's "folder" marker
                    continue
                objects.append((key, size, str(item.get("ETag", "")).strip('"')))
                if len(objects) > MAX_MODEL_FILES:
                    raise ModelTooLarge(f"{source} holds more than {MAX_MODEL_FILES} files")
    if not objects:
        raise unreadable(source)
    parts = check_model_file_names(key[len(prefix) :] for key, _, _ in objects)
    return [
        RemoteFile(name, parts[name], size, key, etag)
        for (key, size, etag), name in ((entry, entry[0][len(prefix) :]) for entry in objects)
    ]


class ListingRefused(SourceUnreadable):
    """A store's listing this agent will not read to its end (too large, too many pages, too slow)."""


# NOTE: a tenant's store may answer anything. An entry with no key, no size, a negative size (before: the download's
# ftruncate failed with EINVAL, reported as the node's own I/O trouble) or a size that is not a number (botocore's
# int() raised ValueError mid-parse) is the store's fault, said so like any other refused listing.
_MALFORMED_ENTRY = "its store answered a listing entry that is not an object with a name and a size of 0 or more bytes"


def _entries_checked(pages, guard: RequestGuard):
    try:
        yield from pages
    except (ValueError, TypeError, AttributeError):
        if guard.fired:  # a socket the watchdog shut mid-read: `_why_guard_fired` says why
            raise
        raise ListingRefused(_MALFORMED_ENTRY) from None


_listing = threading.local()  # the deadline of the listing this thread is reading


@contextlib.contextmanager
def _listing_deadline(deadline: float) -> Iterator[None]:
    _listing.deadline = deadline
    try:
        yield
    finally:
        _listing.deadline = None


@contextlib.contextmanager
def _why_guard_fired(guard: RequestGuard, source: str, timeout_s: float) -> Iterator[None]:
    """A listing whose socket the watchdog shut: drained (`FetchStopped`), or past its deadline."""
    try:
        yield
    except ListingRefused:
        raise  # already says why (the watchdog may have fired as the listing's own check refused it)
    except Exception:
        if guard.fired == FIRED_STOPPED:
            raise fetch_stopped(source) from None
        if guard.fired == FIRED_DEADLINE:
            raise ListingRefused(f"listing it took longer than {timeout_s:.0f} s") from None
        raise


@contextlib.contextmanager
def _refusal_naming(source: str) -> Iterator[None]:
    try:
        yield
    except ListingRefused as exc:
        raise ListingRefused(f"cannot list {source}: {exc}") from None


def _send_listing_page(http_session, request, **_):
    """botocore's before-send of ListObjectsV2: send it, and read the answer only up to its bounds."""
    request.stream_output = True  # the session leaves the body unread; it is read here
    response = http_session.send(request)
    deadline = getattr(_listing, "deadline", None) or time.monotonic() + LISTING_TIMEOUT_S
    body = bytearray()
    try:
        while chunk := response.raw.read1(_LISTING_READ_BYTES):
            body += chunk
            if len(body) > MAX_LISTING_PAGE_BYTES:
                raise ListingRefused(f"its store answered a listing page over {MAX_LISTING_PAGE_BYTES >> 20} MiB")
            if time.monotonic() > deadline:
                raise ListingRefused("its store sends its listing too slowly")
    except ListingRefused:
        response.raw.close()  # never back into the pool with unread bytes
        raise
    response._content = bytes(body)  # what `AWSResponse.content` would have read, whole
    return response


@contextlib.contextmanager
def _s3_range(client, parsed, remote: RemoteFile, start: int, end: int) -> Iterator[FileRange]:
    source = f"s3://{parsed.location}"
    bucket, _ = parsed.bucket_and_prefix
    arguments = {"Bucket": bucket, "Key": remote.location, "Range": f"bytes={start}-{end}"}
    if remote.etag:  # every byte from the version the listing saw: a replaced object is a 412
        arguments["IfMatch"] = f'"{remote.etag}"'
    with s3_errors(source):
        answer = client.get_object(**arguments)
        body = answer["Body"]
        try:
            total = _total_from_content_range(answer.get("ContentRange"))
            chunks = _arriving_chunks(body)
            if total is None and not answer.get("ContentRange"):  # a store that ignored the range
                total = int(answer.get("ContentLength") or 0)
                yield FileRange(_skip(chunks, start), total, start)
            else:
                yield FileRange(chunks, total)
        finally:
            body.close()


def _arriving_chunks(body):
    """The body's bytes as they arrive (each read waits for one socket read at most, `read_timeout`).

    NOTE: `iter_chunks` waits until a whole chunk has arrived, so a store dripping a byte a minute would
    hold the reading thread for ever: the transfer could neither see its throughput nor stop it.
    """
    raw = getattr(body, "_raw_stream", None)  # botocore's StreamingBody over urllib3's response
    if raw is None or not hasattr(raw, "read1"):
        yield from body.iter_chunks(_CHUNK_BYTES)
        return
    # NOTE: urllib3's errors as botocore's `StreamingBody.read` raises them, so a reset or a read timeout stays
    # a transient failure the transfer retries (`weights_transfer._TRANSIENT`), not the end of the download.
    while True:
        try:
            chunk = raw.read1(_CHUNK_BYTES)
        except urllib3.exceptions.ReadTimeoutError as exc:
            raise botocore.exceptions.ReadTimeoutError(endpoint_url=str(exc)) from exc
        except urllib3.exceptions.ProtocolError as exc:
            raise botocore.exceptions.ResponseStreamingError(error=exc) from exc
        if not chunk:
            return
        yield chunk


def _skip(chunks, num_bytes: int):
    """The chunks after the first `num_bytes` (a store that answered a ranged read with everything)."""
    for chunk in chunks:
        if num_bytes >= len(chunk):
            num_bytes -= len(chunk)
            continue
        yield chunk[num_bytes:]
        num_bytes = 0


# -- Hugging Face ---------------------------------------------------------------


def hub_endpoint(hf_endpoint: str | None) -> str:
    """The Hub's base URL: the configured one, else huggingface_hub's (which reads HF_ENDPOINT)."""
    from huggingface_hub import constants

    return (hf_endpoint or constants.ENDPOINT).rstrip("/")


def hf_listing(client, parsed: ModelSource, source: str, hub: str, *, timeout_s: float = LISTING_TIMEOUT_S,
               stop: threading.Event | None = None) -> tuple[list[RemoteFile], str]:
    """The repo's files at the revision (every name checked, every size known) and its commit.

    NOTE: within `timeout_s` whatever the Hub does, and `stop` ends it with `FetchStopped` (`weights_watchdog`)."""
    from huggingface_hub import hf_hub_url

    url = f"{hub}/api/models/{parsed.location}/revision/{quote(parsed.revision, safe='')}"
    guard = RequestGuard((stop,) if stop is not None else (), time.monotonic() + timeout_s)
    with _refusal_naming(source), _why_guard_fired(guard, source, timeout_s), hf_errors(source), guarded(guard):
        response = client.get(url, params={"blobs": "true"}, extensions={"trace": watch_new_connections})
    hf_raise_for_status(response, source)
    try:
        info = response.json()
        siblings = [(entry["rfilename"], entry.get("size")) for entry in info.get("siblings") or []]
        digests = {entry["rfilename"]: _hub_digest(entry) for entry in info.get("siblings") or []}
        sha = str(info.get("sha") or parsed.revision)
    except (ValueError, TypeError, KeyError, AttributeError):
        raise WeightsError(f"{source}: the Hub's answer about the repo is malformed") from None
    if not siblings:
        raise unreadable(source)
    if len(siblings) > MAX_MODEL_FILES:
        raise ModelTooLarge(f"{source} holds more than {MAX_MODEL_FILES} files")
    parts = check_model_file_names(name for name, _ in siblings)
    for name, size in siblings:
        if not isinstance(size, int) or size < 0:
            raise WeightsError(f"{source}: the Hub did not say how large {name!r} is")
    files = [
        RemoteFile(
            name, parts[name], size, hf_hub_url(parsed.location, name, revision=sha, endpoint=hub),
            digest=digests.get(name),
        )
        for name, size in siblings
    ]
    return files, sha


def _hub_digest(entry: dict) -> tuple[str, str] | None:
    """What the Hub says a file's bytes hash to: an LFS file's SHA-256, else its git blob's SHA-1."""
    lfs = entry.get("lfs")
    if isinstance(lfs, dict) and _HEX64.fullmatch(str(lfs.get("sha256") or "")):
        return ("sha256", lfs["sha256"])
    blob = str(entry.get("blobId") or "")
    return ("git-blob-sha1", blob) if _HEX40.fullmatch(blob) else None


@contextlib.contextmanager
def _hf_range(client, parsed, remote: RemoteFile, start: int, end: int) -> Iterator[FileRange]:
    # NOTE: the URL names the commit the listing saw, so every range comes from the same content.
    # NOTE: each range opens its own connection (`hf_client` keeps none), whose socket the read's guard can shut
    # (`weights_watchdog.watch_new_connections`); the body is taken as it arrives (`iter_bytes()` with no size
    # waits for nothing more), so the transfer sees a dripping mirror's throughput and its stop between reads.
    source = f"hf:{parsed.location}@{parsed.revision}"
    headers = {"Range": f"bytes={start}-{end}", "Accept-Encoding": "identity"}
    with hf_errors(source), client.stream(
        "GET", remote.location, headers=headers, extensions={"trace": watch_new_connections}
    ) as response:
        hf_raise_for_status(response, source)
        if response.status_code == 206:
            yield FileRange(response.iter_bytes(), _total_from_content_range(response.headers.get("content-range")))
        else:  # a mirror that ignores ranges sends the whole file
            length = response.headers.get("content-length")
            total = int(length) if length and length.isdigit() else None
            yield FileRange(_skip(response.iter_bytes(), start), total, start)


# -- what a file's bytes must hash to -------------------------------------------


_MD5_ETAG = re.compile(r"[0-9a-f]{32}")
_MULTIPART_ETAG = re.compile(r"([0-9a-f]{32})-([1-9][0-9]{0,4})")


@dataclass(slots=True, frozen=True)
class S3Checksum:
    """An S3 object's ETag as a digest: MD5 of the bytes, or of the parts' MD5s (`part_sizes`)."""

    etag: str
    part_sizes: tuple[int, ...] = ()  # empty for a single-part upload


def s3_checksum(client, parsed: ModelSource, remote: RemoteFile, *, exact_parts: bool = False) -> S3Checksum | None:
    """What the object's ETag says about its bytes, or None when it says nothing checkable.

    A single-part upload's ETag is the MD5 of its bytes; a multipart upload's is the MD5 of its
    parts' MD5s, `-<count>`, so the part sizes are read from the store (`HeadObject PartNumber`):
    the first part's size for all but the last (what uploaders do), or with `exact_parts` each
    part's own. Objects encrypted with KMS or a customer's key have ETags that are not digests.
    """
    source = f"s3://{parsed.location}"
    bucket, _ = parsed.bucket_and_prefix
    single, multipart = _MD5_ETAG.fullmatch(remote.etag), _MULTIPART_ETAG.fullmatch(remote.etag)
    if not (single or multipart):
        return None
    with s3_errors(source):
        head = client.head_object(Bucket=bucket, Key=remote.location, IfMatch=f'"{remote.etag}"')
        if head.get("ServerSideEncryption", "").startswith("aws:kms") or head.get("SSECustomerAlgorithm"):
            return None
        if single:
            return S3Checksum(remote.etag)
        count = int(multipart.group(2))
        if count == 1:
            return S3Checksum(remote.etag, (remote.size_bytes,))
        # NOTE: a part's HEAD is not pinned with IfMatch (some stores answer with the part's own
        # ETag); the bytes were, so a size read from a newer version only fails the check.
        first = int(client.head_object(Bucket=bucket, Key=remote.location, PartNumber=1).get("ContentLength") or 0)
        if not exact_parts:
            if first <= 0 or first * (count - 1) >= remote.size_bytes:
                return None
            return S3Checksum(remote.etag, (first,) * (count - 1) + (remote.size_bytes - first * (count - 1),))
        sizes = [first] + [
            int(client.head_object(Bucket=bucket, Key=remote.location, PartNumber=number)["ContentLength"])
            for number in range(2, count + 1)
        ]
    return S3Checksum(remote.etag, tuple(sizes)) if sum(sizes) == remote.size_bytes else None
