"""A content-addressed cache of model weights under `<data-dir>/weights/`.

Sources:
    s3://bucket/prefix       boto3; keyed by the objects' keys, sizes and ETags
    hf:org/name[@revision]   huggingface_hub.snapshot_download; keyed by the revision
    /absolute/path           used in place, never copied

Layout: `<root>/<cache_key>/` holds one complete model and `<root>/<cache_key>.json`
its manifest (written last; its mtime is the last use). A download goes to
`<root>/.tmp/` and is renamed into place, so a half-downloaded model never looks
complete. One lock per cache key (a thread lock plus an `flock` on
`<root>/.locks/<key>.lock`) makes concurrent requests for one model download once,
across threads and processes.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from gpu_agent.protocol import WeightsStatus

logger = logging.getLogger(__name__)

_CHUNK_BYTES = 8 * 1024 * 1024


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
            if name.count("/") != 1:
                raise ValueError(f"bad Hugging Face source {source!r}: expected hf:org/name[@revision]")
            return cls("hf", name, revision or "main")
        if os.path.isabs(source):
            return cls("local", source)
        raise ValueError(f"unknown model source {source!r}")

    @property
    def bucket_and_prefix(self) -> tuple[str, str]:
        bucket, _, prefix = self.location.partition("/")
        return bucket, prefix


@dataclass(slots=True)
class _Download:
    source: str
    cache_key: str
    size_bytes: int = 0
    downloaded_bytes: int = 0


class WeightsCache:
    """Fetches models once, keeps them under a disk budget, evicts the least recently used."""

    def __init__(
        self,
        root: str | Path,
        *,
        budget_bytes: int | None = None,
        s3_endpoint_url: str | None = None,
        hf_endpoint: str | None = None,
    ) -> None:
        self.root = Path(root)
        self.budget_bytes = budget_bytes
        self.s3_endpoint_url = (
            s3_endpoint_url
            or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL")
            or None
        )
        self.hf_endpoint = hf_endpoint or os.environ.get("HF_ENDPOINT") or None
        for sub in ("", ".tmp", ".locks"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.num_downloads = 0
        self.num_hits = 0
        self._mutex = threading.Lock()
        self._key_locks: dict[str, threading.Lock] = {}
        self._pins: dict[str, int] = {}  # cache key -> number of users (never evicted)
        self._downloads: dict[str, _Download] = {}
        self._known_sources: dict[str, str] = {}  # cache key -> source

    # -- public ---------------------------------------------------------------

    def fetch(self, source: str, *, on_progress=None) -> Path:
        """Return a local directory holding the model, downloading it if needed.

        `on_progress(downloaded_bytes, size_bytes)` is called while downloading.
        """
        parsed = ModelSource.parse(source)
        if parsed.kind == "local":
            if not Path(parsed.location).is_dir():
                raise FileNotFoundError(f"model directory {parsed.location} does not exist")
            return Path(parsed.location)
        try:
            if parsed.kind == "s3":
                listing = self._s3_listing(parsed)
                fingerprint = json.dumps(sorted(listing), separators=(",", ":"))
            else:  # a branch moves: key by the commit it points at now
                listing = self._hf_info(parsed)
                fingerprint = listing.sha or parsed.revision
        except Exception:
            # The store is unreachable: a copy we already hold beats no replica at all.
            cached = self._newest_cached(source)
            if cached is None:
                raise
            logger.warning("cannot reach %s; using the cached copy %s", source, cached.name, exc_info=True)
            self._touch(cached.name)
            with self._mutex:
                self.num_hits += 1
            return cached
        key = cache_key(source, fingerprint)
        with self._mutex:
            self._known_sources[key] = source
        with self._key_lock(key):
            path = self.root / key
            if self._manifest_path(key).exists() and path.is_dir():
                self._touch(key)
                with self._mutex:
                    self.num_hits += 1
                return path
            download = _Download(source=source, cache_key=key)
            with self._mutex:
                self._downloads[key] = download
            try:
                tmp = self.root / ".tmp" / f"{key}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
                tmp.mkdir(parents=True)
                try:
                    if parsed.kind == "s3":
                        self._download_s3(parsed, listing, tmp, download, on_progress)
                    else:
                        self._download_hf(parsed, listing, tmp, download, on_progress)
                    if path.exists():  # a stale directory without a manifest
                        shutil.rmtree(path)
                    os.rename(tmp, path)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
                manifest = {
                    "source": source,
                    "cache_key": key,
                    "size_bytes": download.size_bytes,
                    "fingerprint": fingerprint,
                    "created_at": time.time(),
                }
                _write_atomically(self._manifest_path(key), json.dumps(manifest))
                with self._mutex:
                    self.num_downloads += 1
            finally:
                with self._mutex:
                    self._downloads.pop(key, None)
        self.evict()
        return path

    @contextlib.contextmanager
    def pinned(self, path: str | Path) -> Iterator[None]:
        """Keep a cached model from eviction while the block runs."""
        self.pin(path)
        try:
            yield
        finally:
            self.unpin(path)

    def pin(self, path: str | Path) -> None:
        key = Path(path).name
        with self._mutex:
            self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, path: str | Path) -> None:
        key = Path(path).name
        with self._mutex:
            if self._pins.get(key, 0) <= 1:
                self._pins.pop(key, None)
            else:
                self._pins[key] -= 1

    def evict(self) -> list[str]:
        """Remove least recently used complete models until the cache fits its budget."""
        if self.budget_bytes is None:
            return []
        evicted = []
        entries = sorted(self._entries(), key=lambda entry: entry["last_used_at"])
        total = sum(entry["size_bytes"] for entry in entries)
        for entry in entries:
            if total <= self.budget_bytes:
                break
            key = entry["cache_key"]
            with self._mutex:
                if self._pins.get(key):
                    continue
            lock = self._key_lock(key, blocking=False)
            if lock is None:  # being downloaded or read by someone else
                continue
            with lock:
                self._manifest_path(key).unlink(missing_ok=True)
                shutil.rmtree(self.root / key, ignore_errors=True)
            total -= entry["size_bytes"]
            evicted.append(key)
            logger.info("evicted weights %s (%s)", key, entry.get("source"))
        return evicted

    def statuses(self) -> list[WeightsStatus]:
        """Complete models and downloads in progress, for heartbeats."""
        statuses = [
            WeightsStatus(
                source=entry["source"],
                cache_key=entry["cache_key"],
                size_bytes=entry["size_bytes"],
                downloaded_bytes=entry["size_bytes"],
                complete=True,
                last_used_at=entry["last_used_at"],
            )
            for entry in self._entries()
        ]
        with self._mutex:
            downloads = list(self._downloads.values())
        statuses += [
            WeightsStatus(
                source=download.source,
                cache_key=download.cache_key,
                size_bytes=download.size_bytes,
                downloaded_bytes=download.downloaded_bytes,
            )
            for download in downloads
        ]
        return statuses

    # -- internals --------------------------------------------------------------

    def _manifest_path(self, key: str) -> Path:
        return self.root / f"{key}.json"

    def _touch(self, key: str) -> None:
        os.utime(self._manifest_path(key))

    def _newest_cached(self, source: str) -> Path | None:
        entries = [entry for entry in self._entries() if entry.get("source") == source]
        if not entries:
            return None
        return self.root / max(entries, key=lambda entry: entry["created_at"])["cache_key"]

    def _entries(self) -> list[dict]:
        entries = []
        for manifest_path in self.root.glob("*.json"):
            try:
                entry = json.loads(manifest_path.read_text())
                entry["last_used_at"] = manifest_path.stat().st_mtime
            except (OSError, ValueError):
                continue
            entries.append(entry)
        return entries

    @contextlib.contextmanager
    def _file_lock(self, key: str, *, blocking: bool):
        with open(self.root / ".locks" / f"{key}.lock", "a+") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            try:
                yield True
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _key_lock(self, key: str, *, blocking: bool = True):
        """A context manager holding the key's thread and file locks (None if not blocking and busy)."""
        with self._mutex:
            thread_lock = self._key_locks.setdefault(key, threading.Lock())
        if not thread_lock.acquire(blocking=blocking):
            return None
        stack = contextlib.ExitStack()
        stack.callback(thread_lock.release)
        acquired = stack.enter_context(self._file_lock(key, blocking=blocking))
        if not acquired:
            stack.close()
            return None
        return stack

    def _s3_client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.s3_endpoint_url)

    def _s3_listing(self, parsed: ModelSource) -> list[tuple[str, int, str]]:
        bucket, prefix = parsed.bucket_and_prefix
        prefix = prefix.rstrip("/") + "/" if prefix else ""
        paginator = self._s3_client().get_paginator("list_objects_v2")
        listing = []
        for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
            for item in page.get("Contents", []):
                if not item["Key"].endswith("/"):
                    listing.append((item["Key"], int(item["Size"]), item.get("ETag", "").strip('"')))
        if not listing:
            raise FileNotFoundError(f"no objects under s3://{parsed.location}")
        return listing

    def _download_s3(self, parsed, listing, target: Path, download: _Download, on_progress) -> None:
        bucket, prefix = parsed.bucket_and_prefix
        prefix = prefix.rstrip("/") + "/" if prefix else ""
        client = self._s3_client()
        download.size_bytes = sum(size for _, size, _ in listing)
        for key, size, _etag in listing:
            relative = key[len(prefix) :]
            destination = target / relative
            if ".." in Path(relative).parts:
                raise ValueError(f"refusing object key {key!r}")
            destination.parent.mkdir(parents=True, exist_ok=True)
            body = client.get_object(Bucket=bucket, Key=key)["Body"]
            written = 0
            with open(destination, "wb") as handle:
                for chunk in body.iter_chunks(_CHUNK_BYTES):
                    handle.write(chunk)
                    written += len(chunk)
                    download.downloaded_bytes += len(chunk)
                    if on_progress:
                        on_progress(download.downloaded_bytes, download.size_bytes)
            if written != size:
                raise OSError(f"s3://{bucket}/{key}: got {written} bytes, expected {size}")

    def _hf_info(self, parsed: ModelSource):
        from huggingface_hub import HfApi

        return HfApi(endpoint=self.hf_endpoint).model_info(
            parsed.location, revision=parsed.revision, files_metadata=True
        )

    def _download_hf(self, parsed, listing, target: Path, download: _Download, on_progress) -> None:
        from huggingface_hub import snapshot_download

        info = listing
        download.size_bytes = sum(sibling.size or 0 for sibling in info.siblings or [])
        stop = threading.Event()

        def watch() -> None:  # snapshot_download has no byte callback; measure the directory
            while not stop.wait(0.5):
                download.downloaded_bytes = _directory_bytes(target)
                if on_progress:
                    on_progress(download.downloaded_bytes, download.size_bytes)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            snapshot_download(
                parsed.location,
                revision=info.sha or parsed.revision,
                local_dir=str(target),
                endpoint=self.hf_endpoint,
            )
        finally:
            stop.set()
            watcher.join()
        shutil.rmtree(target / ".cache", ignore_errors=True)
        download.downloaded_bytes = _directory_bytes(target)
        if download.size_bytes and download.downloaded_bytes != download.size_bytes:
            raise OSError(
                f"hf:{parsed.location}: got {download.downloaded_bytes} bytes, expected {download.size_bytes}"
            )
        download.size_bytes = download.downloaded_bytes


def cache_key(source: str, fingerprint: str) -> str:
    """Content address: the same source at the same revision/ETags maps to one directory."""
    return hashlib.sha256(f"{source}\n{fingerprint}".encode()).hexdigest()[:32]


def _directory_bytes(path: Path) -> int:
    return sum(
        file.stat().st_size for file in path.rglob("*") if file.is_file() and ".cache" not in file.parts
    )


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    tmp.write_text(text)
    os.replace(tmp, path)
