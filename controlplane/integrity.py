"""Edits that race: a unique value another request took between a check and the write (a 400 on its field, not a
500), and an edit checked against the row as another edit leaves it (`RowLockedUpdateMixin`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from django.db import IntegrityError, transaction
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
