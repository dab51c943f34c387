"""A pull's model is pinned as its fetch ends: another pull making room never evicts it before its engine launches.

Real S3 (moto), a real weights cache with a budget for one tiny model, a real supervisor launching the fake engine.
The first pull's thread is held between its fetch's end and what it does next, as a loaded node's scheduler may hold
it (`HeldAfterFetch`); the second pull runs meanwhile.
"""

from __future__ import annotations

import threading

import pytest

from gpu_agent.protocol import ReplicaState
from gpu_agent.runtime.reconciler import Reconciler
from gpu_agent.runtime.supervisor import Supervisor
from gpu_agent.runtime.weights import WeightsCache
from gpu_agent.runtime.weights_access import ModelTooLarge
from tests.agent.conftest import fake_engine_factory, make_spec, wait_until

from .test_weights_cache import s3, s3_endpoint  # noqa: F401  (fixtures)

# One tiny model (~1.6 MB) fits, two do not.
BUDGET_BYTES = 2_500_000


class HeldAfterFetch(WeightsCache):
    """The cache, its fetches of `held_source` returning only once `release` is set (`held` says one is waiting)."""

    def __init__(self, *args, held_source: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.held_source = held_source
        self.held, self.release = threading.Event(), threading.Event()

    def fetch(self, source, **kwargs):
        path = super().fetch(source, **kwargs)
        if source == self.held_source:
            self.held.set()
            self.release.wait(60)
        return path


def upload_tiny_model(s3, bucket: str, model_dir) -> None:  # noqa: F811
    s3.create_bucket(Bucket=bucket)
    for path in model_dir.iterdir():
        s3.put_object(Bucket=bucket, Key=f"m/{path.name}", Body=path.read_bytes(), ACL="public-read")


@pytest.fixture
def node(s3, s3_endpoint, tiny_model_dir, tmp_path):  # noqa: F811
    """A reconciler over a real supervisor (fake engines) and a cache for one tiny model; two models in the store."""
    for bucket in ("pin-first", "pin-second"):
        upload_tiny_model(s3, bucket, tiny_model_dir)
    weights = HeldAfterFetch(
        tmp_path / "weights",
        budget_bytes=BUDGET_BYTES,
        s3_endpoint_url=s3_endpoint,
        held_source="s3://pin-first/m",
    )
    supervisor = Supervisor(tmp_path / "agent", command_factory=fake_engine_factory())
    supervisor.start_monitor(interval_s=0.2, starting_interval_s=0.05)
    reconciler = Reconciler(supervisor, weights, wake=threading.Event())
    yield reconciler, weights
    weights.release.set()
    supervisor.shutdown(timeout_s=1)


def fetched_or_none(weights: WeightsCache, source: str):
    try:
        return weights.fetch(source, pin=True)
    except ModelTooLarge:
        return None


def spec_of(replica_id: str, bucket: str):
    return make_spec(replica_id, endpoint_id=f"e-{replica_id}", model_source=f"s3://{bucket}/m")


def test_a_second_pull_making_room_never_evicts_the_first_pulls_model_before_its_engine_launches(node):
    reconciler, weights = node
    first, second = spec_of("r-first", "pin-first"), spec_of("r-second", "pin-second")
    reconciler.reconcile([first])
    assert weights.held.wait(60), "the first pull never finished its fetch"

    reconciler.reconcile([first, second])  # the second pull needs the room the first model takes
    second_ended = reconciler.wait_for("r-second", (ReplicaState.READY, ReplicaState.FAILED), timeout_s=60)
    weights.release.set()

    first_ended = reconciler.wait_for("r-first", (ReplicaState.READY, ReplicaState.FAILED), timeout_s=60)
    assert first_ended.state == ReplicaState.READY, first_ended.failure_reason
    assert reconciler.supervisor.get("r-first").model_path.is_dir()
    assert second_ended.state == ReplicaState.FAILED
    assert "the models in use leave no room for it" in second_ended.failure_reason


def test_a_fetch_that_fails_or_a_pull_abandoned_after_its_fetch_holds_no_pin(node):
    reconciler, weights = node
    first, second = spec_of("r-first", "pin-first"), spec_of("r-second", "pin-second")
    reconciler.reconcile([first])
    assert weights.held.wait(60)
    with pytest.raises(ModelTooLarge):  # the first model is pinned: no room for the second
        weights.fetch(second.model_source, pin=True)
    reconciler.reconcile([])  # drained while its pull is held: its engine is never launched
    weights.release.set()
    reconciler.wait_for("r-first", (ReplicaState.STOPPED,), timeout_s=60)

    # Both pins gone (the drained pull's thread lets its own go once released): the second model now fits, the first
    # evicted for it.
    path = wait_until(lambda: fetched_or_none(weights, second.model_source), timeout_s=60)
    weights.unpin(path)
    weights.budget_bytes = 0
    assert weights.evict() == [path.name]  # nothing pinned is left


def test_a_copy_a_fetch_pins_while_an_eviction_waits_for_its_lock_is_never_evicted(
    s3,  # noqa: F811
    s3_endpoint,  # noqa: F811
    tiny_model_dir,
    tmp_path,
    monkeypatch,
):
    """The eviction checks the pins, then takes the key's lock: a pull's fetch(pin=True) of the same cached model runs
    whole in between (the interpreter may switch threads there), as forced here from inside the eviction's lock call."""
    upload_tiny_model(s3, "pin-gap", tiny_model_dir)
    weights = WeightsCache(tmp_path / "weights", budget_bytes=None, s3_endpoint_url=s3_endpoint)
    source = "s3://pin-gap/m"
    cached = weights.fetch(source)  # cached and unpinned: the replica that used it ended
    index = weights._index
    real_key_lock = index.key_lock
    pinned = []

    def key_lock_after_a_pull(key, *, blocking=True):
        if not blocking and key == cached.name and not pinned:  # the eviction, past its check of the pins
            pull = threading.Thread(target=lambda: pinned.append(weights.fetch(source, pin=True)))
            pull.start()
            pull.join()
        return real_key_lock(key, blocking=blocking)

    monkeypatch.setattr(index, "key_lock", key_lock_after_a_pull)
    evicted = weights._evict_lru(index.entries(), 1)  # another pull making room
    monkeypatch.setattr(index, "key_lock", real_key_lock)

    assert pinned == [cached]
    assert evicted == []
    assert cached.is_dir() and index.is_complete(cached.name)
    weights.unpin(cached)
    assert weights._evict_lru(index.entries(), 1) == [cached.name]  # unpinned, it goes as before
