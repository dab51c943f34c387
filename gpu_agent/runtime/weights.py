"""A content-addressed cache of model weights under `<data-dir>/weights/`: what to fetch, what to keep.

`WeightsCache.fetch` turns a model source into a local directory. It lists the source
(`weights_sources`), reading it with the replica's own credentials, the fleet's for the public
catalogue, or anonymously (`weights_access`). A cache key covers the source, its content, the
store's endpoint and the replica's `weights_scope`, so two organisations never share a cached copy
of a private source while a public catalogue model ("" scope) is downloaded once for everyone. The
manifests and per-model locks are `weights_index`'s; one lock per cache key makes concurrent
requests for one model download once, across threads and processes.

Pickles and other frameworks' weights are never fetched, and a model whose weights are pickles only is refused
(`weights_formats`). A download goes to `<root>/.tmp/<key>.partial/` (`weights_transfer`: parallel ranged reads,
retries, checksums; a download cut short resumes from the parts already there) and is renamed into
place before its manifest is written, so a half-downloaded model never looks complete (a folder an agent killed
mid-way left without one goes when the next cache opens, as one killed mid-eviction leaves). Before downloading, every file name is checked
(`weights_paths`) and the model's total size is compared with the disk budget and free space: what
can never fit fails at once, least recently used unpinned models are evicted when that makes room,
and a file larger than its listing said stops the download (`weights_sources`). An organisation's own copies that no
desired replica names go after a short grace, whatever the room (`release_unwanted`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

from gpu_agent.protocol import MAX_WEIGHTS_REPORTS, ModelInfo, WeightsStatus
from gpu_agent.runtime import durable, weights_formats, weights_sources
from gpu_agent.runtime.model_info import ModelReading, read_model
from gpu_agent.runtime.weights_access import (
    FetchStopped,
    ModelTooLarge,
    SourceAccess,
    StoreUnreachable,
    fetch_stopped,
    hf_client,
    s3_client,
    s3_endpoint_for,
)
from gpu_agent.runtime.weights_index import CacheIndex, cache_key, digest, remove_path
from gpu_agent.runtime.weights_paths import check_local_model_dir, disk_bytes
from gpu_agent.runtime.weights_sources import Download, ModelSource
from gpu_agent.runtime.weights_transfer import Transfer, TransferSettings

logger = logging.getLogger(__name__)

# A partial download nobody resumed for this long is removed when a cache opens.
STALE_PARTIAL_S = 24 * 3600
# The most an adapter's files may take (`fetch_adapter`), unless the agent is told otherwise: a rank 256 LoRA of every
# linear layer of a 70B model is about 6.6 GB in bf16.
DEFAULT_ADAPTER_MAX_BYTES = 8 * 10**9
# What a cached adapter's manifest says it is (`kind`; a model's says nothing).
ADAPTER_KIND = "adapter"
# An organisation's cached adapters on a node take at most this many times the bound for one: its next adapter evicts
# its own least recently used ones first (`_keep_adapters_within_share`).
ADAPTER_SHARE = 4
# A model whose files could not be read this time (`ModelReading.unsettled`: the header reader past its wall time on a
# loaded node, or killed) is read again after each of these in turn (the last one repeats for heartbeats' reads); a
# replica waiting on it fails, not permanently, after the last (`Reconciler`).
UNSETTLED_RETRY_S = (10.0, 60.0, 300.0)
# How long an organisation's own cached copy (a private scope) stays once no desired replica of this node names it and
# none uses it (`release_unwanted`), unless the agent is told otherwise. Short: it is a tenant's private model, read
# with a credential it may have deleted since, and another endpoint of its own that wants it again is placed here when
# the node holds it (a scale to zero and back within it starts from the disk); a shared catalogue copy ("" scope) is
# kept under the budget, least recently used first, as before.
DEFAULT_PRIVATE_WEIGHTS_GRACE_S = 15 * 60.0
# A cached copy's folder name (`weights_index.cache_key`).
_CACHE_KEY = re.compile(r"[0-9a-f]{32}")
# A manifest's or a parts journal's write killed before its rename: `durable.write_atomic`'s temporary file, or the one
# the release before named `.<key>.json.<8 hex>`.
_LEFTOVER_WRITE = re.compile(r"\.([0-9a-f]{32})\.json\.(?:[a-z0-9_]{8}\.tmp|[0-9a-f]{8})")


class AdapterTooLarge(ModelTooLarge):
    """An adapter's files, as listed, are past the node's bound for adapters."""


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
        transfer: TransferSettings | None = None,
        adapter_max_bytes: int | None = DEFAULT_ADAPTER_MAX_BYTES,
        disk_reserve_fraction: float = 0.0,
        private_grace_s: float = DEFAULT_PRIVATE_WEIGHTS_GRACE_S,
    ) -> None:
        self.root = Path(root).resolve()
        if not private_grace_s >= 0:
            raise ValueError(f"private_grace_s must be at least 0, not {private_grace_s}")
        self.private_grace_s = private_grace_s
        self.budget_bytes = budget_bytes
        if not 0.0 <= disk_reserve_fraction < 1.0:
            raise ValueError(f"disk_reserve_fraction must be at least 0 and below 1, not {disk_reserve_fraction}")
        # The share of the weights disk no download takes (`_make_room`). NOTE: in the DaemonSet the cache is a hostPath
        # on the kubelet's disk, where the agent pod's /tmp (its engines' scratch) is too: filled to its last byte it
        # passed the kubelet's hard eviction threshold, and the kubelet evicted the agent pod (the most ephemeral
        # storage over its request), every engine of the node with it, and each agent pod after it, the weights staying.
        self.disk_reserve_fraction = disk_reserve_fraction
        self.adapter_max_bytes = adapter_max_bytes
        self.s3_endpoint_url = (
            s3_endpoint_url
            or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL")
            or None
        )
        self.hf_endpoint = hf_endpoint or os.environ.get("HF_ENDPOINT") or None
        # A local model directory may neither lie inside nor contain these (nor the cache itself).
        self.private_dirs = (self.root, *private_dirs)
        self.transfer = transfer or TransferSettings()
        for sub in ("", ".tmp", ".locks", ".parts"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self._index = CacheIndex(self.root)
        self.num_downloads = 0
        self.num_hits = 0
        self._mutex = threading.Lock()
        self._space_lock = threading.Lock()  # one decision at a time about who gets the disk
        self._pins: dict[str, int] = {}  # cache key -> number of users (never evicted)
        self._downloads: dict[str, Download] = {}
        self._readings: dict[Path, ModelReading] = {}  # model directory -> what its files say
        # model directory -> (readings in a row that gave no answer, when a heartbeat's may read it again)
        self._unsettled: dict[Path, tuple[int, float]] = {}
        self.unsettled_retry_s = UNSETTLED_RETRY_S
        # Called (never under `_mutex`: `_flush_unsettled`) with `_unsettled` as JSON whenever it changes, to keep it
        # across a restart (the agent's state file: `Agent`, `restore_unsettled`).
        self.keep_unsettled: Callable[[dict], None] | None = None
        self._unsettled_changed = False
        self._keep_lock = threading.Lock()  # one `keep_unsettled` at a time, each with the latest copy
        self._reads_in_flight: dict[Path, threading.Event] = {}  # set when that directory's reading is made
        # directories a heartbeat found unread, in order, for the background reader
        self._to_read: dict[Path, None] = {}
        self._background_reader: threading.Thread | None = None
        # local sources served here, reported like cached ones: (source, scope) -> directory
        self._local_models: dict[tuple[str, str], Path] = {}
        self._remove_stale_partials()
        self._remove_orphaned_copies()
        self._remove_leftover_writes()
        self._index.remove_stale_lock_files()  # an agent killed -9 mid-download left its lock file

    # -- public ---------------------------------------------------------------

    def fetch(
        self, source: str, *, access: SourceAccess | None = None, on_progress=None, stop: threading.Event | None = None,
        pin: bool = False,
    ) -> Path:
        """Return a local directory holding the model, downloading it if needed.

        `access` says whose credentials read the source and who may share the copy (default:
        anonymous, shared). `on_progress(downloaded_bytes, size_bytes)` is called while downloading;
        once `stop` is set the download ends with `FetchStopped` and its disk reservation is released.
        Failures a customer may see are `WeightsError`s, whose messages carry no secrets.

        With `pin` the copy comes back pinned (`unpin` it once its engine is gone or its launch abandoned): pinned
        under its key's lock, which eviction needs too, so no eviction comes between the fetch and the pin; a fetch
        that raises holds no pin. NOTE: pinned by the caller after the fetch returned, a copy was evicted in between
        by another pull making room, and its replica's launch failed on the removed folder.
        """
        return self._fetch(source, access or SourceAccess(), weights_formats.fetched, "", on_progress, stop, pin)

    def fetch_adapter(
        self, source: str, *, access: SourceAccess | None = None, stop: threading.Event | None = None
    ) -> Path:
        """Return a local directory holding a LoRA adapter's files, downloading them if needed.

        Only the files vLLM reads from an adapter folder are fetched (`weights_formats.adapter_fetched`), and an
        adapter whose listing puts them over `adapter_max_bytes` is refused (`AdapterTooLarge`) before any byte is.
        NOTE: an adapter fetch is a side line of a replica already placed, asked for by any call naming the adapter;
        unbounded, a tenant's prefix of a tiny adapter beside hundreds of gigabytes of padding evicted other tenants'
        cached models from the node at every call.
        """

        def select(files: list) -> list:
            files = weights_formats.adapter_fetched(files)
            size_bytes = sum(f.size_bytes for f in files)
            if self.adapter_max_bytes is not None and size_bytes > self.adapter_max_bytes:
                raise AdapterTooLarge(
                    f"the adapter's files are {_human(size_bytes)}; this node loads adapters of at most "
                    f"{_human(self.adapter_max_bytes)}"
                )
            return files

        return self._fetch(source, access or SourceAccess(), select, ADAPTER_KIND, None, stop)

    def _fetch(self, source: str, access: SourceAccess, select, kind: str, on_progress, stop, pin: bool = False) -> Path:
        """`fetch` for the files `select` keeps of a listing; `kind` ("" for a model) keeps each kind's copies apart."""
        pins: list[Path] | None = [] if pin else None
        try:
            return self._fetch_pinning(source, access, select, kind, on_progress, stop, pins)
        except BaseException:
            for path in pins or ():  # pinned, then failed on the way out: no pin outlives a failed fetch
                self.unpin(path)
            raise

    def _pin_for(self, pins: list[Path] | None, path: Path) -> None:
        """Pin `path` for a fetch asked to (`pins` is None otherwise), noting it for `_fetch` to undo on a failure."""
        if pins is not None:
            self.pin(path)
            pins.append(path)

    def _fetch_pinning(self, source: str, access: SourceAccess, select, kind: str, on_progress, stop,
                       pins: list[Path] | None) -> Path:
        parsed = ModelSource.parse(source)
        if parsed.kind == "local":
            path = check_local_model_dir(parsed.location, self.private_dirs)
            with self._mutex:
                self._local_models[(source, access.scope)] = path
            self._pin_for(pins, path)  # never evicted, but pinned all the same: its caller unpins what it fetched
            return path
        if parsed.kind == "s3":
            endpoint = s3_endpoint_for(access, self.s3_endpoint_url)
        else:
            endpoint = weights_sources.hub_endpoint(self.hf_endpoint)
        endpoint_digest = digest(endpoint or "")
        with contextlib.ExitStack() as stack:
            try:
                if parsed.kind == "s3":
                    client = stack.enter_context(s3_client(access, source, default_endpoint_url=self.s3_endpoint_url))
                    files = select(weights_sources.s3_listing(client, parsed, source, stop=stop))
                    fingerprint = json.dumps(sorted((f.location, f.size_bytes, f.etag) for f in files))
                else:  # a branch moves: key by the commit it points at now
                    client = stack.enter_context(hf_client(access, source))
                    files, fingerprint = weights_sources.hf_listing(client, parsed, source, endpoint, stop=stop)
                    files = select(files)
            except StoreUnreachable:
                # NOTE: only when the store cannot be reached at all (never on a refusal), and only
                # a copy this same scope fetched from this same endpoint: bad credentials get nothing.
                cached = self._index.newest(source, access.scope, endpoint_digest, kind=kind)
                if cached is None:
                    raise
                with self._index.key_lock(cached.name):
                    if not self._index.is_complete(cached.name):  # evicted since it was found
                        raise
                    logger.warning("cannot reach the store of %s; using the cached copy %s", source, cached.name)
                    self._index.touch(cached.name)
                    self._pin_for(pins, cached)
                with self._mutex:
                    self.num_hits += 1
                return cached
            if kind:  # a Hub commit fingerprints a model's files and an adapter's alike
                fingerprint = f"{kind}\n{fingerprint}"
            key = cache_key(source, fingerprint, scope=access.scope, endpoint=endpoint or "")
            with self._index.key_lock(key):
                path = self.root / key
                if self._index.is_complete(key):
                    self._index.touch(key)
                    self._pin_for(pins, path)
                    with self._mutex:
                        self.num_hits += 1
                    return path
                if stop is not None and stop.is_set():
                    # NOTE: drained while it waited for another pull of this copy, which did not finish it: before, it
                    # made room for the whole model (evicting other models) and only then noticed.
                    raise fetch_stopped(source)
                download = Download(
                    source=source, cache_key=key, size_bytes=sum(f.size_bytes for f in files), scope=access.scope,
                    disk_bytes=disk_bytes((f.parts, f.size_bytes) for f in files),
                )
                with self._mutex:
                    self._downloads[key] = download
                try:
                    if kind == ADAPTER_KIND:
                        self._keep_adapters_within_share(access.scope, download.disk_bytes)
                    self._make_room(key, download.disk_bytes)
                    self._download_into_place(parsed, client, files, path, download, on_progress, stop)
                    manifest = {
                        "source": source,
                        "cache_key": key,
                        "scope": access.scope,
                        "endpoint_digest": endpoint_digest,
                        "size_bytes": download.size_bytes,
                        "disk_bytes": download.disk_bytes,
                        "fingerprint": fingerprint,
                        "created_at": time.time(),
                    }
                    if kind:
                        manifest["kind"] = kind
                    self._index.write_manifest(key, manifest)
                    self._pin_for(pins, path)  # NOTE: before the key's lock goes: eviction takes it first
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
        """Let go of one use of a copy. The last one counts as a use (its manifest touched), so a private copy's grace
        (`release_unwanted`) runs from when its last replica let it go, on the disk, across an agent restart."""
        key = Path(path).name
        with self._mutex:
            if self._pins.get(key, 0) <= 1:
                released = self._pins.pop(key, None) is not None
            else:
                self._pins[key] -= 1
                released = False
        if released and _CACHE_KEY.fullmatch(key) and Path(path).parent == self.root:
            with contextlib.suppress(OSError):  # evicted meanwhile, or a local model: nothing to touch
                self._index.touch(key)

    def release_unwanted(self, wanted: set[tuple[str, str]], *, now: float | None = None) -> list[str]:
        """Remove the organisations' own cached copies (models, drafts and adapters of a private scope) whose
        (source, scope) is not in `wanted` (what the node's desired replicas name: `reconciler.wanted_copies`), that
        no replica uses (pinned), and that nobody used for `private_grace_s`, and the downloads of such copies stopped
        mid-way that no fetch resumes (`.tmp/<key>.partial`, idle for the grace); the keys removed.

        NOTE: before, a private copy left only when the budget or the disk needed its room: the weights of a deleted
        endpoint (read with a credential deleted since) stayed on every node that had run it, for good on a node
        whose cache never filled. Removal is `_evict_lru`'s: under the key's lock, the pin checked again there, so a
        pull that fetched it meanwhile keeps it (or, evicted first, fetches it again). Shared catalogue copies ("")
        are left to the budget's LRU, so they are never downloaded again needlessly."""
        now = time.time() if now is None else now
        released = [
            entry for entry in self._index.entries()
            if entry.get("scope", "")
            and (entry.get("source"), entry.get("scope")) not in wanted
            and now - entry["last_used_at"] >= self.private_grace_s
        ]
        evicted = self._evict_lru(released, math.inf) if released else []
        partials = [
            partial for partial in self._idle_partials(exclude="")
            if now - self._partial_last_written(*partial[:2]) >= self.private_grace_s
            and self._partial_released(partial[0], wanted)
        ]
        self._drop_partials(partials, math.inf)
        return evicted + [key for key, _, _ in partials if not (self.root / ".tmp" / f"{key}.partial").exists()]

    def _partial_last_written(self, key: str, folder_mtime: float) -> float:
        """When a partial download was last written: its folder's time or its journal's, the later. NOTE: the folder's
        alone is when its download began (its files are created and sized then, parts written into them later change
        theirs, and a resume creates nothing): a download of an hour stopped a moment ago was released at once,
        whatever the grace. The journal is rewritten at each part done (`Transfer`)."""
        try:
            return max(folder_mtime, (self.root / ".parts" / f"{key}.json").stat().st_mtime)
        except OSError:
            return folder_mtime

    def _partial_released(self, key: str, wanted: set[tuple[str, str]]) -> bool:
        """Whether an idle partial download may go for `release_unwanted`: its journal names a private copy not in
        `wanted`, or it has no journal to resume from (none written yet, or not JSON: the next fetch starts it over,
        `Transfer.run`, so it holds nothing worth keeping, whoever's it is). One an older agent wrote names nobody:
        left to `STALE_PARTIAL_S` and the room, as before."""
        try:
            journal = json.loads((self.root / ".parts" / f"{key}.json").read_bytes())
        except (FileNotFoundError, ValueError):
            return True
        except OSError:
            return False
        if not isinstance(journal, dict):
            return True
        source, scope = journal.get("source"), journal.get("scope")
        return isinstance(source, str) and isinstance(scope, str) and bool(scope) and (source, scope) not in wanted

    def evict(self) -> list[str]:
        """Remove least recently used complete models until the cache fits its budget."""
        if self.budget_bytes is None:
            return []
        entries = self._index.entries()
        excess = sum(_charged(entry) for entry in entries) - self.budget_bytes
        return self._evict_lru(entries, excess)

    def remove_unpinned(self) -> list[str]:
        """Remove every complete model no replica pins, whatever the budget, and every partial download no fetch is
        resuming (`.tmp/<key>.partial` and its journal): a retired node's tenants' weights (`Agent.heartbeat_once`).
        The keys removed. NOTE: before, the partials stayed: a tenant's model downloaded nearly whole left on a retired
        node's disk."""
        evicted = self._evict_lru(self._index.entries(), math.inf)
        partials = self._idle_partials(exclude="")
        self._drop_partials(partials, math.inf)
        return evicted + [key for key, _, _ in partials if not (self.root / ".tmp" / f"{key}.partial").exists()]

    def read_model(self, model_dir: str | Path) -> ModelReading:
        """What a fetched model's files say, or why it is refused (read once per directory; a cached model
        never changes, and a malformed one is not read again at every heartbeat). A reading that gave no answer
        (`ModelReading.unsettled`) is not kept: read again by the next call, and by heartbeats' reads after
        `unsettled_retry_s`.

        NOTE: single-flight: a caller that finds the directory being read (by the background reader, another
        pull) waits for that reading instead of parsing the tenant's files again.
        """
        model_dir = Path(model_dir)
        while True:
            with self._mutex:
                if model_dir in self._readings:
                    return self._readings[model_dir]
                in_flight = self._reads_in_flight.get(model_dir)
                if in_flight is None:
                    done = self._reads_in_flight[model_dir] = threading.Event()
                    break
            in_flight.wait()
        reading = None
        try:
            reading = read_model(model_dir)
        finally:
            with self._mutex:
                if reading is None or not self._still_cached(model_dir):
                    pass  # returned to this caller, never kept
                elif reading.unsettled:
                    num_tries = self._unsettled.get(model_dir, (0, 0.0))[0] + 1
                    delay = self.unsettled_retry_s[min(num_tries, len(self.unsettled_retry_s)) - 1]
                    self._unsettled[model_dir] = (num_tries, time.monotonic() + delay)
                    self._keep_unsettled()
                else:
                    self._readings[model_dir] = reading
                    if self._unsettled.pop(model_dir, None) is not None:
                        self._keep_unsettled()
                del self._reads_in_flight[model_dir]
            done.set()
            self._flush_unsettled()
        return reading

    def restore_unsettled(self, record) -> int:
        """Take the back-offs of readings that gave no answer that a previous agent on this boot of the node kept
        (`keep_unsettled`): {model directory: [readings in a row that gave no answer, when a heartbeat's may read it
        again on this boot's monotonic clock]}. Before, a restarted agent read them all again at once, its back-off
        back at the first step. Returns how many were taken; an entry not of that shape is ignored with a log line."""
        if not isinstance(record, dict):
            return 0
        latest = time.monotonic() + max(self.unsettled_retry_s)
        taken = {}
        for path, entry in record.items():
            try:
                num_tries, retry_at = int(entry[0]), float(entry[1])
            except (TypeError, ValueError, IndexError, KeyError):
                num_tries, retry_at = 0, 0.0
            if not isinstance(path, str) or not os.path.isabs(path) or not 1 <= num_tries <= 1000:
                logger.warning("a back-off kept by a previous agent is not one: ignored")
                continue
            # NOTE: never longer than the schedule's longest
            taken[Path(path)] = (num_tries, min(retry_at, latest))
        with self._mutex:
            for path, entry in taken.items():
                self._unsettled.setdefault(path, entry)
        return len(taken)

    def _still_cached(self, model_dir: Path) -> bool:
        """Under the mutex, once a reading is made: whether it may be kept (or its back-off), i.e. the directory is
        still a complete copy (or a local model directory still there).

        NOTE: a model evicted while it was read (a heartbeat queued it, a pull evicted it, then the background reader
        read the removed directory) left an empty reading behind `_forget_reading`; the same content fetched again
        (same key, same directory) then reused it, and its checks (`model_info.read_model`) were skipped for the
        agent's life. The manifest goes first on eviction (`CacheIndex.remove`) and comes last on a download, so a
        reading finished before it went was of the whole copy."""
        if model_dir.parent == self.root:
            return self._index.is_complete(model_dir.name)
        return model_dir.is_dir()

    def _forget_reading(self, model_dir: Path) -> None:
        """Drop what was read of a directory the cache removed, and any read of it queued by a heartbeat. NOTE: kept
        before, one reading (and any back-off, in the state file too) for every model the node ever evicted, for the
        agent's life."""
        with self._mutex:
            self._readings.pop(model_dir, None)
            self._to_read.pop(model_dir, None)
            if self._unsettled.pop(model_dir, None) is not None:
                self._keep_unsettled()
        self._flush_unsettled()

    def _keep_unsettled(self) -> None:
        """Under the mutex: `_unsettled` changed; its caller hands it to `keep_unsettled` once the mutex is released
        (`_flush_unsettled`)."""
        self._unsettled_changed = True

    def _flush_unsettled(self) -> None:
        """Not under the mutex: hand `_unsettled` to `keep_unsettled` if it changed since it was last handed over.

        NOTE: `keep_unsettled` writes the state file durably (two fsyncs, up to ~0.3 s on a busy disk); made under the
        mutex, every heartbeat's listing (`statuses`), download progress and pin waited on the disk behind it. The
        copy is taken and written under `_keep_lock`, one writer at a time, so the last written is the latest: a change
        made after a copy was taken marks it changed again, and its own caller writes it after."""
        if self.keep_unsettled is None:
            return
        with self._keep_lock:
            with self._mutex:
                if not self._unsettled_changed:
                    return
                self._unsettled_changed = False
                record = {str(path): list(entry) for path, entry in self._unsettled.items()}
            self.keep_unsettled(record)

    def model_info(self, model_dir: str | Path) -> ModelInfo | None:
        return self.read_model(model_dir).info

    def reading_made(self, model_dir: str | Path) -> ModelReading | None:
        """The reading of `model_dir` if one was made, else None ("not read yet"), and a read is queued for the
        background reader. Never reads a tenant's files itself.

        NOTE: for the heartbeat thread (`statuses`): after an agent restart every cached model is unread, and
        parsing their headers there (seconds each for a hostile one) outlasted the heartbeat grace: the node went
        offline with every tenant's replicas.
        """
        model_dir = Path(model_dir)
        with self._mutex:
            reading = self._readings.get(model_dir)
            if reading is not None:
                return reading
            if time.monotonic() < self._unsettled.get(model_dir, (0, 0.0))[1]:
                return None  # not read this time: read again once its back-off is over
            self._to_read[model_dir] = None
            if self._background_reader is None:
                self._background_reader = threading.Thread(
                    target=self._read_in_background, name="weights-reader", daemon=True
                )
                self._background_reader.start()
        return None

    def _read_in_background(self) -> None:
        """Read what heartbeats found unread, one directory at a time, until none is left."""
        while True:
            with self._mutex:
                if not self._to_read:
                    self._background_reader = None
                    return
                model_dir = next(iter(self._to_read))
                del self._to_read[model_dir]
            try:
                self.read_model(model_dir)
            except Exception:  # noqa: BLE001 - NOTE: `read_model` never raises; the reader must outlive a bug
                logger.exception("reading model %s in the background failed", model_dir.name)

    def statuses(self) -> list[WeightsStatus]:
        """Complete models (with what their files say, once read) and downloads in progress, for heartbeats.

        NOTE: never reads a tenant's files: a copy not read yet is reported with `model_info=None` and read in the
        background (`reading_made`); only the copies the heartbeat carries are queued.
        """
        directories: dict[str, Path] = {}  # cache key -> the complete copy's directory
        statuses = []
        for entry in self._index.entries():
            status = WeightsStatus(
                source=entry["source"],
                cache_key=entry["cache_key"],
                size_bytes=entry["size_bytes"],
                downloaded_bytes=entry["size_bytes"],
                complete=True,
                last_used_at=entry["last_used_at"],
                scope=entry.get("scope", ""),
            )
            directories[status.cache_key] = self.root / entry["cache_key"]
            statuses.append(status)
        with self._mutex:
            downloads = list(self._downloads.values())
            local_models = list(self._local_models.items())
        for (source, scope), path in local_models:
            size_bytes = _local_size(path)
            status = WeightsStatus(
                source=source, cache_key=f"local-{digest(str(path))}", size_bytes=size_bytes,
                downloaded_bytes=size_bytes, complete=True, scope=scope,
            )
            directories[status.cache_key] = path
            statuses.append(status)
        statuses += [
            WeightsStatus(
                source=download.source,
                cache_key=download.cache_key,
                size_bytes=download.size_bytes,
                downloaded_bytes=download.downloaded_bytes,
                scope=download.scope,
            )
            for download in downloads
        ]
        if len(statuses) > MAX_WEIGHTS_REPORTS:
            # NOTE: a heartbeat carries at most this many (the control plane refuses it whole past it): what is being
            # fetched and the local models first, then the most recently used copies.
            statuses.sort(key=lambda status: (status.last_used_at is not None, -(status.last_used_at or 0.0)))
            del statuses[MAX_WEIGHTS_REPORTS:]
        for status in statuses:
            if status.complete:
                reading = self.reading_made(directories[status.cache_key])
                status.model_info = _sendable(reading.info, status.source) if reading is not None else None
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
                    max(d.disk_bytes - d.downloaded_bytes, 0) for k, d in self._downloads.items() if k != key
                )
                reserved = sum(d.disk_bytes for k, d in self._downloads.items() if k != key)
            disk = shutil.disk_usage(self.root)
            reserve = int(disk.total * self.disk_reserve_fraction)
            keeps = f" and keeps {_human(reserve)} free" if reserve else ""
            if size_bytes > disk.total - reserve:
                raise ModelTooLarge(
                    f"model is {_human(size_bytes)}; this node's weights disk is {_human(disk.total)}{keeps}"
                )
            entries = self._index.entries()
            partials = self._idle_partials(exclude=key)
            need = size_bytes - (disk.free - reserve - pending)
            if self.budget_bytes is not None:
                cached = sum(_charged(entry) for entry in entries) + sum(used for _, _, used in partials)
                need = max(need, cached + reserved + size_bytes - self.budget_bytes)
            if need <= 0:
                return
            freed = self._drop_partials(partials, need)
            evicted = set(self._evict_lru(entries, need - freed)) if freed < need else set()
            freed += sum(_charged(entry) for entry in entries if entry["cache_key"] in evicted)
            if freed < need:
                limit = (
                    f"this node's weights budget is {_human(self.budget_bytes)}"
                    if self.budget_bytes is not None
                    else f"the weights disk has {_human(disk.free)} free{keeps}"
                )
                raise ModelTooLarge(
                    f"model is {_human(size_bytes)}; {limit} and the models in use leave no room for it"
                )

    def _keep_adapters_within_share(self, scope: str, size_bytes: int) -> None:
        """Evict this scope's least recently used cached adapters until they and `size_bytes` more fit its share
        (`ADAPTER_SHARE` adapters at the bound). NOTE: without it, each adapter of a tenant's that no engine needs
        any more stayed cached while the next one evicted other tenants' models, however many adapters it cycled
        through; now what a scope's adapters take from others is bounded, and they make room among themselves."""
        if self.adapter_max_bytes is None:
            return
        with self._space_lock:
            own = [
                entry for entry in self._index.entries()
                if entry.get("kind") == ADAPTER_KIND and entry.get("scope", "") == scope
            ]
            excess = sum(_charged(entry) for entry in own) + size_bytes - ADAPTER_SHARE * self.adapter_max_bytes
            if excess > 0:
                self._evict_lru(own, excess)

    def _idle_partials(self, *, exclude: str) -> list[tuple[str, float, int]]:
        """Downloads stopped mid-way and kept for a resume that no fetch is resuming: (key, last written, bytes on disk),
        oldest first. NOTE: they counted against nothing: a tenant could stop download after download of models whose
        content then changed (a new cache key each time), each left nearly whole, until the disk was full."""
        with self._mutex:
            busy = set(self._downloads) | {exclude}
        found = []
        for folder in (self.root / ".tmp").glob("*.partial"):
            key = folder.name.removesuffix(".partial")
            if key in busy:
                continue
            try:
                found.append((key, folder.stat().st_mtime, _disk_bytes(folder)))
            except OSError:
                continue
        return sorted(found, key=lambda partial: partial[1])

    def _drop_partials(self, partials: list[tuple[str, float, int]], num_bytes: int) -> int:
        """Remove idle partial downloads, oldest first, until `num_bytes` are freed; returns the bytes freed."""
        freed = 0
        for key, _, used in partials:
            if freed >= num_bytes:
                break
            lock = self._index.key_lock(key, blocking=False)
            if lock is None:  # a fetch resumes it now
                continue
            with lock:
                remove_path(self.root / ".tmp" / f"{key}.partial")
                (self.root / ".parts" / f"{key}.json").unlink(missing_ok=True)
            freed += used
            logger.info("dropped the partial download %s to make room", key)
        return freed

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
            lock = self._index.key_lock(key, blocking=False)
            if lock is None:  # being downloaded or read by someone else
                continue
            with lock:
                # NOTE: again under the key's lock, which a fetch pins under: a pull's fetch(pin=True) of this model
                # could run whole between the check above and this lock, and its folder was removed as it was handed
                # out.
                with self._mutex:
                    pinned = bool(self._pins.get(key))
                if not pinned:
                    self._index.remove(key)
            if pinned:
                continue
            self._forget_reading(self.root / key)
            freed += _charged(entry)
            evicted.append(key)
            logger.info("evicted weights %s (%s)", key, entry.get("source"))
        return evicted

    # -- downloading --------------------------------------------------------------

    def _download_into_place(
        self, parsed, client, files, path: Path, download: Download, on_progress, stop: threading.Event | None = None
    ) -> None:
        """Fetch (or finish fetching) the model into `.tmp/<key>.partial`, then rename it into place."""
        transfer = Transfer(
            parsed, client, files, self.root / ".tmp" / f"{path.name}.partial",
            self.root / ".parts" / f"{path.name}.json", download, on_progress, self.transfer, stop,
        )
        try:
            folder = transfer.run()
        except (StoreUnreachable, FetchStopped):
            # NOTE: what was written stays, and the next fetch of the same content resumes it (partials nobody
            # resumed for a day are removed): a drain or an agent restart mid-download keeps what it had
            raise
        except BaseException:
            transfer.discard()
            raise
        try:
            remove_path(path)  # a stale directory without a manifest
            os.rename(folder.path, path)
            try:
                folder.check_in_place(path)
                # NOTE: its files and folders were made durable before (`Transfer.run`); now its new name, before the
                # manifest that vouches for it is written (`CacheIndex.write_manifest`).
                durable.sync_folder(self.root)
                durable.sync_folder(self.root / ".tmp")
            except BaseException:  # replaced meanwhile, or its name not made durable (EIO): no folder nobody counts
                remove_path(path)
                raise
        finally:
            folder.close()
            transfer.discard()

    def _remove_stale_partials(self) -> None:
        """Partial downloads nobody resumed for `STALE_PARTIAL_S` (their content changed, or the model went)."""
        cutoff = time.time() - STALE_PARTIAL_S
        for journal in (self.root / ".parts").glob("*.json"):
            key = journal.stem
            lock = self._index.key_lock(key, blocking=False)
            if lock is None:
                continue
            with lock:
                try:
                    if journal.stat().st_mtime < cutoff:
                        remove_path(self.root / ".tmp" / f"{key}.partial")
                        journal.unlink(missing_ok=True)
                except FileNotFoundError:
                    pass
        for leftover in (self.root / ".tmp").iterdir():
            key = leftover.name.partition(".")[0]
            if not (self.root / ".parts" / f"{key}.json").exists() and leftover.stat().st_mtime < cutoff:
                remove_path(leftover)

    def _remove_orphaned_copies(self) -> None:
        """Model folders with no manifest that nobody holds the lock of: what an agent killed mid-eviction (the manifest
        goes first) or between a download's rename into place and its manifest left. A manifest that cannot be read
        (an older agent's, written without `fsync` and left empty or cut short by a power loss) is none: it goes too,
        and its copy is fetched again when next asked for.

        NOTE: nothing counted them (neither a cached copy nor a partial download) and only a fetch of the very same
        content removed them: each such kill (an upgrade's SIGTERM, the OOM killer; pulls run on daemon threads) left
        up to a whole model on the weights disk for good. Another process putting a copy in place holds its lock."""
        keys = {path.name if path.is_dir() or not path.name.endswith(".json") else path.stem
                for path in self.root.iterdir()}
        for key in sorted(keys):
            if not _CACHE_KEY.fullmatch(key) or self._index.read_manifest(key) is not None:
                continue
            lock = self._index.key_lock(key, blocking=False)
            if lock is None:
                continue
            with lock:
                if self._index.read_manifest(key) is None:
                    logger.warning("removing the model folder %s, which no readable manifest names (an agent killed "
                                   "while it evicted or finished it, or a power loss)", key)
                    self._index.remove(key)


    def _remove_leftover_writes(self) -> None:
        """The temporary files of manifest and journal writes killed before their rename (`_LEFTOVER_WRITE`), of keys
        nobody holds the lock of (whoever writes a key's manifest or journal holds it).

        NOTE: never removed before: one more on the weights disk for each agent killed or node powered off mid-write."""
        for folder in (self.root, self.root / ".parts"):
            for leftover in folder.iterdir():
                match = _LEFTOVER_WRITE.fullmatch(leftover.name)
                if match is None:
                    continue
                lock = self._index.key_lock(match.group(1), blocking=False)
                if lock is None:
                    continue
                with lock:
                    if leftover.is_file() and not leftover.is_symlink():
                        leftover.unlink(missing_ok=True)


