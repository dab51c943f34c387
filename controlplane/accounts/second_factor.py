"""Staff's second factor: a password alone is no staff session.

A staff session reaches every tenant's plans, prices, keys, nodes and node pools, so staff powers (the
console's fleet pages, the Django admin, the node pools' API, staff-only figures) need a session that also
passed a TOTP code (RFC 6238) from the staff member's confirmed device, or one of their recovery codes:
`has_staff_powers`, the one test every staff check makes. Until then a staff account is an ordinary user.

The proof lives in the session (django-otp's `OTPMiddleware` reads the device's id from it and drops it
when the device is gone or belongs to someone else), so it ends with the session
(`controlplane.accounts.staff_sessions`), with a log-out, and with an operator's reset of the devices. A code
is taken once (the device's `last_t`: only a later time step verifies next) under the device's row lock, and
wrong codes slow the device down (django-otp's throttling: 1, 2, 4... seconds) on top of the per-user limit
on posts (`controlplane.accounts.throttle`). Every accepted, refused and throttled code, every enrolment and
every reset is in the audit log.

Enrolling a device takes more than the password: first an enrolment code from outside it and the account's mailbox
(printed by an operator, or issued by a verified staff member: `issue_staff_enrolment_code`,
`controlplane.accounts.enrolment_codes`), which lets this session, for a while, see a new device's secret and
confirm it. A confirmed enrolment issues recovery codes (`controlplane.accounts.recovery_codes`),
each of which passes the code page once in place of a code from the device.
"""

from __future__ import annotations

import enum
import math
from base64 import b32encode
from dataclasses import dataclass

from django.db import transaction
from django.utils import timezone
from django_otp import login as otp_login
from django_otp.models import Device
from django_otp.plugins.otp_static.models import StaticDevice
from django_otp.plugins.otp_totp.models import TOTPDevice

from controlplane.accounts import enrolment_codes, recovery_codes, staff_sessions
from controlplane.accounts.services import Actor, record_audit

# The session's proof that it took an enrolment code: {"device": the pending device's pk, "until": epoch seconds}.
ENROLMENT_SESSION_KEY = "second_factor_enrolment"


def is_staff_account(user) -> bool:
    """An account that holds staff powers once its session passed the second factor."""
    return bool(user is not None and user.is_authenticated and user.is_staff)


def has_staff_powers(user) -> bool:
    """Staff, in a session that passed the second factor.

    NOTE: `is_verified` is installed by `OTPMiddleware` on the session's user; a user an API key authenticated
    has none, so a key never carries staff powers, whoever created it.
    """
    if not is_staff_account(user):
        return False
    is_verified = getattr(user, "is_verified", None)
    return bool(is_verified is not None and is_verified())


def needs_second_factor(user) -> bool:
    return is_staff_account(user) and not has_staff_powers(user)


def confirmed_device(user) -> TOTPDevice | None:
    return TOTPDevice.objects.filter(user=user, confirmed=True).order_by("pk").first()


def enrolling_device(request) -> TOTPDevice | None:
    """The device this session may enrol, once it took an enrolment code (`take_enrolment_code`) and for
    `ENROLMENT_CODE_TTL` after: not counted until a code from it is confirmed (`confirm_enrolment`)."""
    claim = request.session.get(ENROLMENT_SESSION_KEY)
    if not isinstance(claim, dict) or not isinstance(claim.get("until"), int | float):
        return None
    if claim["until"] <= timezone.now().timestamp():
        return None
    return TOTPDevice.objects.filter(pk=claim.get("device"), user=request.user, confirmed=False).first()


def base32_secret(device: TOTPDevice) -> str:
    """The secret as authenticator apps take it typed in."""
    return b32encode(device.bin_key).decode()


class Outcome(enum.Enum):
    VERIFIED = "verified"
    WRONG = "wrong"
    THROTTLED = "throttled"


@dataclass(slots=True, frozen=True)
class CodeCheck:
    outcome: Outcome
    retry_after_s: int = 0
    recovery_codes: tuple[str, ...] = ()  # issued by a confirmed enrolment: shown once, kept nowhere
    num_recovery_codes_left: int | None = None  # once a recovery code passed

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.VERIFIED


