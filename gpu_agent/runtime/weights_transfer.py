"""Moving one model's bytes onto disk: parallel ranged reads, retries, resume, verification.

Every listed file is cut into parts of `part_bytes`, and a pool of threads fetches the parts of
all files with ranged reads (`weights_sources.open_range`), sharing the process's one client per
set of credentials (`weights_access.s3_client`):
  - S3 reads carry `IfMatch` with the listed ETag, so all of a file's bytes come from the version
    the listing saw; a replaced object fails the download rather than mixing two versions;
  - Hub reads name the listed commit in their URL, which never changes.
Each part is written at its own offset and never past its own range; a store whose answer states
a different size for the file than its listing did fails the download before the part is written.
A part that fails for a transient reason (the store unreachable, a dropped connection, a short
read, a store too slow for its deadline) is retried with backoff; a refusal fails the download at
once. A download whose replica was drained (`stop`) ends with `FetchStopped`, so the disk its listing
reserved is released. Both hold whatever the socket does: each request runs under a guard whose
watchdog shuts its socket (`weights_watchdog`).

Resume: the partial model lives in `.tmp/<cache key>.partial/` and the parts already written are
recorded in `.parts/<cache key>.json` (rewritten atomically after each part, once that part's bytes are durable:
`durable`). The cache key covers
the listing's ETags (or the Hub commit), so the next fetch of the same content, after a transient
failure or after the agent was killed, reopens the same folder and fetches only what is missing.
Any other failure removes both.

Verification, once a file is whole: its bytes are hashed and compared with what the store says
they are (S3: the ETag as an MD5 or multipart MD5, `weights_sources.s3_checksum`; the Hub: an LFS
file's SHA-256 or a git blob's SHA-1). A mismatch fails the fetch and discards the bytes.

Why not s3transfer's `download_file`: it neither resumes from bytes already on disk nor bounds
what it writes by the listing, and the Hub needs the same path anyway.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import botocore.exceptions
import httpx

from gpu_agent.runtime import durable, weights_sources
from gpu_agent.runtime.weights_access import StoreUnreachable, WeightsError, fetch_stopped
from gpu_agent.runtime.weights_index import remove_path
from gpu_agent.runtime.weights_paths import DownloadFolder
from gpu_agent.runtime.weights_sources import Download, ModelSource, RemoteFile
from gpu_agent.runtime.weights_watchdog import FIRED_DEADLINE, RequestGuard, guarded

logger = logging.getLogger(__name__)

_HASH_CHUNK_BYTES = 8 * 1024 * 1024
# What a part may fail with and still be retried: the store or the network, never a refusal.
_TRANSIENT = (
    StoreUnreachable, botocore.exceptions.ConnectionError, botocore.exceptions.HTTPClientError,
    botocore.exceptions.ReadTimeoutError, httpx.TransportError, ConnectionError, TimeoutError,
)


@dataclass(slots=True, frozen=True)
class TransferSettings:
    """How a model is fetched: part size, parallel reads, and retries of each part."""

    part_bytes: int = 16 * 1024 * 1024
    max_concurrency: int = 8
    attempts: int = 4
    first_backoff_s: float = 0.25
    # NOTE: a store may drip its bytes (a tenant's own server). A part's headers must arrive within `slow_grace_s`
    # and all of it within `slow_grace_s` plus its bytes at `min_bytes_per_s` (316 s for 16 MiB), and a part whose
    # average after `slow_grace_s` is under `min_bytes_per_s` is given up on sooner; it is retried, then the
    # download fails and the disk reserved for it is freed. The rate is per part and `max_concurrency` parts are
    # read at once, so 64 KiB/s asks 512 KiB/s of the node's link: a slow but steady link fetches a 100 GB model,
    # only a store that all but stops is given up on (`--min-download-kib-per-s`).
    min_bytes_per_s: int = 64 * 1024
    slow_grace_s: float = 60.0

    def __post_init__(self) -> None:
        if self.part_bytes < 1 or self.max_concurrency < 1 or self.attempts < 1 or self.min_bytes_per_s < 1:
            raise ValueError(f"bad transfer settings: {self}")
        if self.slow_grace_s <= 0 or self.first_backoff_s < 0:
            raise ValueError(f"bad transfer settings: {self}")


class _Stopped(Exception):
    """Another part failed: this one stops where it is (`written` bytes of it were counted)."""

    def __init__(self, written: int) -> None:
        super().__init__(written)
        self.written = written


class _ShortRead(ConnectionError):
    """A part's answer ended before its range did (a dropped connection)."""


