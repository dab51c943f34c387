"""A node pulls model after model all day (scale to zero, new versions): the cache keeps nothing of what it let go.

Each new content is a new cache key. Before, every key ever fetched left its lock file in `.locks` and its thread
lock in memory, and every model evicted left what was read of its files (and any back-off, in the state file too),
one more of each per pull for the agent's life. What it lets go never comes back as a reading of a folder that is
gone, and its lock files neither outlive a holder killed -9 nor stop the cache when their folder is removed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from gpu_agent.runtime.weights import WeightsCache
from gpu_agent.runtime.weights_index import CacheIndex

from .conftest import wait_until
from .test_weights_cache import s3, s3_endpoint  # noqa: F401  (fixtures)
from .test_weights_disk import put_models

NUM_PULLS = 12


def test_pulling_model_after_model_keeps_no_lock_nor_reading_of_the_models_let_go(s3, s3_endpoint, tmp_path):  # noqa: F811
    names = tuple(f"m{index}" for index in range(NUM_PULLS))
    put_models(s3, "churn", names)
    cache = WeightsCache(tmp_path / "weights", budget_bytes=25_000, s3_endpoint_url=s3_endpoint)
    cache.keep_unsettled = lambda record: None
    for name in names:
        path = cache.fetch(f"s3://churn/{name}")
        cache.read_model(path)
        cache._unsettled[path] = (1, time.monotonic())  # as a reading that gave no answer leaves it

    kept = {entry["cache_key"] for entry in cache._index.entries()}
    assert len(kept) == 2 and cache.num_downloads == NUM_PULLS  # the budget holds two
    assert list((cache.root / ".locks").iterdir()) == []  # had one file per model ever pulled
    assert cache._index._key_locks == {}
    assert {path.name for path in cache._readings} == kept  # had one reading per model ever pulled
    assert {path.name for path in cache._unsettled} == kept


def test_a_key_lock_waited_on_in_another_process_is_still_held_by_one_at_a_time(tmp_path):
    """Its holder removes the lock file on release: one who waited on that file locks the new one instead."""
    (tmp_path / ".locks").mkdir()
    # three indexes of one folder, as three processes have
    holder, waiter, latecomer = CacheIndex(tmp_path), CacheIndex(tmp_path), CacheIndex(tmp_path)
    lock_file = tmp_path / ".locks" / "k.lock"
    held = holder.key_lock("k")
    waited = {}
    release_waiter = threading.Event()

    def wait_for_the_lock():
        with waiter.key_lock("k"):
            waited["file"] = lock_file.exists()
            waited["latecomer"] = latecomer.key_lock("k", blocking=False)
            release_waiter.wait(10)

    thread = threading.Thread(target=wait_for_the_lock)
    thread.start()
    wait_until(lambda: _num_open(lock_file) == 2, 10)  # the waiter has the file open, blocked on its flock
    held.close()
    thread_done = wait_until(lambda: "latecomer" in waited, 10)
    release_waiter.set()
    thread.join(10)
    assert thread_done and waited == {"file": True, "latecomer": None}
    assert not lock_file.exists()
    free = latecomer.key_lock("k", blocking=False)
    assert free is not None
    free.close()


def test_a_model_evicted_after_a_heartbeat_listed_it_is_checked_when_fetched_again(s3, s3_endpoint, tmp_path):  # noqa: F811
    """A heartbeat lists the cache, a pull evicts a model, then the heartbeat asks for that model's reading. Before,
    the background reader read the removed folder and kept an empty reading, which the same content fetched again
    (same key, same folder) reused: a speculators checkpoint naming another tenant's weights as its verifier passed
    every check for the agent's life."""
    s3.create_bucket(Bucket="evicted")
    for key in ("redirect/config.json", "other/config.json"):
        s3.put_object(Bucket="evicted", Key=key, Body=json.dumps(REDIRECTING_CONFIG), ACL="public-read")
    for key in ("redirect/model.safetensors", "other/model.safetensors"):
        s3.put_object(Bucket="evicted", Key=key, Body=os.urandom(10_000), ACL="public-read")
    cache = WeightsCache(tmp_path / "weights", budget_bytes=15_000, s3_endpoint_url=s3_endpoint)
    redirect = cache.fetch("s3://evicted/redirect")
    assert cache.read_model(redirect).problem.startswith(REFUSAL)
    listed = [cache.root / entry["cache_key"] for entry in cache._index.entries()]  # the heartbeat's listing

    cache.fetch("s3://evicted/other")  # the budget holds one: the redirecting model goes
    assert listed == [redirect] and not redirect.exists()
    # the heartbeat asks for the reading of what it listed: read in the background
    assert cache.reading_made(redirect) is None
    wait_until(lambda: cache._background_reader is None, 10)

    assert cache.fetch("s3://evicted/redirect") == redirect
    assert cache.read_model(redirect).problem.startswith(REFUSAL)


