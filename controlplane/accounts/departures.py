"""Deleting an account, whoever does it: the one rule of what may not be left behind, reached from the accounts app.

The rule and the work are `endpoints.closing`'s (`account_refusals`, `end_account`): an account may not go while it is
the only owner of an open organisation that others or live resources depend on, and an organisation of theirs that
nothing depends on is closed with it; both need the endpoints and billing apps, which accounts may not import (the
layers in `pyproject.toml`). The endpoints app fills this registry when Django starts (`EndpointsConfig.ready`), and
the Django admin's user delete calls it (`admin.UserAdmin`), so staff deleting an account go through the same service
as its owner deleting it.

NOTE: nothing registered means no account may be deleted here (`ImproperlyConfigured`): a delete without the rule left
organisations with no owner, for ever.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from django.core.exceptions import ImproperlyConfigured

from controlplane.accounts.services import Actor


class AccountDeletionRefused(ValueError):
    """The account may not be deleted now: `reasons`, one per organisation that depends on it, each naming it."""

    def __init__(self, reasons: list[str]):
        super().__init__(" ".join(reasons))
        self.reasons = reasons


@dataclass(frozen=True, slots=True)
class AccountDeletion:
    refusals: Callable[[object], list[str]]  # why the user's account may not be deleted now; empty where it may
    end: Callable[[Actor, object], None]  # ends it (row kept, tombstoned), or raises `AccountDeletionRefused`


_registered: list[AccountDeletion] = []


def register_account_deletion(deletion: AccountDeletion) -> None:
    """Called once, by the app that owns the rule (`EndpointsConfig.ready`); again, it replaces what was there."""
    _registered[:] = [deletion]


def _deletion() -> AccountDeletion:
    if not _registered:
        raise ImproperlyConfigured("No account deletion is registered: is the endpoints app installed?")
    return _registered[0]


def account_deletion_refusals(user) -> list[str]:
    """Why `user`'s account may not be deleted now, one reason per organisation; empty where it may."""
    return _deletion().refusals(user)


def end_account(actor: Actor, user) -> None:
    """Deletes `user`'s account as its owner's own deletion does (its row kept, deactivated and tombstoned), in one
    transaction; `AccountDeletionRefused` where an organisation depends on it (judged again under their locks)."""
    _deletion().end(actor, user)
