"""A download a store drips out ends: when its replica is drained, or when it reads too slowly; either
way the disk its listing reserved is released for the next model."""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from xml.sax.saxutils import escape

import pytest
import urllib3.exceptions

from gpu_agent.protocol import ReplicaState
from gpu_agent.runtime import cli, weights_sources, weights_transfer
from gpu_agent.runtime.agent import Agent
from gpu_agent.runtime.config import AgentConfig
from gpu_agent.runtime.reconciler import Reconciler
from gpu_agent.runtime.weights import WeightsCache
from gpu_agent.runtime.weights_access import (
    FetchStopped,
    SourceAccess,
    SourceUnreadable,
    StoreUnreachable,
    hf_client,
)
from gpu_agent.runtime.weights_sources import ModelSource
from gpu_agent.runtime.weights_transfer import TransferSettings
from tests.agent.conftest import fake_engine_factory, make_spec
from tests.agent.local_store import LocalServer, QuietHandler, pull_in_thread

KIB = 1024


class DrippingStore:
    """An S3-compatible store of `objects` (key -> bytes), and a Hub mirror of them (`hf:b/slow` is `b/slow/`); the
    keys under `drip` arrive a byte every `interval_s`: their bodies after a first byte sent at once, or with
    `headers` their answers' headers from the first byte. With `checksums` it lists each object's MD5 as its ETag,
    so the agent checks a whole file with a HEAD, and only those HEADs drip; with `listing` the Hub's answer about a
    dripping repo drips too."""

    def __init__(self, objects: dict[str, bytes], drip: str, *, interval_s: float = 0.05, headers: bool = False,
                 checksums: bool = False, listing: bool = False) -> None:
        store = self
        self.objects, self.drip, self.closing = objects, drip, threading.Event()
        self.interval_s, self.headers, self.checksums = interval_s, headers, checksums

        def etag(body: bytes) -> str:
            return hashlib.md5(body, usedforsecurity=False).hexdigest() if checksums else "x"

        class Handler(QuietHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):
                path, _, query = self.path.partition("?")
                if "list-type=2" in query:
                    prefix = re.search(r"prefix=([^&]*)", query).group(1).replace("%2F", "/")
                    items = "".join(
                        f"<Contents><Key>{escape(key[len('b/'):])}</Key><Size>{len(body)}</Size><ETag>&quot;{etag(body)}&quot;</ETag></Contents>"
                        for key, body in store.objects.items() if key[len("b/"):].startswith(prefix))
                    return self._answer(200, (f'<?xml version="1.0"?><ListBucketResult><Name>b</Name>{items}'
                                              "<IsTruncated>false</IsTruncated></ListBucketResult>").encode())
                if path.startswith("/api/models/"):  # the Hub's repo info, at its one commit
                    repo = path[len("/api/models/"):].partition("/revision/")[0]
                    siblings = [{"rfilename": key[len(repo) + 1:], "size": len(body)}
                                for key, body in store.objects.items() if key.startswith(f"{repo}/")]
                    return self._answer(200, json.dumps({"sha": "0" * 40, "siblings": siblings}).encode(),
                                        drip=listing and f"{repo}/".startswith(store.drip))
                key = re.sub(r"/resolve/[0-9a-f]{40}/", "/", path).lstrip("/")  # a Hub file is its object
                body = store.objects[key]
                start, end = (int(n) for n in re.fullmatch(r"bytes=(\d+)-(\d+)", self.headers["Range"]).groups())
                part = body[start:end + 1]
                self._answer(206, part, {"Content-Range": f"bytes {start}-{end}/{len(body)}"},
                             drip=key.startswith(store.drip) and not store.checksums)

            def do_HEAD(self):
                key = self.path.partition("?")[0].lstrip("/")
                self._answer(200, b"", {"ETag": f'"{etag(store.objects[key])}"'}, drip=key.startswith(store.drip))

            def _answer(self, status, body, headers=None, *, drip=False):
                head = f"HTTP/1.1 {status} OK\r\n" + "".join(
                    f"{name}: {value}\r\n" for name, value in {"Content-Length": str(len(body)), **(headers or {})}.items())
                head = (head + "\r\n").encode()
                try:
                    if drip and store.headers:
                        self._drip(head)
                    else:
                        self.wfile.write(head)
                    if drip:
                        self._drip(body)
                    else:
                        self.wfile.write(body)
                        self.wfile.flush()
                except OSError:
                    pass

            def _drip(self, data):
                for index in range(len(data)):
                    if index and store.closing.wait(store.interval_s):
                        return
                    self.wfile.write(data[index:index + 1])
                    self.wfile.flush()

        self.http = LocalServer(Handler)
        self.url = self.http.url

    def close(self) -> None:
        self.closing.set()
        self.http.close()


