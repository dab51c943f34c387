"""A durable local journal for usage rows that could not reach PostgreSQL.

When the ledger writer (`billing.usage_writer`) cannot commit a batch (the database is down,
restarting, or does not answer in time), the batch is appended here as JSON lines and fsync'd
before the caller hears "written": the client already has its completion, so its usage must not
live only in memory. The writer replays the journal, idempotently by request id (the ledger's
unique constraint), as soon as the database answers again, and every gateway replays what is left
when it starts (a gateway that died with a backlog leaves its segments to the next one).

Why a local journal rather than a Redis stream: the faults this covers are operators' faults, and
Redis losing its memory is one of them. A row that reached neither PostgreSQL nor a disk would be
lost by a Redis restart without persistence; a file under the data folder survives Redis, the
gateway process and the database alike. Its cost is one fsync per batch, paid only during an outage.

Layout: `<INFERPLANE_USAGE_JOURNAL_DIR>/<host>-<pid>-<ns>.jsonl`, one segment per process at a time,
held under an exclusive `flock` while its process appends to it (taken before the segment has that name: created
as a hidden `.<name>.tmp`, locked, then renamed). A segment rotates past
`MAX_SEGMENT_BYTES` and whenever its process replays (so what it replays is sealed). A replayer takes
only segments it can lock: those of dead processes and its own sealed ones, never a live writer's.
A replayed segment is deleted; rows the ledger refuses (their endpoint is gone) move to
`rejected.jsonl` for an operator, never retried forever.

Its size is bounded, without a look at the folder per write: `num_bytes` is the bytes of the folder's segments as
this process last listed them (`list_segments`: every replay lists, at start and every retry of an outage) plus
what this process appended since, less the segments it replayed. Past `max_bytes` (`INFERPLANE_USAGE_JOURNAL_MAX_BYTES`)
the journal is `full`: the gateway refuses new calls (their usage could not be recorded) and `/readyz` says not
ready, while calls already admitted still append here, into the headroom below the volume's limit
(`ADMITTED_HEADROOM_BYTES`). Before, a database that took no writes for half an hour filled the web pod's volume,
the kubelet evicted the pod and deleted the journal with it: every call answered in the outage went unbilled.

NOTE: usage sitting in a journal is not in the ledger yet, so a spend counter or credit figure rebuilt from the ledger
meanwhile (Redis flushed, restarted, the figure expired) lacks it; the replay counts each row it writes in the counters
that lack it, once (`billing.quota.replayed`). Before, the counter never learnt it: it was written into the ledger and
nowhere else, and caps, the limit without a payment method and prepaid credit admitted that much more for the month.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from pathlib import Path

from prometheus_client import Counter

from billing.ledger import REPORT_FIELDS, REPORT_MONEY, REPORT_TIMES, UsageReport, reports_json

logger = logging.getLogger("inferplane.billing")

SEGMENT_SUFFIX = ".jsonl"
NEW_SUFFIX = ".tmp"  # a segment being created: `.<name>.tmp` until it is locked (`UsageJournal._new_segment`)
# A new segment's hidden file older than this was left by a process that died creating it (it takes microseconds).
LEFT_NEW_AFTER_S = 60.0
REJECTED_NAME = "rejected.jsonl"
# Lines a gateway's replay set aside (`UsageJournal.done`), by reason ("refused": by the ledger; "unreadable": by this
# version): calls not billed until `manage.py replay_rejected_usage` bills them. Exported by the gateway's /metrics
# (`endpoints.gateway.metrics`) and a Celery worker's (`controlplane.worker_metrics`: its replays of the files bucket),
# charted on the dashboard by job (infra/grafana/inferplane.json).
lines_set_aside = Counter("inferplane_usage_lines_set_aside_total",
                          "Usage journal lines a replay set aside unbilled (refused by the ledger, or unreadable by "
                          "this version), by reason.", ["reason"], registry=None)
MAX_SEGMENT_BYTES = 64 * 1024 * 1024
# NOTE: what the journal's volume holds past `max_bytes`, for the calls admitted before the journal was full, which
# still journal their rows as they end (none is ever lost), and for another process's appends this one has not listed
# yet (`list_segments`, every 5 s at most during an outage). A row takes 0.7 to 1 KiB: 64 MiB hold some 65,000 rows,
# the calls a pod's processes may have in flight many times over (tests/infra/test_manifests.py holds the web pod's
# volume to `INFERPLANE_USAGE_JOURNAL_MAX_BYTES` plus this).
ADMITTED_HEADROOM_BYTES = 64 * 1024 * 1024
_FIELDS = frozenset(REPORT_FIELDS)


def encode(report: UsageReport) -> bytes:
    # NOTE: msgspec's encoder, as the ledger's rows (~1 µs a line against ~12 through `as_json_row` and the json module:
    # a gateway's beat encodes every running call whose progress changed). UTC times end in "Z" (lines written
    # before: "+00:00"); `decode` reads both.
    return reports_json(report) + b"\n"


def decode(line: bytes) -> UsageReport:
    """A journal line's report; ValueError (or TypeError, KeyError) for a line this version cannot read."""
    row = json.loads(line)
    if not isinstance(row, dict):  # `null`, `[1, 2]`: never a report (before: AttributeError, the replay stuck)
        raise ValueError(f"a JSON {type(row).__name__}, not an object")
    row = {key: value for key, value in row.items() if key in _FIELDS}
    # NOTE: every journal line is a gateway call's, admitted under a billing mode; one that does not say it was written
    # before reports carried it, and is billed in the mode in effect when its call started (`UsageReport`).
    row["mode_when_started"] = row.get("billing_mode") is None
    for name in REPORT_TIMES:
        row[name] = datetime.fromisoformat(row[name]) if row.get(name) else None
    for name in REPORT_MONEY:  # NOTE: exact money: text in the journal, a Decimal again on replay
        if row.get(name) is not None:
            try:
                row[name] = Decimal(row[name])
            except ArithmeticError:  # decimal.InvalidOperation: "1.5 USD"
                raise ValueError(f"{name} {row[name]!r} is not an amount") from None
    return UsageReport(**row)


