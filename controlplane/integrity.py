"""A unique value another request took between a check and the write: a 400 on its field, not a 500."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from django.db import IntegrityError, transaction
from rest_framework.exceptions import ValidationError


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