@pytest.fixture
def store():
    fake = DrippingStore({"b/slow/model.safetensors": b"s" * 600 * KIB, "b/fast/model.safetensors": b"f" * 600 * KIB},
                         drip="b/slow/")
    yield fake
    fake.close()


def _wait_for_download(cache: WeightsCache) -> None:
    for _ in range(200):
        if any(not status.complete and status.downloaded_bytes for status in cache.statuses()):
            return
        time.sleep(0.02)
    raise AssertionError("the dripping download never started")


def test_a_drained_replicas_dripping_download_ends_and_frees_its_disk_for_the_next_model(store, tmp_path):
    cache = WeightsCache(tmp_path / "weights", budget_bytes=1000 * KIB, s3_endpoint_url=store.url)
    stop = threading.Event()
    thread, failures = pull_in_thread(cache, "s3://b/slow", stop)
    _wait_for_download(cache)
    stop.set()  # the reconciler's drain of the replica that wanted it
    thread.join(timeout=10)
    assert not thread.is_alive() and isinstance(failures[0], FetchStopped)
    assert cache.statuses() == []  # its reservation is gone...
    # ...and what it had written stays to be resumed (a drain or an agent restart mid-download kept nothing before)
    assert any((tmp_path / "weights" / ".tmp").glob("*.partial"))
    path = cache.fetch("s3://b/fast")  # ...so the next model fits the budget (before: ModelTooLarge)
    assert (path / "model.safetensors").read_bytes() == b"f" * 600 * KIB


class NoEngines:
    """A supervisor with nothing running (the replica never gets past its pull)."""

    def replica_ids(self):
        return []

    def get(self, replica_id):
        return None

    def statuses(self):
        return []

    def stage_adapter(self, replica_id, source, *, keep=None):
        return source  # no engine, so none confined (`Supervisor.stage_adapter`)


def test_draining_a_replica_while_its_weights_drip_in_ends_the_download(store, tmp_path):
    cache = WeightsCache(tmp_path / "weights", budget_bytes=1000 * KIB, s3_endpoint_url=store.url)
    reconciler = Reconciler(NoEngines(), cache, wake=threading.Event())
    reconciler.reconcile([make_spec("r-slow", model_source="s3://b/slow")])
    _wait_for_download(cache)
    reconciler.reconcile([])  # the control plane no longer wants it
    for _ in range(250):
        if cache.statuses() == []:
            break
        time.sleep(0.02)
    assert cache.statuses() == []
    # stopped, not failed: a drain is not the replica's failure (no backoff, no failure event, never FAILED)
    for _ in range(250):
        statuses = [status for status in reconciler.replica_statuses() if status.replica_id == "r-slow"]
        if statuses and statuses[0].state == ReplicaState.STOPPED:
            break
        time.sleep(0.02)
    assert [(status.state, status.failure_reason) for status in statuses] == [(ReplicaState.STOPPED, "")]
    assert cache.fetch("s3://b/fast").is_dir()


def test_a_download_slower_than_the_minimum_throughput_fails_and_frees_its_disk(store, tmp_path):
    settings = TransferSettings(attempts=2, first_backoff_s=0.01, min_bytes_per_s=64 * KIB, slow_grace_s=0.5)
    cache = WeightsCache(tmp_path / "weights", budget_bytes=1000 * KIB, s3_endpoint_url=store.url, transfer=settings)
    started = time.monotonic()
    with pytest.raises(StoreUnreachable, match="a read failed 2 times"):
        cache.fetch("s3://b/slow")
    assert time.monotonic() - started < 10
    assert cache.statuses() == []
    assert (cache.fetch("s3://b/fast") / "model.safetensors").stat().st_size == 600 * KIB


_SOURCES = {"s3": ("s3://b/slow", "s3://b/fast"), "hf": ("hf:b/slow", "hf:b/fast")}  # (dripping, fine)
# A tenant's own store (its credential's endpoint_url) answering a byte at a time: its headers a byte a second, or
# its body a byte every 20 s (each read well inside botocore's 60 s read timeout, so no timeout ever fired).
_HOSTILE_STORES = {
    "headers": {"interval_s": 1.0, "headers": True},
    "body": {"interval_s": 20.0, "headers": False},
}


