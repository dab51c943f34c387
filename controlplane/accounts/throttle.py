"""Throttles for the forms an attacker hammers: log-in, sign-up, password reset, password change, resending a
verification, staff's second-factor codes and enrolment codes.

Each posted attempt counts against its client address and against the account it names (so
spreading a password guess over many addresses does not help), in fixed windows kept in the
shared Redis, of Redis's clock (`controlplane.clock.redis_now`): every web process sees the same
counts, in the same windows, however far apart their own clocks are. Subjects are hashed, so Redis holds no
email addresses. An attempt over any limit is answered 429 with `Retry-After` and never reaches
the view.

Log-in counts an account's failed attempts only, and per account and address: an attacker who
names someone's account from elsewhere uses up their own budget, not the owner's, and a correct
password is never what locks an account. The account's failures from all addresses together
have a much higher limit, which bounds a guesser spread over many addresses.
"""

from __future__ import annotations

import hashlib
import logging
import unicodedata
from dataclasses import dataclass, field

import redis
from django.utils.encoding import punycode

from controlplane import clock
from controlplane.redis_keys import throttle_key
from controlplane.redis_scripts import Script

logger = logging.getLogger("inferplane.throttle")


@dataclass(slots=True, frozen=True)
class Limit:
    """At most `num_attempts` per `window_s` for one subject; `per` says what the subject is:
    "ip" (the client address), "user" (the signed-in user), the name of a posted field, or several
    of these joined by "+" (the pair together). With `failures_only`, only attempts the view
    refused count (`Attempt.refund` takes the others out); past the limit every attempt is refused all the same."""

    name: str
    per: str
    num_attempts: int
    window_s: int
    failures_only: bool = False

    def __post_init__(self):
        if self.num_attempts < 1 or self.window_s < 1:
            raise ValueError("a limit needs at least one attempt per at least one second")


# NOTE: log-in on the console and on the Django admin share their counters: switching forms
# gives an attacker no second budget. An account's limits count failures only, per address and in
# all: guesses at one account from one address stop after 10; an attacker elsewhere cannot use up the
# owner's 10, only the account's 100 from all addresses together (a guesser spread over many addresses).
LOGIN = (Limit("login-ip", "ip", 30, 600),
         Limit("login-account-address", "username+ip", 10, 600, failures_only=True),
         Limit("login-account", "username", 100, 600, failures_only=True))
SIGNUP = (Limit("signup-ip", "ip", 10, 3600), Limit("signup-email", "email", 5, 3600))
PASSWORD_RESET = (Limit("reset-ip", "ip", 10, 3600), Limit("reset-email", "email", 3, 3600))
RESEND_VERIFICATION = (Limit("verify-ip", "ip", 10, 3600), Limit("verify-user", "user", 3, 600))
# NOTE: the password change form asks for the current password: unthrottled, a borrowed or stolen session
# guessed it without end and, once right, set its own (a review's finding). As the log-in's, only wrong answers
# count (the form again), so a right one never locks the account; the console's and the admin's forms share it.
PASSWORD_CHANGE = (Limit("password-change-user", "user", 10, 600, failures_only=True),)
# Each invitation mails its address: an admin may not use the platform's mail to flood or phish anyone. Sign-up makes
# organisations freely, so the inviting user's and the client address's counts bound what many organisations send.
INVITATIONS = (Limit("invite-org", "organization", 20, 3600), Limit("invite-user", "user", 50, 86_400),
               Limit("invite-ip", "ip", 50, 86_400), Limit("invite-email", "email", 3, 86_400))
