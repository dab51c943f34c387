"""The agent's S3 clients: one per set of credentials, and a client the cache lets go closes its connections.

The store is a local one that keeps its connections open between requests, as S3 does (moto's server closes each
after its answer); connections are counted from the kernel's table of this process's sockets (psutil), never from
botocore's internals.
"""

from __future__ import annotations

from urllib.parse import urlsplit

import psutil
import pytest

from gpu_agent.protocol import SourceCredentials
from gpu_agent.runtime import weights_access
from gpu_agent.runtime.weights_access import SourceAccess, s3_client
from tests.agent.local_store import LocalServer, QuietHandler

LISTING = (
    b'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
    b"<Name>b</Name><Prefix>m/</Prefix><KeyCount>1</KeyCount><IsTruncated>false</IsTruncated>"
    b"<Contents><Key>m/config.json</Key><Size>2</Size><ETag>&quot;e&quot;</ETag></Contents></ListBucketResult>"
)


class KeepAliveHandler(QuietHandler):
    protocol_version = "HTTP/1.1"  # the connection stays open for the client's next request

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(LISTING)))
        self.end_headers()
        self.wfile.write(LISTING)


@pytest.fixture
def store():
    server = LocalServer(KeepAliveHandler)
    yield server.url
    server.close()


def list_with(client) -> int:
    return client.list_objects_v2(Bucket="b", Prefix="m/")["KeyCount"]


def connections_to(endpoint: str) -> int:
    """This process's open TCP connections to the store (their client side: the store serves in this process too)."""
    port = urlsplit(endpoint).port
    return sum(
        1
        for found in psutil.Process().net_connections(kind="tcp")
        if found.raddr and found.raddr.port == port
    )


def signed_access(name: str) -> SourceAccess:
    """Credentials of their own, so a client of their own (never used to connect here)."""
    return SourceAccess(
        credentials=SourceCredentials(kind="s3", access_key_id=f"AKIA{name}", secret_access_key="x")
    )


@pytest.fixture
def one_client_cached(monkeypatch):
    """The cache holds one client: the next set of credentials drops the one before."""
    monkeypatch.setattr(weights_access, "_MAX_CLIENTS", 1)
    monkeypatch.setattr(weights_access, "_clients", type(weights_access._clients)())


def test_a_client_dropped_from_the_cache_closes_its_connections_at_once(store, one_client_cached):
    before = connections_to(store)
    with s3_client(SourceAccess(), "s3://b/m", default_endpoint_url=store) as client:
        list_with(client)
    assert connections_to(store) == before + 1  # kept in its pool for the next fetch

    with s3_client(signed_access("OTHER"), "s3://b/m", default_endpoint_url=store):
        pass  # the anonymous client is dropped for this one

    assert connections_to(store) == before


def test_a_client_dropped_while_a_download_uses_it_closes_when_that_download_ends(store, one_client_cached):
    before = connections_to(store)
    with s3_client(SourceAccess(), "s3://b/m", default_endpoint_url=store) as client:
        list_with(client)
        with s3_client(signed_access("OTHER"), "s3://b/m", default_endpoint_url=store):
            pass  # dropped from the cache while this download reads with it
        assert connections_to(store) == before + 1
        assert list_with(client) == 1
        assert connections_to(store) == before + 1

    assert connections_to(store) == before


def test_an_expired_client_replaced_by_a_new_one_is_closed(store, one_client_cached):
    before = connections_to(store)
    with s3_client(SourceAccess(), "s3://b/m", default_endpoint_url=store) as first:
        list_with(first)
    # expired, as an assumed role's client is before its keys do
    for identity, cached in weights_access._clients.items():
        weights_access._clients[identity] = weights_access._CachedClient(cached.client, expires_at=0.0)

    with s3_client(SourceAccess(), "s3://b/m", default_endpoint_url=store) as second:
        assert second is not first

    assert connections_to(store) == before


def test_a_dropped_client_whose_close_fails_neither_fails_the_fetch_that_dropped_it_nor_keeps_its_client_open(
    store, one_client_cached, caplog
):
    with s3_client(SourceAccess(), "s3://b/m", default_endpoint_url=store) as failing:
        pass

    def close_fails():
        raise RuntimeError("close failed")

    failing.close = close_fails  # as a botocore close may raise
    before = connections_to(store)

    # the next credentials drop the failing client
    with s3_client(signed_access("OTHER"), "s3://b/m", default_endpoint_url=store) as client:
        assert list_with(client) == 1
    assert connections_to(store) == before + 1
    with s3_client(signed_access("THIRD"), "s3://b/m", default_endpoint_url=store):
        pass  # drops OTHER's client, which nobody uses any more: closed at once

    assert connections_to(store) == before
    assert "closing a dropped S3 client failed" in caplog.text
