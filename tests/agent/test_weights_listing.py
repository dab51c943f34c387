"""An S3 listing is read from a store the tenant may run: its pages, their number and its time are bounded."""

from __future__ import annotations

import time

import boto3
import pytest
from botocore import UNSIGNED
from botocore.config import Config

from gpu_agent.runtime import weights_sources
from gpu_agent.runtime.weights import WeightsCache
from gpu_agent.runtime.weights_access import SourceUnreadable
from gpu_agent.runtime.weights_sources import MAX_LISTING_PAGES, ModelSource
from tests.agent.local_store import LocalServer, QuietHandler

_HEAD = b'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'


def _page(*, padding: int = 0, next_token: str = "") -> bytes:
    truncated = f"<IsTruncated>true</IsTruncated><NextContinuationToken>{next_token}</NextContinuationToken>" if next_token \
        else "<IsTruncated>false</IsTruncated>"
    return (_HEAD + b" " * padding + b"<Name>b</Name><Prefix>m/</Prefix><KeyCount>1</KeyCount>"
            + b"<Contents><Key>m/config.json</Key><Size>2</Size><ETag>&quot;e&quot;</ETag></Contents>"
            + truncated.encode() + b"</ListBucketResult>")


class FakeStore:
    """A store that answers every listing with what `answer(num_requests)` says, then counts requests."""

    def __init__(self, answer) -> None:
        store = self
        self.num_requests = 0

        class Handler(QuietHandler):
            def do_GET(self):
                store.num_requests += 1
                body, drip_s = answer(store.num_requests)
                self.send_response(200)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    if drip_s:
                        for index in range(len(body)):
                            self.wfile.write(body[index:index + 1])
                            self.wfile.flush()
                            time.sleep(drip_s)
                    else:
                        self.wfile.write(body)
                except OSError:  # the agent hung up: what it is meant to do
                    pass

        self.http = LocalServer(Handler)
        self.url = self.http.url

    def close(self) -> None:
        self.http.close()


@pytest.fixture
def store():
    stores = []

    def start(answer):
        stores.append(FakeStore(answer))
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