# A person's new organisations (`organizations.create_own_organization`), beside the cap on those they hold: each
# starts with its own allowances, so one person (or many accounts from one address) makes them at a sign-up's pace.
NEW_ORGANIZATIONS = (Limit("new-organization-user", "user", 3, 3600), Limit("new-organization-ip", "ip", 10, 3600))
# The mails an address gets without asking for each, however many accounts, sessions and addresses ask: sign-up's
# (5 an hour per address) and the resend's (3 per 10 minutes per user) alone allowed hundreds a day. Verification
# links and "you already have an account" have a budget each: a stranger signing up with an owner's address sends
# the latter, and spent the owner's verification links for the day when they shared one.
VERIFICATION_MAILS = (Limit("verification-mail-email", "email", 10, 86_400),)
ACCOUNT_EXISTS_MAILS = (Limit("account-exists-mail-email", "email", 3, 86_400),)
# NOTE: the reset form mails an address without an account that it has none (`signup.send_no_account_email`): the
# form's own limit (3 an hour per address) let one client address mail a stranger 72 times a day. A budget of its
# own, counted per mailbox (`mailbox`: `victim+1@` and `victim+2@` had a budget each). The reset link has none: it
# shared this one, and a stranger's 5 resets for `owner+1@`... (no account) spent the owner's links for the day.
# Past it an address without an account is mailed nothing, answered after as long as a reset that mails takes
# (`forms.PasswordResetForm`).
NO_ACCOUNT_MAILS = (Limit("no-account-mail-email", "email", 5, 86_400),)
# How long `take(..., refuse_when_unavailable=True)` asks to wait while its counters cannot be read.
UNAVAILABLE_RETRY_S = 60

# Staff's second factor: a code has a million values, so a guess a second would find one in days; the
# device's own throttle (django-otp: 1, 2, 4... seconds after each wrong code) slows it further.
# NOTE: the enrolment page's codes (taking an enrolment code, confirming the device) count here too.
SECOND_FACTOR = (Limit("code-ip", "ip", 30, 600), Limit("code-user", "user", 10, 600))

# URL name → the limits a POST to it takes.
THROTTLED_VIEWS = {
    "login": LOGIN,
    "admin:login": LOGIN,
    "signup": SIGNUP,
    "password_reset": PASSWORD_RESET,
    "password_change": PASSWORD_CHANGE,
    "admin:password_change": PASSWORD_CHANGE,
    "verify-email-resend": RESEND_VERIFICATION,
    "second-factor": SECOND_FACTOR,
    "second-factor-enrol": SECOND_FACTOR,
}


def folded(subject: str) -> str:
    """One form for every spelling that names the same account: Django's log-in form applies NFKC
    (fullwidth "ｖ" is "v"), and PostgreSQL's case-insensitive match compares upper case ("ı" is "I")."""
    return unicodedata.normalize("NFKC", subject).strip().upper().lower()


def mailbox(email: str) -> str:
    """`email` without a sub-address (`name+tag@host`: `name@host`), the mailbox most hosts deliver it to: a per-address
    budget of mail it gets without asking counted this, or each `+tag` was a fresh budget. NOTE: dots are not folded
    (one host ignores them, others deliver `a.b@` and `ab@` to two people); a host that reads `+` otherwise only shares
    a budget between two of its mailboxes.

    NOTE: its host as the mail writes it (`punycode`, as Django's `sanitize_address`): IDNA's nameprep drops the
    characters it maps to nothing (a zero-width space, a soft hyphen, a word joiner) and folds the rest (fullwidth
    letters), so `a@exa\u200bmple.test` is mailed at `a@example.test`. The reset form's address passes Django's email
    check with them, and each spelling was a fresh budget: a stranger's mail without end at one mailbox. A host IDNA
    cannot write is kept as it is (no mail reaches it)."""
    local, at, host = email.rpartition("@")
    if not at:
        return email
    if not host.isascii():
        try:
            host = punycode(host)
        except UnicodeError:
            pass
    return f"{local.partition('+')[0]}@{host}"


def _redis_key(limit: Limit, subject: str, window: int) -> str:
    digest = hashlib.sha256(folded(subject).encode()).hexdigest()[:32]
    return throttle_key(limit.name, digest, window)


def _subject(limit: Limit, subjects: dict[str, str]) -> str:
    """The limit's subject, "" when a part of it is unknown (the limit then does not apply)."""
    parts = [subjects.get(name) or "" for name in limit.per.split("+")]
    return "\x00".join(parts) if all(parts) else ""


@dataclass(slots=True)
class Attempt:
    """One attempt counted by `take`: the seconds to wait if a limit refused it (None: it may go on), and the
    `failures_only` counters it was counted in provisionally, until the view says it failed (`refund` otherwise)."""

    retry_after_s: int | None = None
    provisional: list[str] = field(default_factory=list)

    def refund(self) -> None:
        """Not a failure (a right password, or refused before the view): out of the failure counters again."""
        if not self.provisional:
            return
        keys, self.provisional = self.provisional, []
        _uncount(keys)