def is_recovery_code(typed: str) -> bool:
    """A code from the app is digits alone; a recovery code has letters (`tokens.issue_typed_code`)."""
    compact = "".join(typed.split())
    return bool(compact) and not (compact.isdigit() and len(compact) <= 8)


def _check_code(model: type[Device], device_pk: int, token: str) -> tuple[Device, CodeCheck]:
    # NOTE: under the device's row lock: two requests with one code both read the same `last_t` (or the same
    # static token) otherwise, and both would verify.
    with transaction.atomic():
        device = model.objects.select_for_update().get(pk=device_pk)
        allowed, why = device.verify_is_allowed()
        if not allowed:
            locked_until = (why or {}).get("locked_until")
            wait_s = max(1, math.ceil((locked_until - timezone.now()).total_seconds())) if locked_until else 1
            return device, CodeCheck(Outcome.THROTTLED, wait_s)
        if device.verify_token(token):
            return device, CodeCheck(Outcome.VERIFIED)
        return device, CodeCheck(Outcome.WRONG)


def _elevate_session(request, device: Device) -> None:
    """Marks this session as past the second factor, under a new session key.

    NOTE: the key changes as it does at the password step (`login()`): a cookie copied from this browser before
    the code was entered (a shared machine, a proxy's log) does not become a staff session with it. And the session
    ends `INFERPLANE_STAFF_SESSION_HOURS` after its sign-in from here, whatever it was before: one signed in before
    the account was made staff kept its two weeks (`staff_sessions.end_as_staff_session`; the code pages send one
    older than the hours to sign in again first).
    """
    otp_login(request, device)
    staff_sessions.end_as_staff_session(request.session)
    request.session.cycle_key()


def verify_staff_code(request, code: str) -> CodeCheck:
    """Checks a code from the staff member's confirmed device, or one of their recovery codes; a right one
    makes this session staff."""
    device = confirmed_device(request.user)
    if device is None:
        return CodeCheck(Outcome.WRONG)
    if is_recovery_code(code):
        return _verify_recovery_code(request, code)
    device, check = _check_code(TOTPDevice, device.pk, "".join(code.split()))
    actor = Actor.from_request(request)
    if check.ok:
        _elevate_session(request, device)
        record_audit(actor, None, "staff.second_factor.verify", request.user)
    else:
        record_audit(actor, None, "staff.second_factor.refuse", request.user, reason=check.outcome.value,
                     num_failures=device.throttling_failure_count)
    return check


def _verify_recovery_code(request, code: str) -> CodeCheck:
    actor = Actor.from_request(request)
    device = recovery_codes.recovery_device(request.user)
    if device is None:
        record_audit(actor, None, "staff.second_factor.refuse", request.user, reason=Outcome.WRONG.value,
                     recovery_code=True, num_failures=0)
        return CodeCheck(Outcome.WRONG)
    device, check = _check_code(StaticDevice, device.pk, recovery_codes.recovery_token(code))
    if not check.ok:
        record_audit(actor, None, "staff.second_factor.refuse", request.user, reason=check.outcome.value,
                     recovery_code=True, num_failures=device.throttling_failure_count)
        return check
    num_left = recovery_codes.num_recovery_codes_left(request.user)
    _elevate_session(request, device)
    record_audit(actor, None, "staff.second_factor.recovery_code.use", request.user, num_left=num_left)
    return CodeCheck(Outcome.VERIFIED, num_recovery_codes_left=num_left)


def take_enrolment_code(request, code: str) -> CodeCheck:
    """Takes an enrolment code issued for this account (`enrolment_codes`): this session may then, for
    `ENROLMENT_CODE_TTL`, see a new device's secret and confirm the device (`confirm_enrolment`).

    NOTE: the device is new here, and any earlier pending one goes: a secret shown before (to whoever held
    the password then) is never the one enrolled.
    """
    user = request.user
    if confirmed_device(user) is not None:
        return CodeCheck(Outcome.WRONG)
    if not enrolment_codes.take_enrolment_code(Actor.from_request(request), user, code):
        return CodeCheck(Outcome.WRONG)
    TOTPDevice.objects.filter(user=user, confirmed=False).delete()
    device = TOTPDevice.objects.create(user=user, name="authenticator", confirmed=False)
    request.session[ENROLMENT_SESSION_KEY] = {
        "device": device.pk, "until": (timezone.now() + enrolment_codes.ENROLMENT_CODE_TTL).timestamp()}
    return CodeCheck(Outcome.VERIFIED)


