"""A model's file names come from its owner: none may make the agent write outside its download folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpu_agent.runtime import weights_sources
from gpu_agent.runtime.weights import WeightsCache
from gpu_agent.runtime.weights_access import UnsafeModelPath, WeightsError
from gpu_agent.runtime.weights_paths import check_model_file_names, model_file_parts

from .test_weights_cache import s3, s3_endpoint  # noqa: F401  (fixtures)
from .test_weights_hf import FakeHub


def put_public(s3, bucket: str, files: dict[str, bytes]) -> None:  # noqa: F811
    s3.create_bucket(Bucket=bucket)
    for key, body in files.items():
        s3.put_object(Bucket=bucket, Key=key, Body=body, ACL="public-read")


def assert_only_inside(root: Path, *outside: Path) -> None:
    for path in outside:
        assert not os.path.lexists(path), f"{path} was written outside the cache"
    assert [name for name in os.listdir(root / ".tmp")] == [], "a half-written download was left behind"
    assert list(root.glob("*.json")) == [], "a refused model must not look complete"


def test_a_key_with_an_absolute_remainder_writes_nothing_outside(s3, s3_endpoint, tmp_path):  # noqa: F811
    target = tmp_path / "outside" / "planted"
    put_public(s3, "paths-abs", {"p/config.json": b"{}", f"p/{target}": b"owned"})  # p//tmp/.../planted
    cache = WeightsCache(tmp_path / "weights", s3_endpoint_url=s3_endpoint)
    with pytest.raises(UnsafeModelPath, match="it is an absolute path"):
        cache.fetch("s3://paths-abs/p")
    assert_only_inside(cache.root, target, target.parent)


@pytest.mark.parametrize(
    ("key", "why"),
    [
        ("p/../x", "a '..' component"),
        ("p/a/../../x", "a '..' component"),
        ("p/a/./b", "a '.' component"),
        ("p/a//b", "an empty path component"),
        ("p/", "it is empty"),  # a "folder" that holds bytes: its name within the model is empty
        ("p/a\tb", "a control character"),
        ("p/a\\..\\b", "a backslash"),
        ("p/nul.json", "it names a device"),
    ],
)
def test_keys_that_do_not_name_a_plain_file_inside_the_model_fail_the_fetch(
    s3,  # noqa: F811
    s3_endpoint,  # noqa: F811
    tmp_path,
    key,
    why,  # noqa: F811
):
    bucket = f"paths-{sum(map(ord, key))}-{len(key)}"
    put_public(s3, bucket, {"p/config.json": b"{}", key: b"x"})
    cache = WeightsCache(tmp_path / "cache" / "weights", s3_endpoint_url=s3_endpoint)
    with pytest.raises(UnsafeModelPath, match=why) as failure:
        cache.fetch(f"s3://{bucket}/p")
    assert "refusing the model file name" in str(failure.value)
    assert_only_inside(cache.root, tmp_path / "cache" / "x", tmp_path / "x")


def test_a_folder_swapped_for_a_symlink_mid_download_is_never_followed(s3, s3_endpoint, tmp_path):  # noqa: F811
    put_public(s3, "paths-link", {"p/a/one": b"1" * 1000, "p/a/two": b"2" * 1000})
    outside = tmp_path / "outside"
    outside.mkdir()
    cache = WeightsCache(tmp_path / "weights", s3_endpoint_url=s3_endpoint)

    def plant_link(_done, _total):  # another process turns the folder "a" into a link to "outside"
        [download] = (cache.root / ".tmp").iterdir()
        if not (download / "a").is_symlink():
            os.rename(download / "a", download / "a-moved")
            os.symlink(outside, download / "a")

    with pytest.raises(UnsafeModelPath, match="a folder on its way is a symbolic link"):
        cache.fetch("s3://paths-link/p", on_progress=plant_link)
    assert list(outside.iterdir()) == []
    assert_only_inside(cache.root)


def test_a_download_folder_replaced_mid_download_is_never_used(s3, s3_endpoint, tmp_path):  # noqa: F811
    put_public(s3, "paths-tmp", {"p/a": b"1" * 1000, "p/b": b"2" * 1000})
    outside = tmp_path / "outside"
    outside.mkdir()
    cache = WeightsCache(tmp_path / "weights", s3_endpoint_url=s3_endpoint)
    moved = tmp_path / "moved"

    def replace_folder(_done, _total):
        [download] = (cache.root / ".tmp").iterdir()
        if not download.is_symlink():
            os.rename(download, moved)
            os.symlink(outside, download)

    with pytest.raises(UnsafeModelPath, match="download folder was replaced"):
        cache.fetch("s3://paths-tmp/p", on_progress=replace_folder)
    assert list(outside.iterdir()) == [], "bytes went through the planted link"
    assert [path for path in cache.root.iterdir() if path.name not in (".tmp", ".locks", ".parts")] == []
    assert sorted(path.name for path in moved.iterdir()) == ["a", "b"]  # the writes stayed in the real folder


def test_a_store_sending_more_than_it_listed_fills_no_disk(s3, s3_endpoint, tmp_path, monkeypatch):  # noqa: F811
    put_public(s3, "paths-grow", {"p/model.safetensors": b"x" * 100})
    cache = WeightsCache(tmp_path / "weights", s3_endpoint_url=s3_endpoint)
    listing = weights_sources.s3_listing

    def shrunk_listing(*args, **kwargs):  # the object grows after it was listed
        return [type(f)(f.name, f.parts, 10, f.location, f.etag) for f in listing(*args, **kwargs)]

    monkeypatch.setattr(weights_sources, "s3_listing", shrunk_listing)
    with pytest.raises(WeightsError, match="larger than the 10 bytes its listing announced"):
        cache.fetch("s3://paths-grow/p")
    assert_only_inside(cache.root)


def test_hub_file_names_are_checked_before_anything_is_downloaded(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    target = tmp_path / "outside" / "planted"
    for bad_name, why in [
        (str(target), "absolute"),
        ("../planted", "'..'"),
        ("a//b", "empty path component"),
    ]:
        hub = FakeHub("inferplane/evil", {"config.json": b"{}", bad_name: b"owned"})
        try:
            cache = WeightsCache(tmp_path / "weights", hf_endpoint=hub.url)
            with pytest.raises(UnsafeModelPath, match=why):
                cache.fetch("hf:inferplane/evil@main")
            assert hub.num_file_downloads == 0
        finally:
            hub.server.shutdown()
    assert_only_inside(tmp_path / "weights", target, tmp_path / "planted")


def test_a_name_that_is_both_a_file_and_a_folder_is_refused(tmp_path):
    hub = FakeHub("inferplane/clash", {"a": b"1", "a/b": b"2"})
    try:
        cache = WeightsCache(tmp_path / "weights", hf_endpoint=hub.url)
        with pytest.raises(UnsafeModelPath, match="both a file and a folder"):
            cache.fetch("hf:inferplane/clash")
    finally:
        hub.server.shutdown()


def test_local_model_directories_must_not_reach_the_agents_own_files(tmp_path):
    data_dir = tmp_path / "agent"
    cache = WeightsCache(data_dir / "weights", private_dirs=(data_dir,))
    (data_dir / "node.json").write_text("{}")
    link = tmp_path / "innocent"
    link.symlink_to(data_dir)
    cached_copy = cache.root / "0123"
    cached_copy.mkdir()
    for location in (str(data_dir), str(link), str(cached_copy), "/proc/self/root", str(tmp_path), "/"):
        with pytest.raises(UnsafeModelPath, match="holds the node's own files"):
            cache.fetch(location)
    for location in (f"{tmp_path}/x/../agent", f"{tmp_path}//agent"):
        with pytest.raises(UnsafeModelPath, match="absolute, normal path"):
            cache.fetch(location)
    (tmp_path / "a-file").write_text("")
    with pytest.raises(WeightsError, match="is not a directory"):
        cache.fetch(str(tmp_path / "a-file"))
    model = tmp_path / "models" / "tiny"
    model.mkdir(parents=True)
    assert cache.fetch(str(model)) == model


def test_ordinary_model_file_names_are_accepted():
    assert model_file_parts("model-00001-of-00002.safetensors") == ("model-00001-of-00002.safetensors",)
    assert model_file_parts("original/params.json") == ("original", "params.json")
    assert model_file_parts(".gitattributes") == (".gitattributes",)


def test_a_listing_nested_deeper_than_eight_levels_is_refused():
    with pytest.raises(UnsafeModelPath, match="nested deeper than 8 levels"):
        check_model_file_names(["d/" * 200 + "model.safetensors"])
    assert check_model_file_names(["a/b/c/d/e/f/g/model.safetensors"])  # eight levels are fine


def test_a_listing_in_more_than_a_thousand_folders_is_refused():
    with pytest.raises(UnsafeModelPath, match="more than 1000 folders"):
        check_model_file_names([f"shard-{index}/config.json" for index in range(1001)])
