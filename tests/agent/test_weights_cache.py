"""Weights cache: S3 through moto's standalone server, LRU eviction, local paths in place."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import boto3
import pytest

from gpu_agent.runtime.engine import free_port
from gpu_agent.runtime.weights import WeightsCache
from gpu_agent.runtime.weights_access import FetchStopped, StoreUnreachable, WeightsError
from gpu_agent.runtime.weights_sources import ModelSource


@pytest.fixture(scope="module")
def s3_endpoint():
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def s3(s3_endpoint, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    return client


def upload_model(s3, bucket: str, prefix: str, num_bytes: int = 3_000_000, *, public: bool = True) -> int:
    """Upload a small model; a public one (ACL public-read) is readable anonymously, as an agent reads by default."""
    s3.create_bucket(Bucket=bucket)
    files = {
        "config.json": b'{"model_type": "llama"}',
        "model.safetensors": os.urandom(num_bytes),
        "sub/tokenizer.json": b"{}",
    }
    for name, body in files.items():
        s3.put_object(
            Bucket=bucket, Key=f"{prefix}/{name}", Body=body, ACL="public-read" if public else "private"
        )
    return sum(len(body) for body in files.values())


def test_s3_model_downloads_once_for_two_concurrent_replicas(s3, s3_endpoint, tmp_path):
    size = upload_model(s3, "models-a", "llama/v1")
    cache = WeightsCache(tmp_path / "weights", s3_endpoint_url=s3_endpoint)
    paths, progress = [], []
    threads = [
        threading.Thread(
            target=lambda: paths.append(
                cache.fetch(
                    "s3://models-a/llama/v1", on_progress=lambda done, total: progress.append((done, total))
                )
            )
        )
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert paths[0] == paths[1]
    assert cache.num_downloads == 1 and cache.num_hits == 1
    assert (paths[0] / "sub" / "tokenizer.json").read_bytes() == b"{}"
    assert (paths[0] / "model.safetensors").stat().st_size == 3_000_000
    assert progress[-1] == (size, size) and progress[0][0] < size
    # The next start is a cache hit.
    assert cache.fetch("s3://models-a/llama/v1") == paths[0]
    assert (cache.num_downloads, cache.num_hits) == (1, 2)
    [status] = cache.statuses()
    assert status.complete and status.size_bytes == size and status.source == "s3://models-a/llama/v1"
    assert list((tmp_path / "weights" / ".tmp").iterdir()) == []


def test_changed_objects_get_a_new_cache_key(s3, s3_endpoint, tmp_path):
    upload_model(s3, "models-b", "m", num_bytes=1000)
    cache = WeightsCache(tmp_path / "weights", s3_endpoint_url=s3_endpoint)
    first = cache.fetch("s3://models-b/m")
    s3.put_object(Bucket="models-b", Key="m/model.safetensors", Body=b"retrained", ACL="public-read")
    second = cache.fetch("s3://models-b/m")
    assert first != second and (second / "model.safetensors").read_bytes() == b"retrained"


def test_two_processes_download_once(s3, s3_endpoint, tmp_path):
    upload_model(s3, "models-c", "m", num_bytes=2_000_000)
    script = textwrap.dedent(
        f"""
        from gpu_agent.runtime.weights import WeightsCache
        cache = WeightsCache({str(tmp_path / "weights")!r}, s3_endpoint_url={s3_endpoint!r})
        cache.fetch("s3://models-c/m")
        print(cache.num_downloads)
        """
    )
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}
    children = [
        subprocess.Popen(
            [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env, cwd=os.getcwd()
        )
        for _ in range(2)
    ]
    counts = sorted(int(child.communicate(timeout=60)[0].strip()) for child in children)
    assert counts == [0, 1]


def test_endpoint_url_comes_from_the_environment(s3, s3_endpoint, tmp_path, monkeypatch):
    upload_model(s3, "models-d", "m", num_bytes=10)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_endpoint)
    assert (WeightsCache(tmp_path / "w").fetch("s3://models-d/m") / "config.json").exists()


def test_least_recently_used_model_is_evicted_but_never_one_in_use(s3, s3_endpoint, tmp_path):
    s3.create_bucket(Bucket="models-e")
    for name in ("one", "two", "three"):
        s3.put_object(
            Bucket="models-e", Key=f"{name}/model.safetensors", Body=os.urandom(10_000), ACL="public-read"
        )
    cache = WeightsCache(tmp_path / "weights", budget_bytes=25_000, s3_endpoint_url=s3_endpoint)
    one = cache.fetch("s3://models-e/one")
    cache.pin(one)  # a running replica uses it
    two = cache.fetch("s3://models-e/two")
    os.utime(tmp_path / "weights" / f"{one.name}.json", (1, 1))  # one is the oldest...
    three = cache.fetch("s3://models-e/three")
    assert one.exists(), "a model in use must never be evicted"
    assert not two.exists() and three.exists()
    cache.unpin(one)  # its replica ended just now: its last use (before, its fetch's, and it went first)
    assert cache.evict() == []  # within budget now
    cache.budget_bytes = 15_000
    assert cache.evict() == [three.name]
    assert {status.source for status in cache.statuses()} == {"s3://models-e/one"}
    # An evicted model downloads again when needed.
    assert cache.fetch("s3://models-e/two").exists() and cache.num_downloads == 4


def test_local_paths_are_used_in_place(tmp_path):
    model = tmp_path / "my-model"
    model.mkdir()
    cache = WeightsCache(tmp_path / "weights")
    assert cache.fetch(str(model)) == model
    # Not copied, but reported (with what its config says) so the control plane learns the model's limits.
    [status] = cache.statuses()
    assert (status.source, status.complete, status.model_info) == (str(model), True, None)  # no config.json here
    assert not any((tmp_path / "weights").glob("*.json"))
    with pytest.raises(WeightsError, match="does not exist"):
        cache.fetch(str(tmp_path / "missing"))


def test_parses_model_sources():
    assert ModelSource.parse("hf:org/name@abc") == ModelSource("hf", "org/name", "abc")
    assert ModelSource.parse("hf:org/name").revision == "main"
    assert ModelSource.parse("s3://bucket/a/b").bucket_and_prefix == ("bucket", "a/b")
    for bad in ("hf:noslash", "relative/path", "s3://"):
        with pytest.raises(ValueError):
            ModelSource.parse(bad)


def test_cached_copy_serves_when_the_store_is_unreachable(s3, tmp_path):
    from moto.server import ThreadedMotoServer

    port = free_port()
    store = ThreadedMotoServer(ip_address="127.0.0.1", port=port)  # shares the moto backend's buckets
    store.start()
    upload_model(s3, "models-f", "m", num_bytes=100)
    cache = WeightsCache(tmp_path / "weights", s3_endpoint_url=f"http://127.0.0.1:{port}")
    path = cache.fetch("s3://models-f/m")
    store.stop()
    assert cache.fetch("s3://models-f/m") == path
    with pytest.raises(StoreUnreachable, match="cannot reach the store of s3://models-f/other"):
        cache.fetch("s3://models-f/other")


def test_each_copy_is_reported_with_the_scope_it_was_read_in(s3, s3_endpoint, tmp_path):
    """The control plane keeps a model's facts per scope: a copy fetched for one tenant (a draft, an adapter)
    names its scope, so it never stands for the catalogue's copy of the same name."""
    from gpu_agent.runtime.weights_access import SourceAccess

    upload_model(s3, "models-scoped", "m", num_bytes=1000)
    cache = WeightsCache(tmp_path / "weights", s3_endpoint_url=s3_endpoint)
    cache.fetch("s3://models-scoped/m")
    cache.fetch("s3://models-scoped/m", access=SourceAccess(scope="org-a"))
    model = tmp_path / "local-model"
    model.mkdir()
    cache.fetch(str(model), access=SourceAccess(scope="org-b"))
    assert sorted((status.source, status.scope) for status in cache.statuses()) == [
        (str(model), "org-b"), ("s3://models-scoped/m", ""), ("s3://models-scoped/m", "org-a"),
    ]