class EnrolmentCodeRefused(Exception):
    """Why a staff member may not issue an enrolment code for an account; the message says it to them."""


def issue_staff_enrolment_code(actor: Actor, user) -> str:
    """An enrolment code for the staff account `user`, issued by a staff member whose session passed their own
    second factor (the admin's action): they hand it over themselves, by a channel that proves who asked.
    Returns the plain code, to be shown once; the issue is audited with the issuer as its actor.

    NOTE: only for an active staff account without a confirmed device: one with a device enrols no other
    without an operator's reset, and a tenant is never asked for a code.
    """
    if not has_staff_powers(actor.user):
        raise EnrolmentCodeRefused("Only a staff member who passed their own second factor issues enrolment codes.")
    if not (user.is_active and user.is_staff):
        raise EnrolmentCodeRefused(f"{user} is not an active staff account: it enrols no authenticator.")
    if confirmed_device(user) is not None:
        raise EnrolmentCodeRefused(f"{user} already has an authenticator: a new one takes an operator's reset "
                                   "(manage.py reset_staff_second_factor).")
    return enrolment_codes.issue_enrolment_code(actor, user, channel=enrolment_codes.Channel.STAFF)


def confirm_enrolment(request, code: str) -> CodeCheck:
    """Confirms the device this session enrols (`enrolling_device`) with a code from it: it then counts, new
    recovery codes are issued (in the answer only), and this session is staff.

    NOTE: refused once a confirmed device exists: replacing it takes an operator's reset
    (`manage.py reset_staff_second_factor`), never the password alone.
    """
    pending = enrolling_device(request)
    if pending is None or confirmed_device(request.user) is not None:
        return CodeCheck(Outcome.WRONG)
    device, check = _check_code(TOTPDevice, pending.pk, "".join(code.split()))
    actor = Actor.from_request(request)
    if not check.ok:
        record_audit(actor, None, "staff.second_factor.refuse", request.user, reason=check.outcome.value,
                     enrolling=True, num_failures=device.throttling_failure_count)
        return check
    # NOTE: one confirmation issues codes: a second request with the next step's code (a double submit) finds
    # the device confirmed and issues none that would void the ones the first answer shows.
    with transaction.atomic():
        if not TOTPDevice.objects.filter(pk=device.pk, confirmed=False).update(confirmed=True):
            return CodeCheck(Outcome.WRONG)
        codes = recovery_codes.replace_recovery_codes(request.user)
    device.confirmed = True
    request.session.pop(ENROLMENT_SESSION_KEY, None)
    _elevate_session(request, device)
    record_audit(actor, None, "staff.second_factor.enrol", request.user, num_recovery_codes=len(codes))
    return CodeCheck(Outcome.VERIFIED, recovery_codes=tuple(codes))


def replace_recovery_codes(request) -> list[str]:
    """New recovery codes for the signed-in staff member, whose session passed the second factor; the old ones
    are void. Returns the plain codes, to be shown once."""
    if not has_staff_powers(request.user):
        raise PermissionError("only a session that passed the second factor replaces its recovery codes")
    num_void = recovery_codes.num_recovery_codes_left(request.user)
    codes = recovery_codes.replace_recovery_codes(request.user)
    record_audit(Actor.from_request(request), None, "staff.second_factor.recovery_codes.replace", request.user,
                 num_void=num_void)
    return codes


def reset_second_factor(actor: Actor, user) -> int:
    """Removes every device of `user` (a lost phone), their recovery codes and the enrolment codes they have not
    taken: the sessions they verified lose staff powers at once, and the next sign-in enrols a new device (with
    a new enrolment code). Returns how many authenticators went."""
    num_devices, _ = TOTPDevice.objects.filter(user=user).delete()
    num_recovery_codes = recovery_codes.remove_recovery_codes(user)
    num_enrolment_codes = enrolment_codes.void_enrolment_codes(user)
    record_audit(actor, None, "staff.second_factor.reset", user, num_devices=num_devices,
                 num_recovery_codes=num_recovery_codes, num_enrolment_codes=num_enrolment_codes)
    return num_devices