@pytest.fixture(params=list(_HOSTILE_STORES), ids=[f"dripping-{name}" for name in _HOSTILE_STORES])
def hostile_store(request):
    fake = DrippingStore({"b/slow/model.safetensors": b"s" * 600 * KIB, "b/fast/model.safetensors": b"f" * 600 * KIB},
                         drip="b/slow/", **_HOSTILE_STORES[request.param])
    yield fake
    fake.close()


def _download_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name.startswith("weights_")]


@pytest.mark.parametrize("kind", ["s3", "hf"])
def test_a_store_that_drips_its_answer_is_given_up_on_within_its_deadline_with_the_reason(hostile_store, kind, tmp_path):
    # Before, only a chunk's arrival was timed: dripping headers were never timed at all, and a body dripping a byte
    # every 20 s was seen as slow only when its next byte came, so the part's thread (and the disk reserved for the
    # model) was held for as long as the store went on.
    settings = TransferSettings(attempts=2, first_backoff_s=0.01, min_bytes_per_s=1024 * KIB, slow_grace_s=1.0)
    cache = WeightsCache(tmp_path / "weights", budget_bytes=1000 * KIB, s3_endpoint_url=hostile_store.url,
                         hf_endpoint=hostile_store.url, transfer=settings)
    started = time.monotonic()
    thread, failures = pull_in_thread(cache, _SOURCES[kind][0])
    thread.join(timeout=15)  # the deadline: 1 s and 600 KiB at 1 MiB/s, twice, with the watchdog's and retries' time
    assert not thread.is_alive() and time.monotonic() - started < 15
    assert isinstance(failures[0], StoreUnreachable)
    assert re.search(r"a read failed 2 times, the last: the store sent \d+ bytes of model.safetensors in \d+ s: too slow",
                     str(failures[0]))
    assert _download_threads() == []
    assert cache.statuses() == []  # its reservation is released: the next model fits
    assert (cache.fetch(_SOURCES[kind][1]) / "model.safetensors").stat().st_size == 600 * KIB


@pytest.mark.parametrize("kind", ["s3", "hf"])
def test_a_drain_ends_a_download_from_a_dripping_store_within_seconds(hostile_store, kind, tmp_path):
    # Before, the stop was looked at between socket reads only: dripping headers are read inside botocore, and a body
    # dripping a byte every 20 s was looked at every 20 s.
    cache = WeightsCache(tmp_path / "weights", budget_bytes=1000 * KIB, s3_endpoint_url=hostile_store.url,
                         hf_endpoint=hostile_store.url)
    stop = threading.Event()
    thread, failures = pull_in_thread(cache, _SOURCES[kind][0], stop)
    for _ in range(200):  # its request is out: the store has started to drip
        if cache.statuses() and _download_threads():
            break
        time.sleep(0.02)
    time.sleep(1.5)
    stop.set()  # the reconciler's drain of the replica that wanted it
    stopped_at = time.monotonic()
    thread.join(timeout=10)
    assert not thread.is_alive() and time.monotonic() - stopped_at < 3
    assert isinstance(failures[0], FetchStopped)
    assert _download_threads() == []
    assert cache.statuses() == []
    assert (cache.fetch(_SOURCES[kind][1]) / "model.safetensors").stat().st_size == 600 * KIB


@pytest.fixture
def checksum_dripping_store():
    fake = DrippingStore({"b/slow/model.safetensors": b"s" * 600 * KIB, "b/fast/model.safetensors": b"f" * 600 * KIB},
                         drip="b/slow/", interval_s=1.0, headers=True, checksums=True)
    yield fake
    fake.close()


