"""A Redis that restarts a few times never kills the Celery worker: it reconnects and goes on, and the tasks it held
unacknowledged when Redis went away run (Celery's at-least-once), none lost.

A new user's `make run` lost its worker this way: kombu's `restore_unacked` raised `AttributeError: 'NoneType' object
has no attribute 'hostname'` while the worker reconnected, and the worker exited."""

import time

import redis
from django.conf import settings

from controlplane.tasks import ping
from tests.outages import restart_redis
from tests.processes import wait_until

NUM_RESTARTS = 4
MIN_HELD_S = 15  # the held tasks' shortest countdown


def _broker() -> redis.Redis:
    return redis.Redis.from_url(settings.CELERY_BROKER_URL)


def _num_connects(worker) -> int:
    return worker.log_text().count("INFO/MainProcess] Connected to ")


def _restart_redis_and_wait_for_the_worker(worker, *, num_held: int = 0) -> None:
    connects = _num_connects(worker)
    restart_redis()
    wait_until(
        lambda: _num_connects(worker) > connects or worker.process.poll() is not None,
        90,
        message="the worker to reconnect",
    )
    assert worker.process.poll() is None, f"the worker exited:\n{worker.log_tail()}"
    # NOTE: the next restart waits for the worker to hold its tasks again: kombu pops a message (BRPOP) before it
    # records it as unacknowledged, and a Redis that dies between the two loses it (a window this does not close).
    wait_until(
        lambda: _broker().hlen("unacked") == num_held, 60, message="the worker to hold its tasks again"
    )


def _result_of(result, timeout_s: float = 120):
    # NOTE: read from the result backend's key, not waited for on its pub/sub channel: this test process's own
    # subscription may miss a result published just after its Redis came back.
    wait_until(result.ready, timeout_s, message=f"task {result.id} to run")
    return result.result


def _num_runs(worker, task_id: str) -> int:
    return worker.log_text().count(f"[{task_id}] succeeded")


def test_the_worker_reconnects_after_redis_restarts_and_runs_the_next_task(celery_worker):
    assert ping.delay("before").get(timeout=60) == "before"
    for _ in range(NUM_RESTARTS):
        _restart_redis_and_wait_for_the_worker(celery_worker)

    assert _result_of(ping.delay("after the restarts")) == "after the restarts"
    assert celery_worker.process.poll() is None


def test_tasks_held_unacknowledged_across_redis_restarts_still_run(celery_worker):
    # Tasks with a countdown are reserved by the worker at once and held unacknowledged (in the broker's
    # visibility set) until they are due: the messages a reconnect must hand back to the queue.
    # NOTE: the countdown must outlast the restarts (each waits for the tasks to be held again, and fails if one ran)
    # and the test waits it out: twice what the restarts take here, from one restart timed first (a fixed 60 s was
    # ~45 s of waiting on an idle machine).
    started = time.monotonic()
    _restart_redis_and_wait_for_the_worker(celery_worker)
    held_s = max(MIN_HELD_S, 2 * NUM_RESTARTS * (time.monotonic() - started))
    held = [ping.apply_async((f"held {number}",), countdown=held_s) for number in range(3)]
    wait_until(
        lambda: _broker().hlen("unacked") == len(held), 60, message="the worker to reserve the held tasks"
    )

    for _ in range(NUM_RESTARTS):
        _restart_redis_and_wait_for_the_worker(celery_worker, num_held=len(held))

    assert _result_of(ping.delay("after the restarts")) == "after the restarts"
    assert [_result_of(result) for result in held] == [f"held {number}" for number in range(3)]
    # The worker logs a run just after storing its result.
    wait_until(
        lambda: all(_num_runs(celery_worker, result.id) for result in held), 30, message="the runs' log lines"
    )
    assert [_num_runs(celery_worker, result.id) for result in held] == [1, 1, 1], celery_worker.log_tail()
    assert celery_worker.process.poll() is None