def test_a_model_listed_in_several_formats_is_fetched_as_safetensors_only(s3, s3_endpoint, tmp_path):
    """Before, every file under the prefix was fetched: the PyTorch pickles beside the safetensors (which an engine
    could load, and which can run code when read) and other frameworks' weights, each another copy of the model."""
    size = upload_model(s3, "models-formats", "m", num_bytes=1000)
    for name in ("pytorch_model.bin", "training_args.bin", "consolidated.pth", "tf_model.h5", "flax_model.msgpack",
                 "onnx/model.onnx", "sub/optimizer.pt"):
        s3.put_object(Bucket="models-formats", Key=f"m/{name}", Body=os.urandom(2000), ACL="public-read")
    cache = WeightsCache(tmp_path / "weights", s3_endpoint_url=s3_endpoint)
    path = cache.fetch("s3://models-formats/m")
    fetched = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())
    assert fetched == ["config.json", "model.safetensors", "sub/tokenizer.json"]
    [status] = cache.statuses()
    assert status.size_bytes == size


def test_a_model_whose_weights_are_pickles_only_is_refused_before_any_byte_is_fetched(s3, s3_endpoint, tmp_path):
    """Before, a tenant's bucket holding only `pytorch_model.bin` was fetched, and vLLM (load format "auto") read the
    pickle with torch.load on a machine shared with other tenants' engines."""
    from gpu_agent.runtime.weights_formats import PickledWeights

    s3.create_bucket(Bucket="models-pickled")
    for name in ("config.json", "pytorch_model.bin", "tokenizer.json"):
        s3.put_object(Bucket="models-pickled", Key=f"m/{name}", Body=b"{}", ACL="public-read")
    cache = WeightsCache(tmp_path / "weights", s3_endpoint_url=s3_endpoint)
    with pytest.raises(PickledWeights, match=r"PyTorch pickle files \(pytorch_model.bin\).*safetensors"):
        cache.fetch("s3://models-pickled/m")
    assert cache.num_downloads == 0 and cache.statuses() == []
    assert list((tmp_path / "weights" / ".tmp").iterdir()) == []


