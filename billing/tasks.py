"""Thin Celery wrappers around billing services. Each is safe to run twice and at any time."""

from celery import shared_task
from celery.signals import worker_process_shutdown, worker_shutdown

from billing import (
    alerts,
    credits,
    held_rollups,
    journal_shipping,
    rollups,
    services,
    stripe_sync,
    usage_writer,
)
from billing.quota import sweeper


@shared_task(name="billing.rollup_usage", acks_late=True, time_limit=600, soft_time_limit=570)
def rollup_usage(full: bool = False) -> dict:
    result = rollups.rollup_usage(full=full)
    credits.draw_due_credits()
    return {
        "groups": result.num_groups, "created": result.num_created, "updated": result.num_updated,
        "adjustments": result.num_adjustments, "closed": result.num_closed,
    }


@shared_task(name="billing.push_pending_rollups", acks_late=True, time_limit=600, soft_time_limit=570)
def push_pending_rollups() -> int:
    try:
        return stripe_sync.push_pending_rollups()
    finally:
        # NOTE: every minute, a run that found another still going included: the gauge of held rollups
        # (`billing.held_rollups`) stays fresh however long a run takes.
        held_rollups.record_held_counts()


@shared_task(name="billing.replay_shipped_usage", acks_late=True, time_limit=600, soft_time_limit=570)
def replay_shipped_usage() -> int:
    return journal_shipping.replay_shipped()


@shared_task(name="billing.push_rollup", acks_late=True, time_limit=120, soft_time_limit=100)
def push_rollup(rollup_id: int) -> bool:
    return stripe_sync.push_rollup(rollup_id)


@shared_task(name="billing.sweep_expired_reservations", acks_late=True, time_limit=60, soft_time_limit=50)
def sweep_expired_reservations() -> int:
    return sweeper.sweep_expired_reservations()


@shared_task(name="billing.check_spend_alerts", acks_late=True, time_limit=120, soft_time_limit=100)
def check_spend_alerts() -> int:
    return alerts.check_all_spend_alerts()


@shared_task(name="billing.refresh_card_ceilings", acks_late=True, time_limit=60, soft_time_limit=50)
def refresh_card_ceilings() -> int:
    return services.refresh_shared_card_ceilings()


@shared_task(name="billing.refresh_shared_allowances", acks_late=True, time_limit=60, soft_time_limit=50)
def refresh_shared_allowances() -> int:
    return services.refresh_shared_allowances()


@shared_task(name=services.ALLOWANCE_REFRESH_TASK, acks_late=True, time_limit=60, soft_time_limit=50)
def refresh_allowances(organization_id: int, user_id: int) -> int:
    """The limits of the organisation and of the person's organisations written again after a change of the person's
    membership of it (`services.refresh_allowances`)."""
    return services.refresh_allowances(organization_id, user_id)


@shared_task(name=services.CARD_REFRESH_TASK, acks_late=True, time_limit=60, soft_time_limit=50)
def refresh_card(fingerprint: str) -> int:
    """One card's organisations' limits written again after a change of who owns one of them (`services.refresh_card`)."""
    return services.refresh_card(fingerprint)


@shared_task(name="billing.review_payment_standing", acks_late=True, time_limit=300, soft_time_limit=270)
def review_payment_standing() -> int:
    on_hold = services.review_all_payment_standing()
    if stripe_sync.is_configured():
        stripe_sync.observe_unknown_payment_methods()
    return on_hold


@worker_process_shutdown.connect
def _ship_a_childs_set_aside_before_it_exits(**_) -> None:
    usage_writer.ship_set_aside_before_exit(start=False)  # its shipper, if any (a batch run's replay started it)


@worker_shutdown.connect
def _ship_the_pods_set_aside_before_the_worker_exits(**_) -> None:
    usage_writer.ship_set_aside_before_exit(start=True)  # the pool is gone: what its children left