# NOTE: every counter read, then either none written (refused) or all counted, in one step: a refused attempt never
# touches a counter. Before, it was counted with the others and taken out again in a second round trip, and until then
# it counted: an attacker past its own address's limit, flooding resets that named an account, kept that account's
# counter at its limit and refused most of the owner's own first resets (a review's probe: 88% over 8 s).
# KEYS: the counters (then the call's token: `once`); ARGV: each counter's limit, then its time to live (s). Replies
# the 1-based positions of the counters already at their limit (nothing counted), or an empty array (counted in every
# one).
# NOTE: `once`: redis-py sends a command again after a lost connection (`controlplane.redis_client`), and a second run
# of the same attempt counted it twice, and could refuse the attempt its first run had counted (a review's probe: the
# owner's third reset of three, answered 429 and counted all the same).
_TAKE = Script("""
local refused = {}
local counters = #KEYS - 1
for i = 1, counters do
  if tonumber(redis.call('GET', KEYS[i]) or '0') >= tonumber(ARGV[2 * i - 1]) then refused[#refused + 1] = i end
end
if #refused > 0 then return refused end
for i = 1, counters do
  redis.call('INCR', KEYS[i])
  redis.call('EXPIRE', KEYS[i], ARGV[2 * i])
end
return refused
""", once=True)

# KEYS: the counters an attempt is taken out of (then the call's token: `once`, as `_TAKE`). Only a counter above 0:
# one Redis lost since the attempt was counted (a restart without persistence, a failover to a lagging replica) is
# gone, and DECR made it -1, with no expiry: one attempt more, in its window and every window after it, as its key
# lives on.
_UNCOUNT = Script("""
for i = 1, #KEYS - 1 do
  if tonumber(redis.call('GET', KEYS[i]) or '0') > 0 then redis.call('DECR', KEYS[i]) end
end
return 0
""", once=True)


def take(limits: tuple[Limit, ...], subjects: dict[str, str], *, refuse_when_unavailable: bool = False) -> Attempt:
    """Counts one attempt against each limit whose subject is known, or, if any of them is at its limit, against none;
    its `retry_after_s` then.

    A `failures_only` limit counts the attempt too, provisionally, as a failure: the caller refunds it unless the view
    refused it (`Attempt.refund`). NOTE: counted only after the view, attempts sent at once all read the failures
    before any of them: 30 wrong passwords posted together from one address passed its limit of 10.

    NOTE: refused, it did nothing, so it counts against no subject: before, a client past its own address's limit still
    spent any account's budget, and three refused resets an hour locked the account's owner out of its own reset (the
    tenancy review). Its own limits still refuse the next.

    NOTE: Redis being down lets attempts through (logged): a throttle must not lock every
    user out of the console. With `refuse_when_unavailable` (a budget of mails anyone may have sent to an address:
    `signup.send_no_account_email`, `send_account_exists_email`) it refuses them instead, for `UNAVAILABLE_RETRY_S`:
    let through, a Redis outage let anyone mail any address without bound.
    """
    now = clock.redis_now()  # NOTE: every web process's windows are Redis's (its offset, read on its heartbeat)
    counted = [(limit, subject, int(now // limit.window_s)) for limit in limits if (subject := _subject(limit, subjects))]
    if not counted:
        return Attempt()
    keys = [_redis_key(limit, subject, window) for limit, subject, window in counted]
    try:
        refused = _TAKE.run_sync(keys=keys, args=[part for limit, _, _ in counted
                                                  for part in (limit.num_attempts, limit.window_s + 1)])
    except redis.RedisError:
        if refuse_when_unavailable:
            logger.warning("throttle counters unavailable; refusing the attempt", exc_info=True)
            return Attempt(UNAVAILABLE_RETRY_S, [])
        logger.warning("throttle counters unavailable; letting the attempt through", exc_info=True)
        return Attempt()
    if refused:
        return Attempt(max(int((window + 1) * limit.window_s - now) + 1
                           for limit, _, window in (counted[position - 1] for position in refused)), [])
    return Attempt(None, [key for (limit, _, _), key in zip(counted, keys, strict=True) if limit.failures_only])


def _uncount(keys: list[str]) -> None:
    """Take one attempt out of each of these counters (`Attempt.refund`)."""
    try:
        _UNCOUNT.run_sync(keys=keys, args=[])
    except redis.RedisError:
        logger.warning("throttle counters unavailable; an attempt stays counted", exc_info=True)
