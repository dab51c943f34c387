"""The weights cache keeps its readers' back-offs in the agent's state file (`keep_unsettled`), a durable write
(`durable.write_atomic`: two fsyncs, up to ~0.3 s measured on a busy disk). It is made outside the cache's mutex: a
heartbeat's listing (`statuses`) and a download's progress never wait on the disk behind it, and the last write holds
the latest back-offs whatever order two writers reach the disk in."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from gpu_agent.runtime.weights import WeightsCache


def test_a_heartbeats_listing_never_waits_behind_the_state_files_fsync(tmp_path):
    cache = WeightsCache(tmp_path / "weights")
    model_dir = cache.root / ("a" * 32)
    cache._unsettled[model_dir] = (1, 0.0)
    writing, release = threading.Event(), threading.Event()
    kept = []

    def keep(record):  # as the state file's write_atomic, stuck in its fsync
        writing.set()
        release.wait(10)
        kept.append(record)

    cache.keep_unsettled = keep
    forgetting = threading.Thread(target=cache._forget_reading, args=(model_dir,))
    forgetting.start()
    try:
        assert writing.wait(5)
        listed = []
        lister = threading.Thread(target=lambda: listed.append(cache.statuses()), daemon=True)
        lister.start()
        lister.join(2)
        assert listed == [[]], "the heartbeat's listing waited on the state file's fsync"
    finally:
        release.set()
        forgetting.join(10)
    assert kept == [{}]


def test_the_last_back_offs_written_are_the_latest_whatever_order_writers_reach_the_disk(tmp_path):
    cache = WeightsCache(tmp_path / "weights")
    first, second = Path(cache.root / ("a" * 32)), Path(cache.root / ("b" * 32))
    cache._unsettled[first] = (1, 0.0)
    cache._unsettled[second] = (1, 0.0)
    written, entered, release = [], threading.Event(), threading.Event()

    def keep(record):
        if not entered.is_set():
            entered.set()
            release.wait(10)  # the first writer is slow to reach the disk
        written.append(record)

    cache.keep_unsettled = keep
    slow = threading.Thread(target=cache._forget_reading, args=(first,))
    slow.start()
    assert entered.wait(5)
    fast = threading.Thread(target=cache._forget_reading, args=(second,))
    fast.start()
    time.sleep(0.2)
    release.set()
    slow.join(10)
    fast.join(10)
    assert written and written[-1] == {}  # both forgotten: the file holds neither
