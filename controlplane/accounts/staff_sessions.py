"""Staff sign-ins last hours, not weeks: a staff session reaches every tenant's plans, prices, keys and nodes.

Django's sessions last `SESSION_COOKIE_AGE` (two weeks) from their last save; a staff account's session, on the
console or the admin, ends `INFERPLANE_STAFF_SESSION_HOURS` after its sign-in however it is used (an absolute expiry),
so a staff laptop left signed in, or a session cookie taken from one, is no way in for long.
"""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.contrib.auth.signals import user_logged_in
from django.dispatch import receiver
from django.utils import timezone


@receiver(user_logged_in, dispatch_uid="inferplane-staff-session-expiry")
def end_staff_sessions_sooner(sender, request, user, **kwargs) -> None:
    if (user.is_staff or user.is_superuser) and request is not None and hasattr(request, "session"):
        request.session.set_expiry(timezone.now() + timedelta(hours=settings.STAFF_SESSION_HOURS))
