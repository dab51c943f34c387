"""The weights cache's record on disk: manifests, per-model locks and content addresses.

Layout: `<root>/<cache_key>/` holds one complete model and `<root>/<cache_key>.json` its manifest
(written last, atomically and durably: `durable`; its mtime is the last use), so a model without a manifest (or with
one that cannot be read) is never complete. One lock per cache key (a thread lock plus an `flock` on `<root>/.locks/<key>.lock`)
serialises everyone who downloads, reads or evicts that model, across threads and processes. Both last only
while someone holds or waits for them: every cache key ever fetched left its lock file and thread lock behind
before, one more for each model pulled (a new content is a new key) for the agent's life. A lock file whose holder
was killed -9 goes when the next cache opens (`remove_stale_lock_files`); a `.locks` removed is made again.

A cache key covers the source, its content, the store's endpoint and the replica's `weights_scope`
(`cache_key`); the manifest keeps only a digest of the endpoint, which may carry user info. What to
download and what to evict is decided by `weights.WeightsCache`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import threading
import time
from pathlib import Path

from gpu_agent.runtime import durable


class CacheIndex:
    """The complete models under `root`, as their manifests say, and the lock of each."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._mutex = threading.Lock()
        # key -> its thread lock and how many threads hold or wait for it (dropped at none)
        self._key_locks: dict[str, tuple[threading.Lock, int]] = {}

    def manifest_path(self, key: str) -> Path:
        return self.root / f"{key}.json"

    def is_complete(self, key: str) -> bool:
        """Whether the copy's folder is there and its manifest says it is complete. NOTE: a manifest that cannot be
        read (one an older agent wrote without `fsync`, left empty or cut short by a power loss) says nothing: the
        copy is fetched again, never served on its word (`read_manifest`)."""
        path = self.root / key
        return self.read_manifest(key) is not None and path.is_dir() and not path.is_symlink()

    def read_manifest(self, key: str) -> dict | None:
        """The copy's manifest, or None when there is none or it is not one (empty, cut short, not this key's)."""
        try:
            manifest = json.loads(self.manifest_path(key).read_bytes())
        except (OSError, ValueError):
            return None
        if not isinstance(manifest, dict) or manifest.get("cache_key") != key:
            return None
        return manifest

    def write_manifest(self, key: str, manifest: dict) -> None:
        """Mark the model complete (the last step of a download), durably: its files and folders were made durable
        first (`weights_transfer.Transfer.run`, `WeightsCache._download_into_place`), so a power loss never leaves a
        manifest naming bytes that did not reach the disk (`durable`)."""
        durable.write_atomic(self.manifest_path(key), json.dumps(manifest), mode=0o644)

    def touch(self, key: str) -> None:
        """Record a use (the least recently used model is evicted first)."""
        # NOTE: stamped with this process's precise time, not the kernel's (`os.utime(path)` without times): a file's
        # write is stamped by the kernel's coarse clock, up to a tick (~4 ms) behind, so a use recorded just after
        # another copy's download could read as no later than it, and the copy just used was evicted first.
        now = time.time()
        os.utime(self.manifest_path(key), (now, now))

    def remove(self, key: str) -> None:
        """Forget a model, manifest first, so it never looks complete while its files go (the manifest's removal made
        durable before any file goes: a power loss never leaves a manifest beside a folder half removed)."""
        manifest = self.manifest_path(key)
        if manifest.exists() or manifest.is_symlink():
            manifest.unlink(missing_ok=True)
            durable.sync_folder(self.root)
        remove_path(self.root / key)

    def entries(self) -> list[dict]:
        """Every complete model's manifest, with `last_used_at`."""
        entries = []
        for manifest_path in self.root.glob("*.json"):
            entry = self.read_manifest(manifest_path.stem)
            if entry is None:  # being written, cut short by a power loss, or not a manifest
                continue
            try:
                entry["last_used_at"] = manifest_path.stat().st_mtime
            except OSError:
                continue
            entries.append(entry)
        return entries

    def newest(self, source: str, scope: str, endpoint_digest: str, *, kind: str = "") -> Path | None:
        """The newest copy of `source` this scope fetched from this endpoint, if any, as a model or (`kind`) an
        adapter."""
        entries = [
            entry
            for entry in self.entries()
            if entry.get("source") == source
            and entry.get("scope", "") == scope
            and entry.get("endpoint_digest", "") == endpoint_digest
            and entry.get("kind", "") == kind
        ]
        if not entries:
            return None
        return self.root / max(entries, key=lambda entry: entry["created_at"])["cache_key"]

    def key_lock(self, key: str, *, blocking: bool = True):
        """A context manager holding the key's thread and file locks (None if not blocking and busy)."""
        with self._mutex:
            thread_lock, num_users = self._key_locks.get(key, (None, 0))
            thread_lock = thread_lock or threading.Lock()
            self._key_locks[key] = (thread_lock, num_users + 1)
        stack = contextlib.ExitStack()
        stack.callback(self._leave_key_lock, key)
        if not thread_lock.acquire(blocking=blocking):
            stack.close()
            return None
        stack.callback(thread_lock.release)
        try:
            acquired = stack.enter_context(self._file_lock(key, blocking=blocking))
        except BaseException:
            stack.close()
            raise
        if not acquired:
            stack.close()
            return None
        return stack

    def remove_stale_lock_files(self) -> None:
        """Remove the lock files nobody holds (their holder was killed before it released them: the file stays, its
        `flock` goes with the process). Each is taken and released, and its holder's release removes it."""
        for lock_file in (self.root / ".locks").glob("*.lock"):
            lock = self.key_lock(lock_file.stem, blocking=False)
            if lock is not None:
                lock.close()

    def _leave_key_lock(self, key: str) -> None:
        with self._mutex:
            thread_lock, num_users = self._key_locks[key]
            if num_users <= 1:
                del self._key_locks[key]
            else:
                self._key_locks[key] = (thread_lock, num_users - 1)

    @contextlib.contextmanager
    def _file_lock(self, key: str, *, blocking: bool):
        """The `flock` of the key's lock file, which its holder removes on release.

        NOTE: a process that opened the file before it was removed gets the lock of a file no longer there: it
        checks that what it locked is what the path names, and tries again if not, so two never hold the key."""
        path = self.root / ".locks" / f"{key}.lock"
        while True:
            try:
                handle = open(path, "a+")
            except FileNotFoundError:
                # NOTE: `.locks` removed (by hand, by a tmp cleaner: it is empty while nobody holds a lock): made
                # again. Before, every fetch and eviction failed until the agent restarted.
                path.parent.mkdir(exist_ok=True)
                continue
            with handle:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
                except BlockingIOError:
                    yield False
                    return
                try:
                    if os.stat(path).st_ino != os.fstat(handle.fileno()).st_ino:
                        continue  # removed (and maybe made again) while we waited: lock the one there now
                except FileNotFoundError:
                    continue
                try:
                    yield True
                finally:
                    path.unlink(missing_ok=True)  # NOTE: while still held, so no waiter keeps a lock on it
                    fcntl.flock(handle, fcntl.LOCK_UN)
                return


def cache_key(source: str, fingerprint: str, *, scope: str = "", endpoint: str = "") -> str:
    """Content address: one source, at one content, from one store, for one scope, maps to one directory."""
    return hashlib.sha256(f"{source}\n{fingerprint}\n{scope}\n{endpoint}".encode()).hexdigest()[:32]


def digest(text: str) -> str:
    # The endpoint URL may carry user info: the manifest keeps only a digest of it.
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def remove_path(path: Path) -> None:
    """Remove a file, a link (never what it points to) or a directory tree, if there."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.exists():
        shutil.rmtree(path, ignore_errors=True)