@dataclass(slots=True)
class SegmentRead:
    """What a replay read of a segment: its reports, and its lines this version cannot read, kept for the set-aside."""

    reports: list[UsageReport]
    unreadable: list[bytes]


def set_aside(rejected: list[UsageReport], unreadable: Sequence[bytes]) -> bytes:
    """The lines a replay keeps for an operator (or a newer version's replay): reports the ledger refused, and lines
    this version could not read, as they were written."""
    return b"".join(encode(report) for report in rejected) + b"".join(line + b"\n" for line in unreadable)


def count_set_aside(rejected: list[UsageReport], unreadable: Sequence[bytes]) -> None:
    """Each line a replay sets aside counted (`lines_set_aside`): a gateway's (`UsageJournal.done`) or the worker's
    of a shipped segment (`journal_shipping`, scraped from the worker's own /metrics: `controlplane.worker_metrics`)."""
    lines_set_aside.labels(reason="refused").inc(len(rejected))
    lines_set_aside.labels(reason="unreadable").inc(len(unreadable))


def read_segment(handle) -> SegmentRead:
    """The reports of a segment, and the lines this version cannot read.

    A torn last line (a crash mid-write, never fsync'd: no call was told its row was written) is skipped. NOTE: any other
    unreadable line is kept, for the caller's set-aside (`UsageJournal.done`: `rejected.jsonl`; the bucket's rejected
    prefix): one written by a newer version (a status or mode this one does not know), replayed by an older one during a
    rolling deploy or after a rollback, is a call's usage that a newer replay bills. Before, it was logged and dropped
    with its segment, unbilled."""
    handle.seek(0)
    *lines, last = handle.read().split(b"\n")
    reports, unreadable = [], []
    for number, line in enumerate([*lines, last]):
        if not line.strip():
            continue
        try:
            reports.append(decode(line))
        except (ValueError, TypeError, KeyError) as exc:
            torn = number == len(lines)  # after the segment's last newline
            logger.error("usage journal %s line %d unreadable, %s: %r", handle.name, number + 1,
                         "skipped (torn)" if torn else "kept aside", exc)
            if not torn:
                unreadable.append(line)
    return SegmentRead(reports, unreadable)


