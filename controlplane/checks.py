"""The project's own system checks (`manage.py check`, and the commands that run them, `migrate` included): settings
that each pass their own validation (`controlplane.env`) but together undo what one of them is for."""

from __future__ import annotations

from django.conf import settings
from django.core import checks
from django.db import DatabaseError, connections

from controlplane.serve import GRACEFUL_SHUTDOWN_S, num_workers


@checks.register()
def answer_bytes_bounds(app_configs=None, **kwargs) -> list[checks.CheckMessage]:
    """An organisation's bound on its whole answers in a gateway process must be below the process's own
    (`endpoints.gateway.delivery`): at or past it, the process's bound always acts first, and one organisation's
    answers take the process's whole budget from every other tenant."""
    per_org, per_process = settings.GATEWAY_ANSWER_BYTES_PER_ORG, settings.GATEWAY_ANSWER_BYTES_PER_PROCESS
    if per_org < per_process:
        return []
    return [
        checks.Error(
            f"INFERPLANE_GATEWAY_ANSWER_BYTES_PER_ORG ({per_org} bytes) is not below "
            f"INFERPLANE_GATEWAY_ANSWER_BYTES_PER_PROCESS ({per_process} bytes): the process's bound would always act "
            "first, and one organisation could take a gateway process's whole budget of answer bytes from every other.",
            hint=f"Set it to a share of the process's bound (by default a quarter: {per_process // 4}).",
            id="inferplane.E001",
        )
    ]


@checks.register(checks.Tags.database)
def database_connections_fit(app_configs=None, databases=None, **kwargs) -> list[checks.CheckMessage]:
    """One web pod's connections must fit PostgreSQL's `max_connections` (less its superuser reserve): each of its
    `WEB_CONCURRENCY` gateway processes may hold `DATABASE_POOL_MAX_SIZE` pooled connections and its ledger writer's
    one. Past it, PostgreSQL refuses connects under load and requests fail. Only where the checks may query the
    database (`migrate`, `check --database default`); the whole fleet's sum (x the web pods, beside the workers) is
    the operator's to keep (README, "Configuration")."""
    max_size = settings.DATABASE_POOL_MAX_SIZE
    if not databases or "default" not in databases or max_size == 0:
        return []
    try:
        with connections["default"].cursor() as cursor:
            cursor.execute(
                "SELECT current_setting('max_connections')::int - current_setting('superuser_reserved_connections')::int"
            )
            num_allowed = cursor.fetchone()[0]
    except DatabaseError:
        return []  # a database that does not answer (or PgBouncer, which has no such setting) is checked elsewhere
    num_processes = num_workers()
    num_needed = (max_size + 1) * num_processes
    if num_needed <= num_allowed:
        return []
    return [
        checks.Warning(
            f"One web pod may hold {num_needed} PostgreSQL connections (WEB_CONCURRENCY={num_processes} processes x "
            f"(DATABASE_POOL_MAX_SIZE={max_size} + 1 ledger writer)), more than the {num_allowed} PostgreSQL allows "
            "clients (max_connections less superuser_reserved_connections).",
            hint="Lower DATABASE_POOL_MAX_SIZE or WEB_CONCURRENCY, raise max_connections, or put PgBouncer in front "
            "(DATABASE_POOLER=transaction).",
            id="inferplane.W001",
        )
    ]


@checks.register()
def gateway_drain_fits_the_grace_period(app_configs=None, **kwargs) -> list[checks.CheckMessage]:
    """A web process's drain must leave the steps after it room before the pod's grace period ends
    (`INFERPLANE_GATEWAY_STOP_GRACE_S`): past it, every stop cuts its drain short (`endpoints.gateway.drain.drain_bound_s`,
    to nothing with a short grace period: every call in flight cut at the signal), and nothing said so before the first
    stop (the sixth review of the gateway's stop)."""
    # NOTE: imported here, not at the top: this module is loaded by the control plane's app config (`ready`), and a worker
    # or `manage.py` process would load the whole gateway with it. No cycle: nothing of the gateway imports this module.
    from endpoints.gateway.app import AFTER_GRACEFUL_S
    from endpoints.gateway.drain import room_for_the_drain_s

    room = room_for_the_drain_s(GRACEFUL_SHUTDOWN_S, AFTER_GRACEFUL_S)
    if room is None or settings.GATEWAY_DRAIN_S <= room:
        return []
    return [
        checks.Warning(
            f"INFERPLANE_GATEWAY_DRAIN_S ({settings.GATEWAY_DRAIN_S:g} s) does not fit INFERPLANE_GATEWAY_STOP_GRACE_S "
            f"({settings.GATEWAY_STOP_GRACE_S:g} s) less uvicorn's graceful wait ({GRACEFUL_SHUTDOWN_S:g} s), the cut "
            f"calls' finishes, the usage journal's replay and shipping ({AFTER_GRACEFUL_S:g} s) and the exit: every "
            f"stop's drain will wait {room:g} s.",
            hint="Lower INFERPLANE_GATEWAY_DRAIN_S, or raise the web pod's terminationGracePeriodSeconds with "
            "INFERPLANE_GATEWAY_STOP_GRACE_S (README, Configuration).",
            id="inferplane.W002",
        )
    ]