def _disk_bytes(folder: Path) -> int:
    """The blocks a folder's files take on disk (a partial download's files are sparse until written)."""
    return sum(path.lstat().st_blocks * 512 for path in folder.rglob("*") if path.is_file() and not path.is_symlink())


def _charged(entry: dict) -> int:
    """What a cached model counts against the budget (a manifest written before `disk_bytes`: its size)."""
    return max(entry.get("disk_bytes", 0), entry["size_bytes"])


def _sendable(info: ModelInfo | None, source: str) -> ModelInfo | None:
    """`info`, or None when it cannot go out in a heartbeat's UTF-8 body (a lone surrogate the protocol let by).

    NOTE: defence in depth: the facts are a tenant's files, read once and attached to every heartbeat; one the
    body cannot encode failed every heartbeat (httpx raises before sending), and the node went offline with every
    tenant's replicas. Its model's facts are dropped instead (as not read yet), and the node keeps beating."""
    if info is None:
        return None
    try:
        json.dumps(info.to_dict(), ensure_ascii=False).encode("utf-8")
    except (UnicodeEncodeError, ValueError, TypeError):
        logger.error("the facts of model %s cannot be sent in a heartbeat: left out", source[:200])
        return None
    return info


def _local_size(path: Path) -> int:
    """The safetensors files of a local model directory, in bytes (0 for what cannot be read now)."""
    try:
        return sum(f.stat().st_size for f in path.glob("*.safetensors"))
    except OSError:  # a file removed meanwhile, a dangling link: the heartbeat goes out all the same
        return 0


def _human(num_bytes: int | None) -> str:
    value = float(num_bytes or 0)
    for unit in ("bytes", "kB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            break
        value /= 1000
    text = f"{value:.0f}" if unit == "bytes" else f"{value:.1f}".removesuffix(".0")
    return f"{text} {unit}"