def test_a_read_a_heartbeat_queued_goes_with_the_model_evicted_before_it(s3, s3_endpoint, tmp_path):  # noqa: F811
    put_models(s3, "queued", ("one", "two"))
    cache = WeightsCache(tmp_path / "weights", budget_bytes=15_000, s3_endpoint_url=s3_endpoint)
    one = cache.fetch("s3://queued/one")
    # the background reader busy with other models: this read waits in its queue
    cache._background_reader = threading.current_thread()
    assert cache.reading_made(one) is None and one in cache._to_read
    cache.fetch("s3://queued/two")
    assert not one.exists() and one not in cache._to_read


def test_fetches_and_evictions_work_again_after_the_locks_folder_is_removed(s3, s3_endpoint, tmp_path):  # noqa: F811
    """It is empty while nobody holds a lock, and a tmp cleaner (or an operator) may remove it. Before, every fetch
    and eviction failed (`FileNotFoundError`) until the agent restarted."""
    put_models(s3, "unlocked", ("one", "two"))
    cache = WeightsCache(tmp_path / "weights", budget_bytes=15_000, s3_endpoint_url=s3_endpoint)
    one = cache.fetch("s3://unlocked/one")
    shutil.rmtree(cache.root / ".locks")

    two = cache.fetch("s3://unlocked/two")  # evicts one on the way
    assert two.is_dir() and not one.exists() and cache.num_downloads == 2
    assert list((cache.root / ".locks").iterdir()) == []


def test_a_lock_file_left_by_a_holder_killed_mid_download_goes_when_the_next_cache_opens(tmp_path):
    root = tmp_path / "weights"
    WeightsCache(root)
    holder = subprocess.Popen([sys.executable, "-c", KEY_LOCK_HOLDER, str(root)], stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == b"held\n"
        WeightsCache(root)
        assert (root / ".locks" / "k.lock").exists()  # held: kept
    finally:
        holder.send_signal(signal.SIGKILL)  # the agent killed mid-download
        holder.wait()
        holder.stdout.close()

    WeightsCache(root)  # the next agent

    assert list((root / ".locks").iterdir()) == []


def test_a_model_folder_an_agent_killed_mid_eviction_left_goes_when_the_next_cache_opens(s3, s3_endpoint, tmp_path):  # noqa: F811
    # Eviction removes the manifest first, then the folder: an agent killed between the two (an upgrade's SIGTERM, the
    # OOM killer; pulls run on daemon threads) left the folder with no manifest. Nothing counted it (neither a cached
    # copy nor a partial download) and only a fetch of the very same content removed it: a whole model's disk, gone
    # for good. So did one killed between a download's rename into place and its manifest.
    put_models(s3, "churn-orphan", ("m0",), num_bytes=50_000)
    root = tmp_path / "weights"
    copy = WeightsCache(root, s3_endpoint_url=s3_endpoint).fetch("s3://churn-orphan/m0")
    (root / f"{copy.name}.json").unlink()  # the manifest went, then the agent was killed

    cache = WeightsCache(root, s3_endpoint_url=s3_endpoint)  # the next agent

    assert not copy.exists()
    assert cache.statuses() == []


def test_a_model_folder_another_process_is_putting_in_place_is_kept_when_a_cache_opens(tmp_path):
    # Two agents' processes may share one cache: between one's rename into place and its manifest, under the copy's
    # lock, the folder has no manifest yet.
    root = tmp_path / "weights"
    WeightsCache(root)
    key = "0123456789abcdef0123456789abcdef"
    (root / key).mkdir()
    (root / key / "model.safetensors").write_bytes(b"x" * 1000)
    holder = subprocess.Popen([sys.executable, "-c", KEY_LOCK_HOLDER, str(root), key], stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == b"held\n"
        WeightsCache(root)
        assert (root / key / "model.safetensors").exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        holder.stdout.close()


REDIRECTING_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "max_position_embeddings": 4096,
    "speculators_config": {"verifier": {"name_or_path": "/var/lib/inferplane/weights/OTHER_TENANTS_KEY"}},
}
REFUSAL = "the model's files cannot be served: its config.json is a speculators checkpoint"
# A process holding a cache key's lock until it is killed (a download in flight).
KEY_LOCK_HOLDER = """
import sys, time
from pathlib import Path
from gpu_agent.runtime.weights_index import CacheIndex
lock = CacheIndex(Path(sys.argv[1])).key_lock(sys.argv[2] if len(sys.argv) > 2 else "k")
print("held", flush=True)
time.sleep(60)
"""


def _num_open(path: Path) -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}") == str(path)
        except OSError:
            continue
    return count
