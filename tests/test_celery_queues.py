"""Batch runs have a Celery queue of their own: a tenant's batches never hold the worker slots that the
autoscaler tick, reconciles and cold-start wakes need (one queue before: a few hundred tiny batches on a
rate-limited key kept every slot busy for a run's slice each, and the autoscaler's ticks expired behind them)."""

from django.conf import settings

from controlplane.celery_app import app
from endpoints.batches.services import RUN_BATCH_TASK


def test_batch_runs_go_to_their_own_queue_and_everything_else_to_the_default_one():
    assert app.amqp.router.route({}, RUN_BATCH_TASK)["queue"].name == settings.CELERY_BATCH_QUEUE == "batches"
    for task in ("endpoints.autoscale", "batches.tick", "billing.rollup_usage"):
        assert app.amqp.router.route({}, task)["queue"].name == "celery"


def test_a_worker_started_without_queues_consumes_both():
    assert {queue.name for queue in app.amqp.queues.values()} == {"celery", "batches"}
    assert len({queue.routing_key for queue in app.amqp.queues.values()}) == 2  # nothing delivered to both