def test_a_pickled_module_the_engine_loads_is_refused_and_another_runtimes_copy_is_left_out(s3, s3_endpoint, tmp_path):
    """A sentence-transformers module (`2_Dense/`) in pickles only, left out silently, would change an embedding model's
    vectors: refused. A copy for another runtime (`original/consolidated.00.pth`, beside the safetensors at the root, as
    Llama repositories hold) is never read by the engine: left out, not refused."""
    from gpu_agent.runtime.weights_formats import PickledWeights

    upload_model(s3, "models-modules", "embed", num_bytes=1000)
    s3.put_object(Bucket="models-modules", Key="embed/2_Dense/config.json", Body=b"{}", ACL="public-read")
    s3.put_object(Bucket="models-modules", Key="embed/2_Dense/pytorch_model.bin", Body=b"x", ACL="public-read")
    cache = WeightsCache(tmp_path / "weights", s3_endpoint_url=s3_endpoint)
    with pytest.raises(PickledWeights, match=r"\(2_Dense/pytorch_model.bin\)"):
        cache.fetch("s3://models-modules/embed")
    s3.put_object(Bucket="models-modules", Key="embed/2_Dense/model.safetensors", Body=b"y", ACL="public-read")
    assert not (cache.fetch("s3://models-modules/embed") / "2_Dense" / "pytorch_model.bin").exists()

    upload_model(s3, "models-original", "llama", num_bytes=1000)
    s3.put_object(Bucket="models-original", Key="llama/original/consolidated.00.pth", Body=b"x", ACL="public-read")
    s3.put_object(Bucket="models-original", Key="llama/original/params.json", Body=b"{}", ACL="public-read")
    path = cache.fetch("s3://models-original/llama")
    assert (path / "original" / "params.json").exists() and not (path / "original" / "consolidated.00.pth").exists()


def test_a_heartbeat_reports_at_most_the_protocols_cap_of_copies_the_most_recently_used_first(tmp_path, monkeypatch):
    # The control plane refuses a heartbeat of more weights reports whole (`protocol.MAX_WEIGHTS_REPORTS`).
    from gpu_agent.runtime import weights

    monkeypatch.setattr(weights, "MAX_WEIGHTS_REPORTS", 3)
    cache = WeightsCache(tmp_path / "weights")
    for age_s in range(5):
        key = f"{age_s:032x}"
        manifest = cache.root / f"{key}.json"
        manifest.write_text(json.dumps({"source": f"hf:org/m-{age_s}", "cache_key": key, "size_bytes": 1, "created_at": 0}))
        os.utime(manifest, (1_000_000 - age_s, 1_000_000 - age_s))
    model = tmp_path / "my-model"
    model.mkdir()
    cache.fetch(str(model))
    assert [status.source for status in cache.statuses()] == [str(model), "hf:org/m-0", "hf:org/m-1"]


def test_a_replica_drained_while_it_waited_for_another_pull_of_its_model_evicts_nothing(s3, s3_endpoint, tmp_path):
    # Two replicas of one model on a node: the second waits for the first's download (one lock per copy). Both drained
    # (a cold start given up on), the first stops; the second, let in with nothing downloaded, made room for the whole
    # model (evicting other tenants' cached models) before it noticed it was no longer wanted.
    s3.create_bucket(Bucket="models-w")
    s3.put_object(Bucket="models-w", Key="other/model.safetensors", Body=os.urandom(10_000), ACL="public-read")
    s3.put_object(Bucket="models-w", Key="big/model.safetensors", Body=os.urandom(20_000), ACL="public-read")
    key = WeightsCache(tmp_path / "elsewhere", s3_endpoint_url=s3_endpoint).fetch("s3://models-w/big").name
    cache = WeightsCache(tmp_path / "weights", budget_bytes=25_000, s3_endpoint_url=s3_endpoint)
    other = cache.fetch("s3://models-w/other")  # another tenant's model, cached and idle
    stop, outcome = threading.Event(), []

    def second_pull():
        try:
            outcome.append(cache.fetch("s3://models-w/big", stop=stop))
        except Exception as exc:  # noqa: BLE001 - what the pull ended with is the test's subject
            outcome.append(exc)

    first_pull = cache._index.key_lock(key)  # the first replica's download holds the copy's lock
    waiting = threading.Thread(target=second_pull)
    waiting.start()
    deadline = time.monotonic() + 30
    while cache._index._key_locks.get(key, (None, 0))[1] < 2:  # the second pull listed the model and waits
        assert time.monotonic() < deadline, "the second pull never waited for the first"
        time.sleep(0.01)
    stop.set()  # both drained: the first stops with nothing downloaded
    first_pull.close()
    waiting.join(30)

    assert [type(result) for result in outcome] == [FetchStopped]
    assert other.exists() and (other / "model.safetensors").stat().st_size == 10_000
    assert {status.source for status in cache.statuses()} == {"s3://models-w/other"}