class UsageJournal:
    """One process's journal in `directory` (blocking file I/O: call it from a worker thread; `full` and
    `num_bytes` are plain attributes, read on any thread without I/O)."""

    def __init__(self, directory: Path, max_bytes: int | None = None):
        self.directory = Path(directory)
        self.max_bytes = max_bytes  # None: never full
        self._segment = None  # the open segment this process appends to, flock'd
        self._lock = threading.Lock()  # writers of several event loops share one journal
        self._listed_bytes: dict[str, int] = {}  # segment name -> its bytes when this process last listed the folder
        self._num_bytes_listed = 0  # their sum
        self._num_bytes_appended = 0  # what this process appended since
        self.num_bytes = 0  # the folder's segments, as far as this process knows (see the module's docstring)
        self.full = False  # num_bytes reached max_bytes: no new call may be admitted (`usage_writer.usage_recordable`)

    def append(self, reports: list[UsageReport]) -> None:
        """Append reports and fsync: when this returns, they survive a crash of this process or machine."""
        with self._lock:
            self._append(reports)

    def _append(self, reports: list[UsageReport]) -> None:
        if self._segment is None:
            self._segment = self._new_segment()
        data = b"".join(encode(report) for report in reports)
        # NOTE: counted before the write: bytes that may have reached the disk are never left out of the count.
        self._num_bytes_appended += len(data)
        self._count()
        self._segment.write(data)
        self._segment.flush()
        os.fsync(self._segment.fileno())
        if self._segment.tell() >= MAX_SEGMENT_BYTES:
            self._seal()

    def _new_segment(self):
        """A new segment, open and locked, under its final name.

        NOTE: locked before it has a name `segments` lists: created under it, a replayer in another process could
        lock the new empty file between its creation and this process's lock, find nothing in it and delete it; the
        rows then appended went into a deleted file, reported written. Renamed before anything is appended, so the
        hidden file of a process that died creating one is empty (`_clear_left_new`)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        for _attempt in range(3):
            name = f"{socket.gethostname()}-{os.getpid()}-{time.time_ns()}{SEGMENT_SUFFIX}"
            hidden = self.directory / f".{name}{NEW_SUFFIX}"
            segment = open(hidden, "ab")
            try:
                fcntl.flock(segment, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.rename(hidden, self.directory / name)
            except FileNotFoundError:  # cleared as left behind meanwhile (`_clear_left_new`): a new one
                segment.close()
                continue
            except BaseException:
                segment.close()
                raise
            _fsync_directory(self.directory)
            return segment
        raise FileNotFoundError(f"usage journal: could not create a segment in {self.directory}")

    def _clear_left_new(self) -> None:
        """Delete the new segments' hidden files that processes left when they died creating them (never one a
        process holds). Each is empty; one that is not (it cannot be) becomes a segment, replayed as any."""
        for path in self.directory.glob(f".*{SEGMENT_SUFFIX}{NEW_SUFFIX}"):
            with contextlib.suppress(FileNotFoundError), open(path, "rb") as handle:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # its process is creating it now
                status = os.fstat(handle.fileno())
                if time.time() - status.st_mtime < LEFT_NEW_AFTER_S:
                    continue  # perhaps opened, not locked yet, by a process creating it now
                if status.st_size:
                    os.rename(path, path.with_name(path.name[1:].removesuffix(NEW_SUFFIX)))
                else:
                    path.unlink()

    def _count(self) -> None:
        self.num_bytes = self._num_bytes_listed + self._num_bytes_appended
        was_full, self.full = self.full, self.max_bytes is not None and self.num_bytes >= self.max_bytes
        if self.full and not was_full:
            logger.error("usage journal: %d bytes in %s, at its limit of %d: new calls are refused until PostgreSQL "
                         "takes them", self.num_bytes, self.directory, self.max_bytes)
        elif was_full and not self.full:
            logger.warning("usage journal: %d bytes, below its limit of %d again: calls are admitted",
                           self.num_bytes, self.max_bytes)

    def seal(self) -> None:
        """Close the current segment (releasing its lock): the next append starts a new one."""
        with self._lock:
            self._seal()

    def _seal(self) -> None:
        segment, self._segment = self._segment, None
        if segment is not None:
            segment.close()

    def has_open_segment(self) -> bool:
        return self._segment is not None

    def segments(self) -> list[Path]:
        if not self.directory.is_dir():
            return []
        return sorted(path for path in self.directory.glob(f"*{SEGMENT_SUFFIX}") if path.name != REJECTED_NAME)

    def list_segments(self) -> list[Path]:
        """`segments`, and the count taken again from their sizes: every process's, live or dead (a container that
        restarted left its segments), so that `num_bytes` is the folder's. `rejected.jsonl` is not counted: no replay
        empties it, an operator does."""
        with self._lock:
            if self.directory.is_dir():
                self._clear_left_new()
            paths, sizes = [], {}
            for path in self.segments():
                with contextlib.suppress(FileNotFoundError):  # replayed by another process meanwhile
                    sizes[path.name] = path.stat().st_size
                    paths.append(path)
            self._listed_bytes, self._num_bytes_listed, self._num_bytes_appended = sizes, sum(sizes.values()), 0
            self._count()
            return paths

    @contextlib.contextmanager
    def claim(self, path: Path):
        """Yields the open segment if nobody appends to it (else None); delete it with `done`."""
        try:
            handle = open(path, "rb")
        except FileNotFoundError:
            yield None
            return
        with handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield None  # a live process still appends to it
                return
            yield handle

    def done(self, path: Path, rejected: list[UsageReport], unreadable: Sequence[bytes] = ()) -> None:
        """A segment is in the ledger: keep what the ledger refused and the lines this version could not read
        (`read_segment`), delete the segment."""
        if rejected or unreadable:
            with open(self.directory / REJECTED_NAME, "ab") as handle:
                fcntl.flock(handle, fcntl.LOCK_EX)  # NOTE: against `hand_over_set_aside` (another process's)
                handle.write(set_aside(rejected, unreadable))
                handle.flush()
                os.fsync(handle.fileno())
            logger.error("usage journal: %d report(s) refused by the ledger and %d line(s) unreadable kept in %s",
                         len(rejected), len(unreadable), REJECTED_NAME)
            count_set_aside(rejected, unreadable)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        with self._lock:
            # NOTE: bytes another process appended to it after this one listed it were never counted here.
            self._num_bytes_listed -= self._listed_bytes.pop(path.name, 0)
            self._count()

    def hand_over_set_aside(self, upload: Callable[[bytes], None], *, max_part_bytes: int) -> int:
        """Pass what `rejected.jsonl` holds to `upload` in parts of whole lines, at most `max_part_bytes` each (a
        single longer line goes alone), from its end, cutting each part off the file once `upload` returned; returns
        the bytes handed over. If `upload` raises, the file holds exactly the lines no `upload` took, and it raises.

        NOTE: from the end, so a part taken is a truncation, never a rewrite of the rest; the file's lock is held
        for one part at a time (an append waits for it, and comes after: appends are made under the same lock,
        `done`), and only that part is in memory."""
        num_bytes = 0
        while True:
            try:
                handle = open(self.directory / REJECTED_NAME, "r+b")
            except FileNotFoundError:
                return num_bytes
            with handle:
                fcntl.flock(handle, fcntl.LOCK_EX)
                end = os.fstat(handle.fileno()).st_size
                if not end:
                    return num_bytes
                start = _last_part_start(handle, end, max_part_bytes)
                handle.seek(start)
                upload(handle.read(end - start))
                handle.truncate(start)
                handle.flush()
                os.fsync(handle.fileno())
            num_bytes += end - start

    def has_set_aside(self) -> bool:
        with contextlib.suppress(FileNotFoundError):
            return (self.directory / REJECTED_NAME).stat().st_size > 0
        return False

    def backlog(self) -> int:
        """Reports waiting in every segment of the folder (all processes of this machine)."""
        total = 0
        for path in self.segments():
            with contextlib.suppress(FileNotFoundError), open(path, "rb") as handle:
                total += sum(1 for line in handle if line.strip())
        return total


def _last_part_start(handle, end: int, max_part_bytes: int) -> int:
    """Where the last part of a file of `end` bytes starts: at its first whole line among its last `max_part_bytes`,
    or at its last line's start if that line alone is longer."""
    if end <= max_part_bytes:
        return 0
    window_start = end - max_part_bytes - 1
    handle.seek(window_start)
    # NOTE: the bytes before the last one: a newline among them ends a line, the next one starts within the part.
    newline = handle.read(max_part_bytes).find(b"\n")
    if newline >= 0:
        return window_start + newline + 1
    while window_start > 0:  # the last line alone is longer than a part: its start, however far back
        previous = max(0, window_start - max_part_bytes)
        handle.seek(previous)
        newline = handle.read(window_start - previous).rfind(b"\n")
        if newline >= 0:
            return previous + newline + 1
        window_start = previous
    return 0


def _fsync_directory(directory: Path) -> None:
    """A new file's name is durable only once its folder is synced."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
