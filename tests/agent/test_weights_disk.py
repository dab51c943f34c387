"""A model's size is known before its download: what can never fit is refused, room is made first."""

from __future__ import annotations

import os
import shutil
from collections import namedtuple

import pytest

from gpu_agent.runtime.weights import WeightsCache
from gpu_agent.runtime.weights_access import ModelTooLarge, WeightsError

from .test_weights_cache import s3, s3_endpoint, upload_model  # noqa: F401  (fixtures)
from .test_weights_hf import FakeHub

DiskUsage = namedtuple("DiskUsage", "total used free")


def put_models(s3, bucket: str, names: tuple[str, ...], num_bytes: int = 10_000) -> None:  # noqa: F811
    s3.create_bucket(Bucket=bucket)
    for name in names:
        s3.put_object(
            Bucket=bucket, Key=f"{name}/model.safetensors", Body=os.urandom(num_bytes), ACL="public-read"
        )


def test_a_model_larger_than_the_budget_is_refused_before_any_byte_is_fetched(s3, s3_endpoint, tmp_path):  # noqa: F811
    upload_model(s3, "disk-huge", "m", num_bytes=3_000_000)
    cache = WeightsCache(tmp_path / "weights", budget_bytes=2_500_000, s3_endpoint_url=s3_endpoint)
    progress = []
    with pytest.raises(ModelTooLarge) as failure:
        cache.fetch("s3://disk-huge/m", on_progress=lambda done, total: progress.append(done))
    assert str(failure.value) == "model is 3 MB; this node's weights budget is 2.5 MB"
    assert progress == [] and cache.statuses() == [] and os.listdir(cache.root / ".tmp") == []


def test_least_recently_used_unpinned_models_make_room_before_the_download(s3, s3_endpoint, tmp_path):  # noqa: F811
    put_models(s3, "disk-lru", ("one", "two", "three"))
    cache = WeightsCache(tmp_path / "weights", budget_bytes=25_000, s3_endpoint_url=s3_endpoint)
    one = cache.fetch("s3://disk-lru/one")
    two = cache.fetch("s3://disk-lru/two")
    os.utime(cache.root / f"{two.name}.json", (1, 1))  # two is the least recently used...
    cache.pin(two)  # ...but a replica runs it: one goes instead
    cached_while_downloading = []

    def watch(_done, _total):
        cached_while_downloading.append(sorted(path.name for path in (one, two) if path.exists()))

    three = cache.fetch("s3://disk-lru/three", on_progress=watch)
    assert cached_while_downloading and set(map(tuple, cached_while_downloading)) == {(two.name,)}
    assert two.exists() and three.exists() and not one.exists()


def test_models_in_use_leaving_no_room_fail_the_fetch_with_the_reason(s3, s3_endpoint, tmp_path):  # noqa: F811
    put_models(s3, "disk-full", ("one", "two", "three"))
    cache = WeightsCache(tmp_path / "weights", budget_bytes=25_000, s3_endpoint_url=s3_endpoint)
    for name in ("one", "two"):
        cache.pin(cache.fetch(f"s3://disk-full/{name}"))
    with pytest.raises(ModelTooLarge) as failure:
        cache.fetch("s3://disk-full/three")
    assert str(failure.value) == (
        "model is 10 kB; this node's weights budget is 25 kB and the models in use leave no room for it"
    )
    assert cache.num_downloads == 2