def test_a_store_that_drips_a_files_checksum_is_given_up_on_or_drained_within_seconds(checksum_dripping_store,
                                                                                       tmp_path):
    # Before, the HEAD that reads a whole file's checksum was bounded only per socket read: a store answering it a
    # byte a second held the download, whole on disk and still reserved, past its replica's drain.
    settings = TransferSettings(slow_grace_s=1.0)
    cache = WeightsCache(tmp_path / "weights", budget_bytes=1000 * KIB, s3_endpoint_url=checksum_dripping_store.url,
                         transfer=settings)
    started = time.monotonic()
    thread, failures = pull_in_thread(cache, "s3://b/slow")
    thread.join(timeout=10)
    assert not thread.is_alive() and time.monotonic() - started < 10
    assert isinstance(failures[0], StoreUnreachable) and "answered no checksum within 3 s" in str(failures[0])
    assert cache.statuses() == []

    cache = WeightsCache(tmp_path / "weights-2", budget_bytes=1000 * KIB, s3_endpoint_url=checksum_dripping_store.url)
    stop = threading.Event()
    thread, failures = pull_in_thread(cache, "s3://b/slow", stop)
    for _ in range(250):  # every byte is in: the agent is asking for the checksum
        if any(status.downloaded_bytes == 600 * KIB for status in cache.statuses()):
            break
        time.sleep(0.02)
    time.sleep(1.5)
    stop.set()
    stopped_at = time.monotonic()
    thread.join(timeout=10)
    assert not thread.is_alive() and time.monotonic() - stopped_at < 3
    assert isinstance(failures[0], FetchStopped)
    assert cache.statuses() == []
    assert (cache.fetch("s3://b/fast") / "model.safetensors").stat().st_size == 600 * KIB


@pytest.fixture
def hub_dripping_its_listing():
    fake = DrippingStore({"b/slow/model.safetensors": b"s" * KIB, "b/fast/model.safetensors": b"f" * KIB},
                         drip="b/slow/", interval_s=1.0, headers=True, listing=True)
    yield fake
    fake.close()


def test_a_hub_that_drips_its_answer_about_a_repo_is_given_up_on_or_drained_within_seconds(hub_dripping_its_listing,
                                                                                           tmp_path):
    # Before, the Hub's answer about a repo was bounded only per socket read (60 s), so its headers a byte a second
    # held the pull for as long as the Hub went on, past its replica's drain.
    hub = hub_dripping_its_listing.url
    with hf_client(SourceAccess(), "hf:b/slow") as client:
        started = time.monotonic()
        with pytest.raises(SourceUnreadable, match="cannot list hf:b/slow: listing it took longer than 1 s"):
            weights_sources.hf_listing(client, ModelSource.parse("hf:b/slow"), "hf:b/slow", hub, timeout_s=1.0)
        assert time.monotonic() - started < 5

    cache = WeightsCache(tmp_path / "weights", hf_endpoint=hub)
    stop = threading.Event()
    thread, failures = pull_in_thread(cache, "hf:b/slow", stop)
    time.sleep(1.5)  # its answer's headers dripping in
    stop.set()
    stopped_at = time.monotonic()
    thread.join(timeout=10)
    assert not thread.is_alive() and time.monotonic() - stopped_at < 3
    assert isinstance(failures[0], FetchStopped)
    assert cache.fetch("hf:b/fast").is_dir()


@pytest.mark.parametrize("error", [urllib3.exceptions.ProtocolError("Connection broken: reset by peer"),
                                   urllib3.exceptions.ReadTimeoutError(None, "/b/k", "Read timed out.")],
                         ids=["reset", "read-timeout"])
def test_a_connection_reset_or_read_timeout_mid_part_stays_a_failure_the_transfer_retries(error):
    # Reading urllib3's stream as bytes arrive skipped botocore's translation of its errors: a reset or a read
    # timeout was no longer transient, so one hiccup among a big model's parts failed the whole download.
    class Raw:
        calls = 0

        def read1(self, size):
            Raw.calls += 1
            if Raw.calls == 1:
                return b"first bytes"
            raise error

    class Body:
        _raw_stream = Raw()

    chunks = weights_sources._arriving_chunks(Body())
    assert next(chunks) == b"first bytes"
    with pytest.raises(weights_transfer._TRANSIENT):
        next(chunks)


def _stopped_partial(root, key: str, num_bytes: int, age_s: float) -> None:
    """What a download stopped mid-way leaves to be resumed: its folder of written bytes and its journal."""
    folder = root / ".tmp" / f"{key}.partial"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"p" * num_bytes)
    (root / ".parts").mkdir(exist_ok=True)
    (root / ".parts" / f"{key}.json").write_text("{}")
    then = time.time() - age_s
    os.utime(folder, (then, then))