class _SlowRead(ConnectionError):
    """A part's answer arrives slower than `TransferSettings.min_bytes_per_s`."""


class Transfer:
    """One model's download into `partial` (resuming what a previous attempt left there)."""

    def __init__(self, parsed: ModelSource, client, files: list[RemoteFile], partial: Path, journal: Path,
                 download: Download, on_progress, settings: TransferSettings,
                 stop: threading.Event | None = None) -> None:
        self.parsed, self.client, self.files = parsed, client, files
        self.partial, self.journal_path = partial, journal
        self.download, self.on_progress, self.settings = download, on_progress, settings
        self._lock = threading.Lock()
        # NOTE: one journal write at a time, each naming every part done before it; held across its fsyncs, so
        # `_lock` (every chunk's progress) never waits on the disk.
        self._journal_lock = threading.Lock()
        self._done: dict[str, set[int]] = {}
        self._stop = threading.Event()  # another part failed
        self._stopped_by_owner = stop or threading.Event()  # the replica that wanted it is gone

    # -- the whole download ---------------------------------------------------------------

    def run(self) -> DownloadFolder:
        """Fetch every missing part, verify every file, and return the complete folder (still in .tmp)."""
        resumed = self._read_journal()
        if not resumed:
            remove_path(self.partial)
        folder = DownloadFolder(self.partial, resume=resumed)
        fds: dict[str, int] = {}
        try:
            for remote in self.files:
                fds[remote.name] = folder.open_file(remote.parts, exclusive=not resumed)
                os.ftruncate(fds[remote.name], remote.size_bytes)
            parts = [
                (remote, index)
                for remote in self.files
                for index in range(self._num_parts(remote))
                if index not in self._done.get(remote.name, ())
            ]
            with self._lock:
                self.download.downloaded_bytes = sum(
                    self._part_span(remote, index)[1] - self._part_span(remote, index)[0] + 1
                    for remote in self.files for index in self._done.get(remote.name, ())
                )
            if resumed:
                logger.info("resuming %s: %d of %d bytes already on disk", self.download.source,
                            self.download.downloaded_bytes, self.download.size_bytes)
            self._fetch_all(parts, fds)
            self._check_wanted()
            for remote in self.files:
                self._verify(remote, fds[remote.name])
                folder.check_file(remote.parts, fds[remote.name])
                durable.sync_file(fds[remote.name])  # its size and bytes, whatever wrote them (an empty file too)
            folder.sync_folders([remote.parts for remote in self.files])  # the names of its files and folders
            folder.check_in_place()
        except BaseException:
            folder.close()
            raise
        finally:
            for fd in fds.values():
                os.close(fd)
        return folder

    def discard(self) -> None:
        """Forget the partial download (a failure that retrying the same bytes would not fix)."""
        remove_path(self.partial)
        self.journal_path.unlink(missing_ok=True)

    def _fetch_all(self, parts: list[tuple[RemoteFile, int]], fds: dict[str, int]) -> None:
        if not parts:
            return
        workers = max(1, min(self.settings.max_concurrency, len(parts)))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="weights") as pool:
            futures = [pool.submit(self._fetch_part, remote, index, fds[remote.name]) for remote, index in parts]
            finished, _ = wait(futures, return_when=FIRST_EXCEPTION)
            failed = next((f for f in futures if f.done() and f.exception() is not None), None)
            if failed is not None:
                self._stop.set()
                for future in futures:
                    future.cancel()
                wait(futures)
                raise failed.exception()

    # -- one part -------------------------------------------------------------------------

    def _num_parts(self, remote: RemoteFile) -> int:
        return max(1, -(-remote.size_bytes // self.settings.part_bytes))

    def _part_span(self, remote: RemoteFile, index: int) -> tuple[int, int]:
        start = index * self.settings.part_bytes
        return start, min(start + self.settings.part_bytes, remote.size_bytes) - 1

    def _fetch_part(self, remote: RemoteFile, index: int, fd: int) -> None:
        start, end = self._part_span(remote, index)
        if end < start:  # an empty file: nothing to read, its checksum still says it is empty
            self._part_done(remote, index)
            return
        delay = self.settings.first_backoff_s
        for attempt in range(1, self.settings.attempts + 1):
            if self._stop.is_set():
                return
            self._check_wanted()
            try:
                self._copy_range(remote, start, end, fd)
                # NOTE: durable before the journal says it is done: after a power loss, a part the journal named
                # could be zeros (the file was cut to its size first), skipped on resume, and only a checksum, where
                # the store gives one, caught it.
                durable.sync_file(fd)
                self._part_done(remote, index)
                return
            except _Stopped as stopped:
                self._advance(-stopped.written)
                return
            except _TRANSIENT as exc:
                self._advance(-getattr(exc, "inferplane_written", 0))
                if attempt == self.settings.attempts:
                    if isinstance(exc, StoreUnreachable):
                        raise
                    raise StoreUnreachable(
                        f"cannot reach the store of {self.download.source} (a read failed "
                        f"{attempt} times, the last: {_why(exc)}; the download resumes from what is on disk)"
                    ) from exc
                logger.info("part %d of %s failed (%r); retrying in %.2f s", index, remote.name, exc, delay)
                time.sleep(delay)
                delay *= 2
            except BaseException as exc:
                self._advance(-getattr(exc, "inferplane_written", 0))
                raise

    def _copy_range(self, remote: RemoteFile, start: int, end: int, fd: int) -> int:
        """Write one part; an exception leaving it carries the bytes already counted (`inferplane_written`)."""
        progress = [start]
        try:
            return self._copy_range_at(remote, start, end, fd, progress)
        except Exception as exc:
            exc.inferplane_written = progress[0] - start
            raise

    def _copy_range_at(self, remote: RemoteFile, start: int, end: int, fd: int, progress: list[int]) -> int:
        # NOTE: the guard's deadline bounds the whole request, headers included, whatever the socket does, and a
        # drain shuts the socket at once (`weights_watchdog`); the average below gives up sooner on a store that
        # drips its body. The average is timed from the part's first byte and counts what has arrived, so a store
        # that ignores the range (its bytes before this part are skipped unseen) or sends large chunks is not slow.
        requested_at = time.monotonic()
        guard = RequestGuard((self._stopped_by_owner, self._stop), requested_at + self.settings.slow_grace_s)
        try:
            with guarded(guard), weights_sources.open_range(self.parsed, self.client, remote, start, end) as part:
                guard.extend_to(requested_at + self._deadline_s(part.num_skipped_bytes + end + 1 - start))
                self._copy_chunks(remote, part, start, end, fd, progress, guard, requested_at)
        except _TRANSIENT:  # what a shut socket surfaces as (a refusal stays a refusal)
            self._raise_why_guard_fired(guard, remote, progress[0] - start, requested_at)
            raise
        if progress[0] != end + 1:
            self._raise_why_guard_fired(guard, remote, progress[0] - start, requested_at)
            raise _ShortRead(f"{remote.name}: got {progress[0] - start} of {end + 1 - start} bytes")
        return progress[0] - start

    def _copy_chunks(self, remote: RemoteFile, part, start: int, end: int, fd: int, progress: list[int],
                     guard: RequestGuard, requested_at: float) -> None:
        if part.total_bytes is not None and part.total_bytes != remote.size_bytes:
            if part.total_bytes > remote.size_bytes:
                raise self._larger(remote)
            raise WeightsError(
                f"{self.download.source}: {remote.name}: the store holds {part.total_bytes} bytes, "
                f"its listing announced {remote.size_bytes}"
            )
        offset = start
        started: float | None = None
        for chunk in part.chunks:
            self._raise_why_guard_fired(guard, remote, offset - start, requested_at, check_due=True)
            if started is None:
                started = time.monotonic()
            else:
                self._check_throughput(remote, offset - start + len(chunk), started)
            room = end + 1 - offset
            if len(chunk) > room:
                # NOTE: checked before writing, so a store that sends more than it listed fills no disk.
                if part.total_bytes is None and end + 1 == remote.size_bytes:
                    raise self._larger(remote)
                chunk = chunk[:room]  # a store that ignored the range: the rest is another part's
            os.pwrite(fd, chunk, offset)
            offset += len(chunk)
            progress[0] = offset
            self._advance(len(chunk))
            if offset > end:
                if part.total_bytes is None and end + 1 == remote.size_bytes and any(part.chunks):
                    raise self._larger(remote)
                break

    def _deadline_s(self, num_bytes: int) -> float:
        """How long a request for `num_bytes` may take, headers to last byte, before the store is too slow."""
        return self.settings.slow_grace_s + num_bytes / self.settings.min_bytes_per_s

    def _raise_why_guard_fired(self, guard: RequestGuard, remote: RemoteFile, num_bytes: int, requested_at: float,
                               *, check_due: bool = False) -> None:
        """Say why a request ended from outside (its socket shut): a drain, another part's failure, or too slow."""
        fired = guard.fired or (guard.due() if check_due else None)
        if fired is None:
            return
        self._check_wanted()
        if self._stop.is_set():
            raise _Stopped(num_bytes)
        if fired == FIRED_DEADLINE:
            raise self._too_slow(remote, num_bytes, time.monotonic() - requested_at)

    def _check_wanted(self) -> None:
        if self._stopped_by_owner.is_set():
            raise fetch_stopped(self.download.source)

    def _check_throughput(self, remote: RemoteFile, num_bytes: int, started: float) -> None:
        elapsed = time.monotonic() - started
        if elapsed > self.settings.slow_grace_s and num_bytes < self.settings.min_bytes_per_s * elapsed:
            raise self._too_slow(remote, num_bytes, elapsed)

    def _too_slow(self, remote: RemoteFile, num_bytes: int, elapsed_s: float) -> _SlowRead:
        return _SlowRead(
            f"the store sent {num_bytes} bytes of {remote.name} in {elapsed_s:.0f} s: too slow "
            f"(at least {self.settings.min_bytes_per_s // 1024} KiB/s after {self.settings.slow_grace_s:.0f} s)"
        )

    def _larger(self, remote: RemoteFile) -> WeightsError:
        return WeightsError(
            f"{self.download.source}: {remote.name} is larger than the {remote.size_bytes} bytes its listing announced"
        )

    def _advance(self, num_bytes: int) -> None:
        if not num_bytes:
            return
        with self._lock:
            self.download.downloaded_bytes += num_bytes
            if self.on_progress:
                self.on_progress(self.download.downloaded_bytes, self.download.size_bytes)

    # -- the journal of written parts ---------------------------------------------------

    def _read_journal(self) -> bool:
        """Load the parts a previous attempt wrote (True when there is a partial download to resume)."""
        try:
            journal = json.loads(self.journal_path.read_text())
        except (OSError, ValueError):
            return False
        if journal.get("part_bytes") != self.settings.part_bytes or not self.partial.is_dir():
            return False
        sizes = {remote.name: remote.size_bytes for remote in self.files}
        if journal.get("sizes") != sizes:
            return False
        self._done = {name: set(indices) for name, indices in (journal.get("done") or {}).items() if name in sizes}
        return True

    def _part_done(self, remote: RemoteFile, index: int) -> None:
        with self._journal_lock:
            with self._lock:
                self._done.setdefault(remote.name, set()).add(index)
                journal = {
                    "part_bytes": self.settings.part_bytes,
                    "sizes": {f.name: f.size_bytes for f in self.files},
                    "done": {name: sorted(indices) for name, indices in self._done.items()},
                    # whose copy it is, for `WeightsCache.release_unwanted` (never read back here)
                    "source": self.download.source,
                    "scope": self.download.scope,
                }
            durable.write_atomic(self.journal_path, json.dumps(journal))

    # -- verification -------------------------------------------------------------------

    @contextlib.contextmanager
    def _asking_the_store(self, num_requests: int = 2) -> Iterator[None]:
        """Small requests (HEADs) that a drain ends at once, given `slow_grace_s` and a second each in all."""
        deadline_s = self.settings.slow_grace_s + num_requests
        guard = RequestGuard((self._stopped_by_owner,), time.monotonic() + deadline_s)
        try:
            with guarded(guard):
                yield
        except Exception:
            self._check_wanted()
            if guard.fired == FIRED_DEADLINE:
                raise StoreUnreachable(f"cannot reach the store of {self.download.source} (it answered no "
                                       f"checksum within {deadline_s:.0f} s)") from None
            raise

    def _verify(self, remote: RemoteFile, fd: int) -> None:
        source = self.download.source
        if self.parsed.kind == "s3":
            with self._asking_the_store():
                checksum = weights_sources.s3_checksum(self.client, self.parsed, remote)
            if checksum is None or _s3_etag_of(fd, checksum.part_sizes) == checksum.etag:
                return
            if checksum.part_sizes:  # parts of differing sizes: ask the store for each one's
                with self._asking_the_store(len(checksum.part_sizes)):  # a HEAD per part
                    exact = weights_sources.s3_checksum(self.client, self.parsed, remote, exact_parts=True)
                if exact is None or _s3_etag_of(fd, exact.part_sizes) == exact.etag:
                    return
        elif remote.digest is not None:
            algorithm, expected = remote.digest
            if _hub_digest_of(fd, algorithm, remote.size_bytes) == expected:
                return
        else:
            return
        raise WeightsError(f"{source}: {remote.name}: the downloaded bytes do not match the store's checksum")


def _why(exc: BaseException) -> str:
    """What a failed read is shown as: our own words, never a library's (which may name the request)."""
    if isinstance(exc, (_SlowRead, _ShortRead, WeightsError)):
        return str(exc)
    return type(exc).__name__


def _hash_range(fd: int, digest, start: int, length: int) -> None:
    offset, end = start, start + length
    while offset < end:
        chunk = os.pread(fd, min(_HASH_CHUNK_BYTES, end - offset), offset)
        if not chunk:
            break
        digest.update(chunk)
        offset += len(chunk)


def _s3_etag_of(fd: int, part_sizes: tuple[int, ...]) -> str:
    size = os.fstat(fd).st_size
    if not part_sizes:
        digest = hashlib.md5(usedforsecurity=False)
        _hash_range(fd, digest, 0, size)
        return digest.hexdigest()
    digests, offset = [], 0
    for part_size in part_sizes:
        digest = hashlib.md5(usedforsecurity=False)
        _hash_range(fd, digest, offset, part_size)
        digests.append(digest.digest())
        offset += part_size
    return f"{hashlib.md5(b''.join(digests), usedforsecurity=False).hexdigest()}-{len(part_sizes)}"


def _hub_digest_of(fd: int, algorithm: str, size: int) -> str:
    if algorithm == "sha256":
        digest = hashlib.sha256()
    else:  # git's blob id: SHA-1 of "blob <size>\0" and the bytes
        digest = hashlib.sha1(f"blob {size}\0".encode(), usedforsecurity=False)
    _hash_range(fd, digest, 0, size)
    return digest.hexdigest()