def test_the_free_space_of_the_weights_disk_is_checked_too(s3, s3_endpoint, tmp_path, monkeypatch):  # noqa: F811
    put_models(s3, "disk-free", ("old", "new"))
    cache = WeightsCache(
        tmp_path / "weights", s3_endpoint_url=s3_endpoint
    )  # no budget: the disk is the limit
    old = cache.fetch("s3://disk-free/old")
    monkeypatch.setattr(
        shutil, "disk_usage", lambda _path: DiskUsage(total=10**12, used=10**12 - 500, free=500)
    )
    cache.pin(old)
    with pytest.raises(ModelTooLarge, match="model is 10 kB; the weights disk has 500 bytes free"):
        cache.fetch("s3://disk-free/new")
    cache.unpin(old)
    assert (
        cache.fetch("s3://disk-free/new").exists() and not old.exists()
    )  # evicting the unused one made room
    monkeypatch.setattr(shutil, "disk_usage", lambda _path: DiskUsage(total=800, used=300, free=500))
    with pytest.raises(ModelTooLarge, match="model is 10 kB; this node's weights disk is 800 bytes"):
        cache.fetch("s3://disk-free/old")


def test_a_hub_repo_is_sized_before_download_and_never_grows_past_its_listing(tmp_path):
    hub = FakeHub(
        "org/big", {"config.json": b"{}", "model.safetensors": b"x" * 50_000}, listed_sizes={"config.json": 1}
    )
    try:
        small = WeightsCache(tmp_path / "small", budget_bytes=40_000, hf_endpoint=hub.url)
        with pytest.raises(ModelTooLarge, match="model is 54.1 kB; this node's weights budget is 40 kB"):
            small.fetch("hf:org/big")
        assert hub.num_file_downloads == 0
        cache = WeightsCache(tmp_path / "weights", hf_endpoint=hub.url)
        with pytest.raises(
            WeightsError, match="config.json is larger than the 1 bytes its listing announced"
        ):
            cache.fetch("hf:org/big")
        assert cache.statuses() == [] and os.listdir(cache.root / ".tmp") == []
    finally:
        hub.server.shutdown()


def test_ten_thousand_empty_files_are_charged_against_the_budget_before_any_is_made(tmp_path):
    """Each file and folder takes a block and an inode whatever its size: a listing of 10,000 empty files
    (before: 0 bytes, so any budget let them in) is charged at least 4 KiB each."""
    from .test_weights_stop import DrippingStore

    store = DrippingStore({f"b/m/{index}.json": b"" for index in range(10_000)}, drip="none")
    try:
        cache = WeightsCache(tmp_path / "weights", budget_bytes=30_000_000, s3_endpoint_url=store.url)
        with pytest.raises(ModelTooLarge, match="model is 41 MB; this node's weights budget is 30 MB"):
            cache.fetch("s3://b/m")
        assert os.listdir(cache.root / ".tmp") == []
    finally:
        store.close()


def test_the_weights_disk_keeps_the_free_share_it_is_told_to(s3, s3_endpoint, tmp_path, monkeypatch):  # noqa: F811
    """In the DaemonSet the weights cache (a hostPath) is on the node's disk, the kubelet's, where the agent pod's /tmp
    is too. Without a budget it filled that disk to its last byte; past the kubelet's hard threshold (15 % free on a
    node with one disk) the kubelet evicts the pod with the most ephemeral storage over its request, the agent, and
    every engine of the node with it; and the weights stay on the host, so the next agent pod is evicted too, and the
    next. The cache now keeps `disk_reserve_fraction` of the disk free (the DaemonSet's 20 %)."""
    put_models(s3, "disk-reserve", ("old", "new"))
    cache = WeightsCache(tmp_path / "weights", s3_endpoint_url=s3_endpoint, disk_reserve_fraction=0.2)
    old = cache.fetch("s3://disk-reserve/old")
    # 21 % free: 10 kB more would leave less than 20 %
    monkeypatch.setattr(shutil, "disk_usage", lambda _path: DiskUsage(total=100_000, used=79_000, free=21_000))
    cache.pin(old)
    with pytest.raises(ModelTooLarge, match="keeps 20 kB free"):
        cache.fetch("s3://disk-reserve/new")
    cache.unpin(old)
    assert cache.fetch("s3://disk-reserve/new").exists() and not old.exists()  # evicting the unused one made room
