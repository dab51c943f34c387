"""An S3 listing is read from a store the tenant may run: its pages, their number and its time are bounded."""

from __future__ import annotations

import threading
import time

import boto3
import pytest
from botocore import UNSIGNED
from botocore.config import Config

from gpu_agent.runtime import weights_sources
from gpu_agent.runtime.weights import WeightsCache
from gpu_agent.runtime.weights_access import FetchStopped, SourceAccess, SourceUnreadable, s3_client
from gpu_agent.runtime.weights_sources import MAX_LISTING_PAGES, ModelSource
from tests.agent.local_store import LocalServer, QuietHandler, pull_in_thread

_HEAD = b'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'


def _page(*, padding: int = 0, next_token: str = "") -> bytes:
    truncated = f"<IsTruncated>true</IsTruncated><NextContinuationToken>{next_token}</NextContinuationToken>" if next_token \
        else "<IsTruncated>false</IsTruncated>"
    return (_HEAD + b" " * padding + b"<Name>b</Name><Prefix>m/</Prefix><KeyCount>1</KeyCount>"
            + b"<Contents><Key>m/config.json</Key><Size>2</Size><ETag>&quot;e&quot;</ETag></Contents>"
            + truncated.encode() + b"</ListBucketResult>")


class FakeStore:
    """A store that answers every listing with what `answer(num_requests)` says, then counts requests."""

    def __init__(self, answer, *, drip_headers: bool = False) -> None:
        store = self
        self.num_requests = 0
        self.closing = threading.Event()

        class Handler(QuietHandler):
            def do_GET(self):
                store.num_requests += 1
                body, drip_s = answer(store.num_requests)
                head = (f"HTTP/1.0 200 OK\r\nContent-Type: application/xml\r\nContent-Length: {len(body)}\r\n\r\n"
                        .encode())
                try:
                    if drip_s and drip_headers:
                        self._drip(head, drip_s)
                    else:
                        self.wfile.write(head)
                    if drip_s:
                        self._drip(body, drip_s)
                    else:
                        self.wfile.write(body)
                except OSError:  # the agent hung up: what it is meant to do
                    pass

            def _drip(self, data, drip_s):
                for index in range(len(data)):
                    self.wfile.write(data[index:index + 1])
                    self.wfile.flush()
                    if store.closing.wait(drip_s):
                        return

        self.http = LocalServer(Handler)
        self.url = self.http.url

    def close(self) -> None:
        self.closing.set()
        self.http.close()


@pytest.fixture
def store():
    stores = []

    def start(answer, **options):
        stores.append(FakeStore(answer, **options))
        return stores[-1]

    yield start
    for fake in stores:
        fake.close()


def test_a_listing_page_larger_than_any_real_one_is_refused_while_it_arrives(store, tmp_path):
    fake = store(lambda _: (_page(padding=24 * 1024 * 1024), 0))
    cache = WeightsCache(tmp_path / "weights", s3_endpoint_url=fake.url)
    with pytest.raises(SourceUnreadable, match=r"cannot list s3://b/m: its store answered a listing page over 4 MiB"):
        cache.fetch("s3://b/m")
    assert cache.statuses() == []


def test_a_store_answering_endless_pages_is_refused_after_the_page_cap(store, tmp_path):
    # Before, the pull listed for ever; this store ends after 200 pages so that the old code stops too.
    fake = store(lambda num: (_page(next_token=f"t{num}") if num < 200 else _page(), 0))
    cache = WeightsCache(tmp_path / "weights", s3_endpoint_url=fake.url)
    with pytest.raises(SourceUnreadable, match=f"more than {MAX_LISTING_PAGES} listing pages"):
        cache.fetch("s3://b/m")
    assert fake.num_requests == MAX_LISTING_PAGES + 1


def test_a_listing_slower_than_its_deadline_is_refused(store):
    fake = store(lambda _: (_page(), 0.05))  # ~300 bytes at 20 a second: 15 s
    client = boto3.client("s3", endpoint_url=fake.url, region_name="us-east-1", config=Config(signature_version=UNSIGNED))
    started = time.monotonic()
    with pytest.raises(SourceUnreadable, match="too slowly"):
        weights_sources.s3_listing(client, ModelSource.parse("s3://b/m"), "s3://b/m", timeout_s=1.0)
    assert time.monotonic() - started < 5


def test_a_listing_whose_headers_drip_is_refused_at_its_deadline(store):
    # Before, the deadline was looked at between the body's reads only: headers a byte a second (each read well inside
    # botocore's 60 s read timeout) held the listing for as long as the store went on.
    fake = store(lambda _: (_page(), 1.0), drip_headers=True)
    started = time.monotonic()
    with (s3_client(SourceAccess(), "s3://b/m", default_endpoint_url=fake.url) as client,
          pytest.raises(SourceUnreadable, match="cannot list s3://b/m: listing it took longer than 1 s")):
        weights_sources.s3_listing(client, ModelSource.parse("s3://b/m"), "s3://b/m", timeout_s=1.0)
    assert time.monotonic() - started < 5


def test_a_drain_ends_a_listing_whose_headers_drip_within_seconds(store, tmp_path):
    fake = store(lambda _: (_page(), 1.0), drip_headers=True)
    cache = WeightsCache(tmp_path / "weights", s3_endpoint_url=fake.url)
    stop = threading.Event()
    thread, failures = pull_in_thread(cache, "s3://b/m", stop)
    time.sleep(1.5)  # its listing is out, its answer's headers dripping in
    stop.set()  # the reconciler's drain of the replica that wanted it
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert isinstance(failures[0], FetchStopped)


@pytest.mark.parametrize("entry", [
    b"<Contents><Key>m/config.json</Key><Size>-5</Size></Contents>",
    b"<Contents><Key>m/config.json</Key><Size>abc</Size></Contents>",
    b"<Contents><Key>m/config.json</Key></Contents>",
    b"<Contents><Size>2</Size></Contents>",
], ids=["negative size", "size not a number", "no size", "no key"])
def test_a_listing_entry_without_a_name_or_a_real_size_is_refused_as_the_stores_fault(store, tmp_path, entry):
    """Before, a negative size failed the pull as "Invalid argument" (the node's own I/O trouble, logged with a
    traceback), a size that is not a number showed Python's int() words, and a missing field a bare KeyError."""
    body = (_HEAD + b"<Name>b</Name><Prefix>m/</Prefix><KeyCount>1</KeyCount>" + entry
            + b"<IsTruncated>false</IsTruncated></ListBucketResult>")
    fake = store(lambda _: (body, 0))
    cache = WeightsCache(tmp_path / "weights", s3_endpoint_url=fake.url)
    with pytest.raises(SourceUnreadable) as refused:
        cache.fetch("s3://b/m")
    assert str(refused.value) == ("cannot list s3://b/m: its store answered a listing entry that is not an object with "
                                  "a name and a size of 0 or more bytes")
    assert cache.statuses() == [] and cache.num_downloads == 0
