"""Celery's entry points for batches: thin wrappers over `endpoints.batches.services`."""

from celery import shared_task

from endpoints.batches import services


# NOTE: a run stops starting lines after `BATCH_RUN_SLICE_S` (default 120 s); the limit leaves room for the
# input's read, the lines still in flight (each waited for at most `runner.LINES_END_WITHIN_S` from the read's
# end) and the files' assembly (`services.RUN_TIME_LIMIT_S`).
@shared_task(name=services.RUN_BATCH_TASK, acks_late=True, time_limit=services.RUN_TIME_LIMIT_S,
             soft_time_limit=services.RUN_TIME_LIMIT_S - 30, ignore_result=True)
def run_batch(batch_id: str) -> str:
    return services.run_batch(batch_id)


@shared_task(name="batches.tick", acks_late=True, time_limit=30, soft_time_limit=25, ignore_result=True)
def tick() -> int:
    return services.tick()


@shared_task(name="batches.sweep_ended_results", acks_late=True, time_limit=300, soft_time_limit=270, ignore_result=True)
def sweep_ended_results() -> int:
    return services.sweep_ended_results()


@shared_task(name="batches.sweep_incomplete_uploads", acks_late=True, time_limit=300, soft_time_limit=270,
             ignore_result=True)
def sweep_incomplete_uploads() -> int:
    return services.sweep_incomplete_uploads()


@shared_task(name="batches.sweep_expired_files", acks_late=True, time_limit=300, soft_time_limit=270, ignore_result=True)
def sweep_expired_files() -> int:
    return services.sweep_expired_files()
