"""The Celery application: worker and beat share it.

    celery -A controlplane worker   # autoscaling, placement, rollups, Stripe sync
    celery -A controlplane beat     # the clock (exactly one)

Beat and the workers compare their clocks with Redis's (`controlplane.clock`): a worker ahead of beat by more than an
entry's `expires` drops every run of it unrun.
"""

import os

from celery import Celery
from celery.signals import beat_init, before_task_publish, task_revoked, worker_ready

# NOTE: imported before `Celery()` is built: its `import_modules` receiver (the folder of a worker's /metrics) must run
# before the Django fixup's, which sets Django up and with it imports prometheus_client.
from controlplane import clock, worker_metrics  # noqa: F401 - its signals serve a worker's /metrics

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

app = Celery("inferplane")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


class _Role:
    beat = False  # this process is beat


@worker_ready.connect
def _check_worker_clock(**_) -> None:
    clock.check("worker", reason="at start")


@beat_init.connect
def _check_beat_clock(**_) -> None:
    _Role.beat = True
    clock.check("beat", reason="at start")


@before_task_publish.connect
def _check_beat_clock_now_and_then(**_) -> None:
    if _Role.beat:  # NOTE: beat's sends only: a web process sending a task never waits on this
        clock.check_now_and_then("beat")


@task_revoked.connect
def _check_worker_clock_on_expiry(sender=None, expired=False, **_) -> None:
    if expired:
        clock.check_now_and_then("worker", reason=f"{getattr(sender, 'name', 'a task')} dropped unrun as expired")
