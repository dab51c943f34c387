"""Staff sign-ins last hours, not weeks: a staff session reaches every tenant's plans, prices, keys and nodes.

Django's sessions last `SESSION_COOKIE_AGE` (two weeks) from their last save; a staff account's session, on the
console or the admin, ends `INFERPLANE_STAFF_SESSION_HOURS` after its sign-in however it is used (an absolute expiry),
so a staff laptop left signed in, or a session cookie taken from one, is no way in for long.

NOTE: "after its sign-in" is the password's sign-in, kept in every session (`SIGNED_IN_AT_KEY`), whoever signs in:
an account made staff while signed in (a customer's two-week session) entered its code in that session, and the
session, staff now, kept its two weeks (the tenancy review). A session gets staff powers only through the code page
(`second_factor._elevate_session`), which caps its expiry here (`end_as_staff_session`); one whose sign-in is older
than the hours, or that holds no sign-in time (signed in before it was kept), signs in again first
(`may_become_staff`).

A password sign-in starts the session over as far as staff powers go (`start_a_new_sign_in`): the second factor's
proof goes and the session key changes, so the sign-in needs a new code whatever the session had passed before.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.conf import settings
from django.contrib.auth.signals import user_logged_in
from django.dispatch import receiver
from django.utils import timezone
from django_otp import DEVICE_ID_SESSION_KEY

# When the session's password sign-in was: epoch seconds.
SIGNED_IN_AT_KEY = "signed_in_at"


@receiver(user_logged_in, dispatch_uid="inferplane-staff-session-expiry")
def start_a_new_sign_in(sender, request, user, **kwargs) -> None:
    """Every `login()` (the console's and the admin's log-in forms): a new sign-in, with no staff powers until a new
    code, under a new session key, whose hours count from now.

    NOTE: Django's `login()` keeps the session as it is (no flush, the same key) for the same user with the same
    password: a verified staff session that posted the password again at the admin's log-in kept django-otp's
    proof while its sign-in time and end moved to now, staff powers renewed with no code, for ever, by whoever
    held the cookie and the password. The user's `otp_device` goes too: django-otp's own `user_logged_in`
    receiver (after this one) would put a user's device back in the session.
    """
    if request is None or not hasattr(request, "session"):
        return
    request.session.pop(DEVICE_ID_SESSION_KEY, None)
    if getattr(user, "otp_device", None) is not None:
        user.otp_device = None
    request.session.cycle_key()
    request.session[SIGNED_IN_AT_KEY] = timezone.now().timestamp()
    if user.is_staff or user.is_superuser:
        request.session.set_expiry(staff_session_end(request.session))


def staff_session_end(session) -> datetime | None:
    """When staff powers in this session end: `INFERPLANE_STAFF_SESSION_HOURS` after its sign-in; None for a session
    that holds no sign-in time."""
    signed_in_at = session.get(SIGNED_IN_AT_KEY)
    if not isinstance(signed_in_at, int | float) or isinstance(signed_in_at, bool):
        return None
    return datetime.fromtimestamp(signed_in_at, tz=timezone.get_current_timezone()) + timedelta(
        hours=settings.STAFF_SESSION_HOURS)


def may_become_staff(session) -> bool:
    """Whether this session is young enough to pass the second factor: its sign-in less than the hours ago."""
    end = staff_session_end(session)
    # NOTE: signed in and judged by web pods' own clocks (an end hours away moved by a pod's skew, seconds): as
    # any web process's skew past 2 s is an ERROR and on `/metrics` (`controlplane.clock.record_offset`)
    return end is not None and end > timezone.now()


def end_as_staff_session(session) -> None:
    """Makes this session, passing the second factor, end at `staff_session_end` (or sooner, were it to end
    sooner); at once where it may not become staff (`may_become_staff`)."""
    end = staff_session_end(session) or timezone.now()
    session.set_expiry(min(end, session.get_expiry_date()))
