"""A content-addressed cache of model weights under `<data-dir>/weights/`.

Sources:
    s3://bucket/prefix       boto3; keyed by the objects' keys, sizes and ETags
    hf:org/name[@revision]   the Hub's HTTP API; keyed by the commit the revision points at
    /absolute/path           used in place, never copied (`weights_paths.check_local_model_dir`)

Each fetch reads its source with the replica's own credentials, the fleet's for the public
catalogue, or anonymously (`weights_access`). A cache key covers the source, its content, the
store's endpoint and the replica's `weights_scope`, so two organisations never share a cached copy
of a private source while a public catalogue model ("" scope) is downloaded once for everyone.

Layout: `<root>/<cache_key>/` holds one complete model and `<root>/<cache_key>.json`
its manifest (written last; its mtime is the last use). A download goes to
`<root>/.tmp/` and is renamed into place, so a half-downloaded model never looks
complete. One lock per cache key (a thread lock plus an `flock` on
`<root>/.locks/<key>.lock`) makes concurrent requests for one model download once,
across threads and processes.

Before downloading, every file name is checked (`weights_paths`) and the model's total size is
compared with the disk budget and free space: what can never fit fails at once, least recently used
unpinned models are evicted when that makes room, and a file larger than its listing said stops the
download.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from gpu_agent.protocol import ModelInfo, WeightsStatus
from gpu_agent.runtime.model_info import read_model_info
from gpu_agent.runtime.weights_access import (
    ModelTooLarge,
    SourceAccess,
    StoreUnreachable,
    WeightsError,
    hf_client,
    hf_errors,
    hf_raise_for_status,
    s3_client,
    s3_endpoint_for,
    s3_errors,
    unreadable,
)
from gpu_agent.runtime.weights_paths import DownloadFolder, check_local_model_dir, check_model_file_names

logger = logging.getLogger(__name__)

_CHUNK_BYTES = 8 * 1024 * 1024
MAX_MODEL_FILES = 10_000  # a listing of a million tiny objects would exhaust inodes, not bytes
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
class _RemoteFile:
    name: str  # relative to the model folder, checked by `check_model_file_names`
    parts: tuple[str, ...]
    size_bytes: int
    location: str  # the S3 object key, or the Hub URL of the file at the listed commit
    etag: str = ""


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
        private_dirs: tuple[Path, ...] = (),
    ) -> None:
        self.root = Path(root).resolve()
        self.budget_bytes = budget_bytes
        self.s3_endpoint_url = (
            s3_endpoint_url
            or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL")
            or None
        )
        self.hf_endpoint = hf_endpoint or os.environ.get("HF_ENDPOINT") or None
        # A local model directory may neither lie inside nor contain these (nor the cache itself).
        self.private_dirs = (self.root, *private_dirs)
        for sub in ("", ".tmp", ".locks"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.num_downloads = 0
        self.num_hits = 0
        self._mutex = threading.Lock()
        self._space_lock = threading.Lock()  # one decision at a time about who gets the disk
        self._key_locks: dict[str, threading.Lock] = {}
        self._pins: dict[str, int] = {}  # cache key -> number of users (never evicted)
        self._downloads: dict[str, _Download] = {}
        self._model_infos: dict[Path, ModelInfo | None] = {}  # model directory -> what its config says
        self._local_models: dict[str, Path] = {}  # local sources served here, reported like cached ones

    # -- public ---------------------------------------------------------------

    def fetch(self, source: str, *, access: SourceAccess | None = None, on_progress=None) -> Path:
        """Return a local directory holding the model, downloading it if needed.

        `access` says whose credentials read the source and who may share the copy (default:
        anonymous, shared). `on_progress(downloaded_bytes, size_bytes)` is called while downloading.
        Failures a customer may see are `WeightsError`s, whose messages carry no secrets.
        """
        access = access or SourceAccess()
        parsed = ModelSource.parse(source)
        if parsed.kind == "local":
            path = check_local_model_dir(parsed.location, self.private_dirs)
            with self._mutex:
                self._local_models[source] = path
            return path
        endpoint = s3_endpoint_for(access, self.s3_endpoint_url) if parsed.kind == "s3" else self._hub()
        endpoint_digest = _digest(endpoint or "")
        with contextlib.ExitStack() as stack:
            try:
                if parsed.kind == "s3":
                    client = s3_client(access, source, default_endpoint_url=self.s3_endpoint_url)
                    stack.callback(client.close)
                    files = self._s3_listing(client, parsed, source)
                    fingerprint = json.dumps(sorted((f.location, f.size_bytes, f.etag) for f in files))
                else:  # a branch moves: key by the commit it points at now
                    client = stack.enter_context(hf_client(access, source))
                    files, fingerprint = self._hf_listing(client, parsed, source)
            except StoreUnreachable:
                # NOTE: only when the store cannot be reached at all (never on a refusal), and only
                # a copy this same scope fetched from this same endpoint: bad credentials get nothing.
                cached = self._newest_cached(source, access.scope, endpoint_digest)
                if cached is None:
                    raise
                logger.warning("cannot reach the store of %s; using the cached copy %s", source, cached.name)
                self._touch(cached.name)
                with self._mutex:
                    self.num_hits += 1
                return cached
            key = cache_key(source, fingerprint, scope=access.scope, endpoint=endpoint or "")
            with self._key_lock(key):
                path = self.root / key
                if self._manifest_path(key).exists() and path.is_dir() and not path.is_symlink():
                    self._touch(key)
                    with self._mutex:
                        self.num_hits += 1
                    return path
                download = _Download(
                    source=source, cache_key=key, size_bytes=sum(f.size_bytes for f in files)
                )
                with self._mutex:
                    self._downloads[key] = download
                try:
                    self._make_room(key, download.size_bytes)
                    self._download_into_place(parsed, client, files, path, download, on_progress)
                    manifest = {
                        "source": source,
                        "cache_key": key,
                        "scope": access.scope,
                        "endpoint_digest": endpoint_digest,
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
        entries = self._entries()
        excess = sum(entry["size_bytes"] for entry in entries) - self.budget_bytes
        return self._evict_lru(entries, excess)

    def model_info(self, model_dir: str | Path) -> ModelInfo | None:
        """What a fetched model's config says (read once per directory; a cached model never changes)."""
        model_dir = Path(model_dir)
        with self._mutex:
            if model_dir in self._model_infos:
                return self._model_infos[model_dir]
        info = read_model_info(model_dir)
        with self._mutex:
            self._model_infos[model_dir] = info
        return info

    def statuses(self) -> list[WeightsStatus]:
        """Complete models (with what their configs say) and downloads in progress, for heartbeats."""
        statuses = [
            WeightsStatus(
                source=entry["source"],
                cache_key=entry["cache_key"],
                size_bytes=entry["size_bytes"],
                downloaded_bytes=entry["size_bytes"],
                complete=True,
                last_used_at=entry["last_used_at"],
                model_info=self.model_info(self.root / entry["cache_key"]),
            )
            for entry in self._entries()
        ]
        with self._mutex:
            downloads = list(self._downloads.values())
            local_models = list(self._local_models.items())
        for source, path in local_models:
            size_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
            statuses.append(WeightsStatus(
                source=source, cache_key=f"local-{_digest(str(path))}", size_bytes=size_bytes,
                downloaded_bytes=size_bytes, complete=True, model_info=self.model_info(path),
            ))
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

    # -- disk -------------------------------------------------------------------

    def _make_room(self, key: str, size_bytes: int) -> None:
        """Evict what must go for `size_bytes` more to fit the budget and the disk, or raise ModelTooLarge."""
        with self._space_lock:
            if self.budget_bytes is not None and size_bytes > self.budget_bytes:
                raise ModelTooLarge(
                    f"model is {_human(size_bytes)}; this node's weights budget is {_human(self.budget_bytes)}"
                )
            with self._mutex:  # bytes other downloads announced but have not written yet
                pending = sum(
                    max(d.size_bytes - d.downloaded_bytes, 0) for k, d in self._downloads.items() if k != key
                )
                reserved = sum(d.size_bytes for k, d in self._downloads.items() if k != key)
            disk = shutil.disk_usage(self.root)
            if size_bytes > disk.total:
                raise ModelTooLarge(
                    f"model is {_human(size_bytes)}; this node's weights disk is {_human(disk.total)}"
                )
            entries = self._entries()
            need = size_bytes - (disk.free - pending)
            if self.budget_bytes is not None:
                cached = sum(entry["size_bytes"] for entry in entries)
                need = max(need, cached + reserved + size_bytes - self.budget_bytes)
            if need <= 0:
                return
            evicted = set(self._evict_lru(entries, need))
            freed = sum(entry["size_bytes"] for entry in entries if entry["cache_key"] in evicted)
            if freed < need:
                limit = (
                    f"this node's weights budget is {_human(self.budget_bytes)}"
                    if self.budget_bytes is not None
                    else f"the weights disk has {_human(disk.free)} free"
                )
                raise ModelTooLarge(
                    f"model is {_human(size_bytes)}; {limit} and the models in use leave no room for it"
                )

    def _evict_lru(self, entries: list[dict], num_bytes: int) -> list[str]:
        """Remove unpinned complete models, least recently used first, until `num_bytes` are freed."""
        evicted: list[str] = []
        freed = 0
        for entry in sorted(entries, key=lambda entry: entry["last_used_at"]):
            if freed >= num_bytes:
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
                _remove(self.root / key)
            freed += entry["size_bytes"]
            evicted.append(key)
            logger.info("evicted weights %s (%s)", key, entry.get("source"))
        return evicted

    # -- downloads --------------------------------------------------------------

    def _download_into_place(
        self, parsed, client, files, path: Path, download: _Download, on_progress
    ) -> None:
        tmp = self.root / ".tmp" / f"{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        folder = DownloadFolder(tmp)
        try:
            for remote in files:
                with folder.create(remote.parts) as handle:
                    if parsed.kind == "s3":
                        self._download_s3_file(client, parsed, remote, handle, download, on_progress)
                    else:
                        self._download_hf_file(client, parsed, remote, handle, download, on_progress)
            folder.check_in_place()
            _remove(path)  # a stale directory without a manifest
            os.rename(tmp, path)
            try:
                folder.check_in_place(path)
            except WeightsError:
                _remove(path)
                raise
        finally:
            folder.close()
            _remove(tmp)

    def _write_chunks(
        self, chunks, remote: _RemoteFile, handle, download: _Download, on_progress, source: str
    ):
        written = 0
        for chunk in chunks:
            written += len(chunk)
            download.downloaded_bytes += len(chunk)
            # NOTE: checked before writing, so a store that sends more than it listed fills no disk.
            if written > remote.size_bytes:
                raise WeightsError(
                    f"{source}: {remote.name} is larger than the {remote.size_bytes} bytes its listing announced"
                )
            handle.write(chunk)
            if on_progress:
                on_progress(download.downloaded_bytes, download.size_bytes)
        if written != remote.size_bytes:
            raise WeightsError(f"{source}: {remote.name}: got {written} bytes, expected {remote.size_bytes}")

    # -- S3 ---------------------------------------------------------------------

    def _s3_listing(self, client, parsed: ModelSource, source: str) -> list[_RemoteFile]:
        bucket, prefix = parsed.bucket_and_prefix
        prefix = prefix.rstrip("/") + "/" if prefix else ""
        objects = []
        with s3_errors(source):
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
                for item in page.get("Contents", []):
                    size = int(item["Size"])
                    if item["Key"].endswith("/") and size == 0:  # a console's "folder" marker
                        continue
                    objects.append((item["Key"], size, item.get("ETag", "").strip('"')))
                    if len(objects) > MAX_MODEL_FILES:
                        raise ModelTooLarge(f"{source} holds more than {MAX_MODEL_FILES} files")
        if not objects:
            raise unreadable(source)
        parts = check_model_file_names(key[len(prefix) :] for key, _, _ in objects)
        return [
            _RemoteFile(name, parts[name], size, key, etag)
            for (key, size, etag), name in ((entry, entry[0][len(prefix) :]) for entry in objects)
        ]

    def _download_s3_file(self, client, parsed, remote: _RemoteFile, handle, download, on_progress) -> None:
        source = f"s3://{parsed.location}"
        bucket, _ = parsed.bucket_and_prefix
        with s3_errors(source):
            body = client.get_object(Bucket=bucket, Key=remote.location)["Body"]
            try:
                chunks = body.iter_chunks(_CHUNK_BYTES)
                self._write_chunks(chunks, remote, handle, download, on_progress, source)
            finally:
                body.close()

    # -- Hugging Face -----------------------------------------------------------

    def _hub(self) -> str:
        from huggingface_hub import constants

        return (self.hf_endpoint or constants.ENDPOINT).rstrip("/")

    def _hf_listing(self, client, parsed: ModelSource, source: str) -> tuple[list[_RemoteFile], str]:
        """The repo's files at the revision (every name checked, every size known) and its commit."""
        from huggingface_hub import hf_hub_url

        url = f"{self._hub()}/api/models/{parsed.location}/revision/{quote(parsed.revision, safe='')}"
        with hf_errors(source):
            response = client.get(url, params={"blobs": "true"})
        hf_raise_for_status(response, source)
        try:
            info = response.json()
            siblings = [(entry["rfilename"], entry.get("size")) for entry in info.get("siblings") or []]
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
            _RemoteFile(
                name, parts[name], size, hf_hub_url(parsed.location, name, revision=sha, endpoint=self._hub())
            )
            for name, size in siblings
        ]
        return files, sha

    def _download_hf_file(self, client, parsed, remote: _RemoteFile, handle, download, on_progress) -> None:
        source = f"hf:{parsed.location}@{parsed.revision}"
        with hf_errors(source), client.stream("GET", remote.location) as response:
            hf_raise_for_status(response, source)
            self._write_chunks(
                response.iter_bytes(_CHUNK_BYTES), remote, handle, download, on_progress, source
            )

    # -- manifests and locks ----------------------------------------------------

    def _manifest_path(self, key: str) -> Path:
        return self.root / f"{key}.json"

    def _touch(self, key: str) -> None:
        os.utime(self._manifest_path(key))

    def _newest_cached(self, source: str, scope: str, endpoint_digest: str) -> Path | None:
        entries = [
            entry
            for entry in self._entries()
            if entry.get("source") == source
            and entry.get("scope", "") == scope
            and entry.get("endpoint_digest", "") == endpoint_digest
        ]
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


def cache_key(source: str, fingerprint: str, *, scope: str = "", endpoint: str = "") -> str:
    """Content address: one source, at one content, from one store, for one scope, maps to one directory."""
    return hashlib.sha256(f"{source}\n{fingerprint}\n{scope}\n{endpoint}".encode()).hexdigest()[:32]


def _digest(text: str) -> str:
    # The endpoint URL may carry user info: the manifest keeps only a digest of it.
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _human(num_bytes: int | None) -> str:
    value = float(num_bytes or 0)
    for unit in ("bytes", "kB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            break
        value /= 1000
    text = f"{value:.0f}" if unit == "bytes" else f"{value:.1f}".removesuffix(".0")
    return f"{text} {unit}"


def _remove(path: Path) -> None:
    """Remove a file, a link (never what it points to) or a directory tree, if there."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.exists():
        shutil.rmtree(path, ignore_errors=True)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    tmp.write_text(text)
    os.replace(tmp, path)
