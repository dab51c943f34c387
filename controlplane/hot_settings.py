"""Django settings read on every request, as plain attributes: `hot.NAME` is `settings.NAME`.

`django.conf.settings` is a lazy object: each attribute read runs `LazyObject.__getattribute__` in Python (0.4–0.8 µs
timed alone), and the gateway's warm path read twelve a request (the answer bounds, the body's deadlines, the
reservation's TTL, the spend rules, Redis's mode, the key cache's TTL). `hot` reads a setting through `settings` once
and keeps it as its own attribute (~0.01 µs a read) until that setting changes.

NOTE: a change is known by Django's `setting_changed` signal, which `override_settings` and pytest-django's `settings`
fixture send on every change and on its undoing. A setting assigned or deleted on `django.conf.settings` itself (not
through either) would not be seen here: nothing in the project does (settings come from the environment, once per
process).
"""

from __future__ import annotations

from django.conf import settings
from django.core.signals import setting_changed


class _Settings:
    """Each setting read once, then a plain attribute (a miss reads `settings`; `_forget` drops a changed one)."""

    def __getattr__(self, name: str):
        # NOTE: a change between the read and the store (another thread's `override_settings`) would be forgotten
        # before the store and then stored stale for good: a value read across a change is returned, not kept.
        seen = _num_changes
        value = getattr(settings, name)
        if _num_changes == seen:
            self.__dict__[name] = value
        return value


_num_changes = 0  # `setting_changed` signals seen
hot = _Settings()


def _forget(*, setting: str, **_kwargs) -> None:
    global _num_changes
    _num_changes += 1
    hot.__dict__.pop(setting, None)


setting_changed.connect(_forget, dispatch_uid="controlplane.hot_settings")
