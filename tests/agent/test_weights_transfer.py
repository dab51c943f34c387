"""Downloads that survive the store and the agent: parallel ranged reads, resume, checksums, one client.

S3 through moto's standalone server (the same fixtures as test_weights_cache), the Hub through the
local mirror of test_weights_hf. Faults are injected with botocore's own event hooks on the
process's shared client, so every read still goes over HTTP to the real server.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import botocore.response
import pytest

from gpu_agent.protocol import SourceCredentials
from gpu_agent.runtime import weights_access
from gpu_agent.runtime.weights import WeightsCache
from gpu_agent.runtime.weights_access import SourceAccess, StoreUnreachable, WeightsError
from gpu_agent.runtime.weights_transfer import TransferSettings

from .test_weights_cache import s3, s3_endpoint  # noqa: F401  (fixtures)
from .test_weights_hf import FakeHub

MIB = 1024 * 1024
SMALL_PARTS = TransferSettings(part_bytes=MIB, max_concurrency=4, attempts=2, first_backoff_s=0.01)


def upload_multipart(s3, bucket: str, key: str, body: bytes, part_size: int = 5 * MIB) -> str:  # noqa: F811
    """An object uploaded in parts, as large model files are: its ETag is `<md5 of md5s>-<parts>`."""
    upload = s3.create_multipart_upload(Bucket=bucket, Key=key, ACL="public-read")
    parts = []
    for number, offset in enumerate(range(0, len(body), part_size), start=1):
        answer = s3.upload_part(Bucket=bucket, Key=key, UploadId=upload["UploadId"], PartNumber=number,
                                Body=body[offset : offset + part_size])
        parts.append({"PartNumber": number, "ETag": answer["ETag"]})
    s3.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload["UploadId"],
                                 MultipartUpload={"Parts": parts})
    return s3.head_object(Bucket=bucket, Key=key)["ETag"].strip('"')


def shared_client(endpoint: str):
    """The client every anonymous fetch from `endpoint` in this process uses."""
    with weights_access.s3_client(SourceAccess(), "s3://any", default_endpoint_url=endpoint) as client:
        return client  # NOTE: still cached after the block: the fetches that follow are lent the same one


class GetCounter:
    """Counts the ranged GETs the shared client sends, and can make them fail or corrupt their bytes."""

    def __init__(self, client) -> None:
        self.client, self.ranges, self.fail_after, self.corrupt = client, [], None, False
        client.meta.events.register("before-call.s3.GetObject", self._before)
        client.meta.events.register("after-call.s3.GetObject", self._after)

    def _before(self, params, **_):
        if self.fail_after is not None and len(self.ranges) >= self.fail_after:
            raise StoreUnreachable("cannot reach the store (injected)")
        self.ranges.append(params.get("headers", {}).get("Range"))

    def _after(self, parsed, **_):
        if self.corrupt and "Body" in parsed:
            data = bytearray(parsed["Body"].read())
            data[0] ^= 0xFF
            parsed["Body"] = botocore.response.StreamingBody(io.BytesIO(bytes(data)), len(data))

    def close(self) -> None:
        self.client.meta.events.unregister("before-call.s3.GetObject", self._before)
        self.client.meta.events.unregister("after-call.s3.GetObject", self._after)


@pytest.fixture
def gets(s3_endpoint):  # noqa: F811
    counter = GetCounter(shared_client(s3_endpoint))
    yield counter
    counter.close()


def test_a_multipart_object_downloads_in_parallel_ranges_and_its_etag_is_verified(s3, s3_endpoint, gets, tmp_path):  # noqa: F811
    s3.create_bucket(Bucket="xfer-multi")
    body = os.urandom(11 * MIB)
    etag = upload_multipart(s3, "xfer-multi", "m/model.safetensors", body)
    s3.put_object(Bucket="xfer-multi", Key="m/config.json", Body=b"{}", ACL="public-read")
    assert etag.endswith("-3")
    cache = WeightsCache(tmp_path / "weights", s3_endpoint_url=s3_endpoint, transfer=SMALL_PARTS)
    path = cache.fetch("s3://xfer-multi/m")
    assert (path / "model.safetensors").read_bytes() == body
    assert (path / "config.json").read_bytes() == b"{}"
    # 11 ranged reads of 1 MiB for the model, one for the config; nothing left half-way.
    assert sorted(r for r in gets.ranges if r != "bytes=0-1") == sorted(
        f"bytes={start}-{min(start + MIB, len(body)) - 1}" for start in range(0, len(body), MIB)
    )
    assert list((cache.root / ".tmp").iterdir()) == [] and list((cache.root / ".parts").iterdir()) == []


def test_bytes_that_do_not_match_the_etag_fail_the_fetch_and_are_discarded(s3, s3_endpoint, gets, tmp_path):  # noqa: F811
    s3.create_bucket(Bucket="xfer-corrupt")
    s3.put_object(Bucket="xfer-corrupt", Key="m/model.safetensors", Body=os.urandom(3000), ACL="public-read")
    gets.corrupt = True  # a flipped bit on the wire that TCP did not catch, or a lying cache in between
    cache = WeightsCache(tmp_path / "weights", s3_endpoint_url=s3_endpoint)
    with pytest.raises(WeightsError, match="model.safetensors: the downloaded bytes do not match the store's checksum"):
        cache.fetch("s3://xfer-corrupt/m")
    assert list((cache.root / ".tmp").iterdir()) == [] and cache.statuses() == []


def test_an_object_replaced_mid_download_is_never_mixed_with_its_old_bytes(s3, s3_endpoint, tmp_path):  # noqa: F811
    s3.create_bucket(Bucket="xfer-swap")
    s3.put_object(Bucket="xfer-swap", Key="m/model.safetensors", Body=b"a" * (3 * MIB), ACL="public-read")
    cache = WeightsCache(tmp_path / "weights", s3_endpoint_url=s3_endpoint,
                         transfer=TransferSettings(part_bytes=MIB, max_concurrency=1))
    replaced = []

    def replace_once(_done, _total):
        if not replaced:
            replaced.append(True)
            s3.put_object(Bucket="xfer-swap", Key="m/model.safetensors", Body=b"b" * (3 * MIB), ACL="public-read")

    with pytest.raises(WeightsError, match="changed while it was downloading"):
        cache.fetch("s3://xfer-swap/m", on_progress=replace_once)
    assert list((cache.root / ".tmp").iterdir()) == []
    assert (cache.fetch("s3://xfer-swap/m") / "model.safetensors").read_bytes() == b"b" * (3 * MIB)


def test_a_download_cut_by_the_store_resumes_from_the_parts_already_on_disk(s3, s3_endpoint, gets, tmp_path):  # noqa: F811
    s3.create_bucket(Bucket="xfer-resume")
    body = os.urandom(8 * MIB)
    s3.put_object(Bucket="xfer-resume", Key="m/model.safetensors", Body=body, ACL="public-read")
    settings = TransferSettings(part_bytes=MIB, max_concurrency=1, attempts=2, first_backoff_s=0.01)
    cache = WeightsCache(tmp_path / "weights", s3_endpoint_url=s3_endpoint, transfer=settings)
    gets.fail_after = 3  # three parts arrive, then the store goes away (and stays away through the retries)
    with pytest.raises(StoreUnreachable):
        cache.fetch("s3://xfer-resume/m")
    [journal] = (cache.root / ".parts").iterdir()
    assert json.loads(journal.read_text())["done"] == {"model.safetensors": [0, 1, 2]}
    gets.fail_after, gets.ranges = None, []
    progress = []
    path = cache.fetch("s3://xfer-resume/m", on_progress=lambda done, total: progress.append(done))
    assert (path / "model.safetensors").read_bytes() == body
    assert gets.ranges == [f"bytes={start}-{start + MIB - 1}" for start in range(3 * MIB, 8 * MIB, MIB)]
    assert 3 * MIB < progress[0] <= 4 * MIB  # the first new bytes land on top of the three resumed parts
    assert list((cache.root / ".parts").iterdir()) == [] and list((cache.root / ".tmp").iterdir()) == []


def test_a_killed_agents_download_is_resumed_by_the_next_agent(s3, s3_endpoint, gets, tmp_path):  # noqa: F811
    s3.create_bucket(Bucket="xfer-killed")
    body = os.urandom(6 * MIB)
    s3.put_object(Bucket="xfer-killed", Key="m/model.safetensors", Body=body, ACL="public-read")
    root = tmp_path / "weights"
    # An agent that downloads one part at a time and stalls after the second, until it is killed.
    script = textwrap.dedent(
        f"""
        import time
        from gpu_agent.runtime.weights import WeightsCache
        from gpu_agent.runtime.weights_transfer import TransferSettings
        cache = WeightsCache({str(root)!r}, s3_endpoint_url={s3_endpoint!r},
                             transfer=TransferSettings(part_bytes={MIB}, max_concurrency=1))
        def stall(done, total):
            if done >= 2 * {MIB} + 1:
                time.sleep(3600)
        cache.fetch("s3://xfer-killed/m", on_progress=stall)
        """
    )
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}
    agent = subprocess.Popen([sys.executable, "-c", script], env=env, cwd=os.getcwd())
    journal = root / ".parts"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            files = list(journal.glob("*.json")) if journal.exists() else []
            if files and json.loads(files[0].read_text() or "{}").get("done", {}).get("model.safetensors") == [0, 1]:
                break
            assert agent.poll() is None, "the agent exited before it was killed"
            time.sleep(0.1)
        else:
            pytest.fail("the agent never wrote two parts")
    finally:
        agent.send_signal(signal.SIGKILL)
        agent.wait(timeout=30)
    cache = WeightsCache(root, s3_endpoint_url=s3_endpoint, transfer=TransferSettings(part_bytes=MIB))
    path = cache.fetch("s3://xfer-killed/m")
    assert (path / "model.safetensors").read_bytes() == body
    assert sorted(gets.ranges) == sorted(f"bytes={start}-{start + MIB - 1}" for start in range(2 * MIB, 6 * MIB, MIB))
    assert cache.num_downloads == 1


def test_one_client_per_process_and_credentials_serves_every_fetch(s3_endpoint):  # noqa: F811
    anonymous = shared_client(s3_endpoint)
    assert shared_client(s3_endpoint) is anonymous
    creds = SourceCredentials(kind="s3", access_key_id="AKIAEXAMPLE", secret_access_key="s3cr3t-value")
    with weights_access.s3_client(SourceAccess(credentials=creds), "s3://b", default_endpoint_url=s3_endpoint) as signed:
        assert signed is not anonymous
    with weights_access.s3_client(SourceAccess(credentials=creds), "s3://c", default_endpoint_url=s3_endpoint) as again:
        assert again is signed
    assert "s3cr3t-value" not in repr(list(weights_access._clients))  # keyed by a digest, never the secret


def test_hub_files_download_in_ranges_and_are_checked_against_their_lfs_and_git_digests(tiny_model_dir, tmp_path):
    files = {p.name: p.read_bytes() for p in tiny_model_dir.iterdir() if p.is_file()}
    hub = FakeHub("inferplane/tiny", files, ranges=True, digests=True)
    try:
        cache = WeightsCache(tmp_path / "weights", hf_endpoint=hub.url,
                             transfer=TransferSettings(part_bytes=64 * 1024, max_concurrency=4))
        path = cache.fetch("hf:inferplane/tiny@main")
        for name, body in files.items():
            assert (path / name).read_bytes() == body
        largest = max(files, key=lambda name: len(files[name]))
        assert len([r for r in hub.ranged_requests if r.startswith(f"{largest}:")]) == -(-len(files[largest]) // (64 * 1024))
        # A mirror serving other bytes than the repo lists (same sizes) is caught by the digests.
        hub.served = {name: bytes(len(body)) for name, body in files.items()}
        other = WeightsCache(tmp_path / "other", hf_endpoint=hub.url)
        with pytest.raises(WeightsError, match="do not match the store's checksum"):
            other.fetch("hf:inferplane/tiny@main")
        assert os.listdir(other.root / ".tmp") == []
    finally:
        hub.server.shutdown()