def test_downloads_stopped_mid_way_count_against_the_budget_and_go_first_when_room_is_needed(store, tmp_path):
    # Kept for a resume, they counted against nothing: stopping download after download of models whose content then
    # changed (a new cache key each time) left each nearly whole on the disk, until it was full and every other
    # tenant's models were evicted and their downloads refused.
    root = tmp_path / "weights"
    cache = WeightsCache(root, budget_bytes=1000 * KIB, s3_endpoint_url=store.url)
    _stopped_partial(root, "older", 300 * KIB, age_s=60)
    _stopped_partial(root, "newer", 300 * KIB, age_s=1)

    path = cache.fetch("s3://b/fast")

    assert (path / "model.safetensors").stat().st_size == 600 * KIB
    assert not (root / ".tmp" / "older.partial").exists() and (root / ".tmp" / "newer.partial").exists()
    on_disk = sum(p.lstat().st_blocks * 512 for p in root.rglob("*") if p.is_file())
    assert on_disk <= 1000 * KIB + 64 * KIB  # within the budget (a few blocks of manifests and journals)


def test_an_operator_sets_the_slowest_rate_a_store_may_send_a_part_at(monkeypatch, tmp_path):
    monkeypatch.setenv("INFERPLANE_AGENT_MIN_DOWNLOAD_KIB_PER_S", "256")
    args = cli._parser().parse_args(["run", "--control-plane", "http://127.0.0.1:9", "--join-token", "token"])
    assert args.min_download_kib_per_s == 256
    with pytest.raises(SystemExit):  # no rate at all would let a store drip for ever
        cli._parser().parse_args(["run", "--control-plane", "http://127.0.0.1:9", "--min-download-kib-per-s", "0"])
    config = AgentConfig("http://127.0.0.1:9", "token", tmp_path / "agent", force_cpu=True,
                         min_download_bytes_per_s=args.min_download_kib_per_s * KIB)
    agent = Agent(config, command_factory=fake_engine_factory())
    try:
        assert agent.weights.transfer.min_bytes_per_s == 256 * KIB
    finally:
        agent.shutdown()


def test_a_retired_nodes_removal_of_its_weights_takes_the_downloads_stopped_mid_way_too(store, tmp_path):
    """Before, `remove_unpinned` removed complete models only: a tenant's model downloaded nearly whole stayed on a
    retired node's disk (`.tmp/<key>.partial` and its journal)."""
    root = tmp_path / "weights"
    cache = WeightsCache(root, budget_bytes=1000 * KIB, s3_endpoint_url=store.url)
    cache.fetch("s3://b/fast")
    _stopped_partial(root, "tenant", 300 * KIB, age_s=1)

    removed = cache.remove_unpinned()

    assert "tenant" in removed and len(removed) == 2
    assert not list((root / ".tmp").iterdir()) and not list((root / ".parts").iterdir())
    assert not [path for path in root.rglob("*") if path.is_file() and path.name == "model.safetensors"]


def test_a_private_download_stopped_mid_way_goes_once_no_replica_wants_its_copy(tmp_path):
    """Before, a deleted endpoint's private model downloaded nearly whole stayed on the node for a day
    (`STALE_PARTIAL_S`), unless the room was needed. A catalogue's partial stays to be resumed."""
    store = DrippingStore({"b/m/a.safetensors": b"a" * 10 * KIB, "b/m/z/model.safetensors": b"z" * 600 * KIB},
                          drip="b/m/z/")
    root = tmp_path / "weights"
    cache = WeightsCache(root, budget_bytes=2000 * KIB, s3_endpoint_url=store.url, private_grace_s=0.0)
    try:
        for scope in ("org-1", ""):
            stop = threading.Event()
            thread, failures = pull_in_thread(cache, "s3://b/m", stop, access=SourceAccess(scope=scope))
            for _ in range(250):  # its first file written, in its journal, to be resumed
                if len(list((root / ".parts").glob("*.json"))) == 1 + (scope == ""):
                    break
                time.sleep(0.02)
            stop.set()
            thread.join(timeout=10)
            assert isinstance(failures[0], FetchStopped)
    finally:
        store.close()
    assert len(list((root / ".tmp").glob("*.partial"))) == 2

    assert cache.release_unwanted({("s3://b/m", "org-1")}) == []  # still wanted: kept to be resumed
    [removed] = cache.release_unwanted(set())

    assert not (root / ".tmp" / f"{removed}.partial").exists() and not (root / ".parts" / f"{removed}.json").exists()
    assert len(list((root / ".tmp").glob("*.partial"))) == 1  # the catalogue's
