"""Edits that race: a unique value another request took between a check and the write (a 400 on its field, not a
500), an edit checked against the row as another edit leaves it (`RowLockedUpdateMixin`), and an edit PostgreSQL broke
as a deadlock's victim run again (`again_after_deadlocks`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import psycopg
from django.db import IntegrityError, OperationalError, connection, transaction
from rest_framework.exceptions import ValidationError


class RowLockedUpdateMixin:
    """A DRF update (PATCH) checks its fields against the row as it is: the row is read under its lock for the whole
    request. Two PATCHes at once were each checked against the row as it was before either, each valid alone, and
    both applied: a row nobody checked (an ngram window with its minimum above its maximum, a credential left with
    neither keys nor a role), refused by what reads it later. Must come before the viewset's update mixin."""

    def update(self, request, *args, **kwargs):
        with transaction.atomic():
            return super().update(request, *args, **kwargs)

    def filter_queryset(self, queryset):  # NOTE: what `get_object` reads through, and viewsets leave as it is
        queryset = super().filter_queryset(queryset)
        if self.request is not None and self.request.method in ("PUT", "PATCH"):
            return queryset.select_for_update(of=("self",), no_key=True)  # NOTE: no key changes (`update_endpoint`)
        return queryset


T = TypeVar("T")


# An edit runs at most this many times, each run after the first once a deadlock broke the one before.
DEADLOCK_RUNS = 3


def again_after_deadlocks(work: Callable[[], T], *, wait_for: Callable[[], object]) -> T:
    """`work`, a transaction of its own, run again should PostgreSQL break it as a deadlock's victim (rolled back,
    nothing of it written), once `wait_for` (a transaction of its own, holding nothing else) has waited for the rows the
    other side held; `DEADLOCK_RUNS` runs at most.

    NOTE: an endpoint's edit takes its organisation's row before the endpoint's (`services.update_endpoint`); a pod of
    the release before, its edit or its reconcile task, takes the endpoint's first, then waits for the organisation's.
    During a rollout the two deadlock, and a valid edit was answered 500. Run again at once, the edit took the
    organisation's row back before the other was woken to take it, and the two deadlocked again: it waits for the
    endpoint's row first, holding nothing, so the other finishes. Run again once only, another pod's next task taking
    the endpoint's row between that wait and the run deadlocked with it once more, and the edit was answered 500."""
    for _ in range(DEADLOCK_RUNS - 1):
        try:
            return work()
        except OperationalError as exc:
            if not isinstance(exc.__cause__, psycopg.errors.DeadlockDetected) or connection.in_atomic_block:
                raise  # NOTE: within a transaction of its caller's, which is rolled back whole: not this one's to run again
        wait_for()
    return work()


class ValueTaken(ValidationError):
    """A unique constraint broken by a concurrent write: 400 with the field's error on /api/ and in forms."""


def broken_constraint(exc: IntegrityError) -> str | None:
    """The name of the constraint PostgreSQL refused the write for (psycopg's diagnostics), if any."""
    return getattr(getattr(exc.__cause__, "diag", None), "constraint_name", None)


@contextmanager
def unique_or_field_error(constraints: dict[str, tuple[str, str]]) -> Iterator[None]:
    """Run the block in a savepoint; breaking a constraint named in `constraints` (name: (field, message))
    raises `ValueTaken` with that field's message. Serializers check these values first, but two requests
    can both pass the check: the loser's insert broke the constraint, a 500."""
    try:
        with transaction.atomic():
            yield
    except IntegrityError as exc:
        name = broken_constraint(exc)
        if name not in constraints:
            raise
        field, message = constraints[name]
        raise ValueTaken({field: [message]}) from None
