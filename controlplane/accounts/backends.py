"""Log-in by email: an account is known by its email address, whatever its username is.

Accounts made by sign-up and invitations use the (lower-cased) email as the username; a staff
account made with `manage.py createsuperuser --username admin` keeps its username, and both log
in to the console (and the Django admin) with their email. We keep Django's `auth.User`: a
custom user model would mean rewriting every table that points at it.
"""

from __future__ import annotations

import unicodedata

from django.contrib.auth import get_user_model
from django.contrib.auth.backends import ModelBackend
from django.core.exceptions import ValidationError
from django.core.validators import validate_email
from django.db.models import Q
from django.utils.encoding import punycode

from controlplane.log_privacy import hides_domain, hides_local_part
from controlplane.text import name_problem

# The address columns (`User.email`, `Invitation.email`, `EmailVerification.email`: Django's EmailField).
EMAIL_MAX_LENGTH = 254
# An account's address is also its username (`User.username`, 150 characters): sign-up, `bootstrap_organization`.
ACCOUNT_EMAIL_MAX_LENGTH = 150
# The domain of a deleted account's address (`erasure.tombstone_address`); nothing else may use it (`normalize_email`).
TOMBSTONE_DOMAIN = "deleted.invalid"


def normalize_email(address: str, *, max_length: int = EMAIL_MAX_LENGTH) -> str:
    """The form an address is stored and compared in (stripped, lower-cased), at most `max_length` characters in
    that form: a `ValidationError` (the field's error: forms and serializers show it) where it is longer.

    NOTE: lower-casing can lengthen text ("\u0130", one code point, is two lowered): an address within a form's or a
    serializer's max_length was past its column's once lowered, and the insert was a 500 (sign-up, invitations:
    the tenancy review). Every path that stores an address takes it from here, so the length checked is the one
    stored.

    NOTE: Django's check passes a quoted local part with control characters in it (`"a\x1b[2J"@example.com`): an
    escape sequence reached the members page, the audit log and the mail log, where an operator's terminal ran it.
    No mailbox needs one: refused. Nor a format character: Django's check passes one in the domain
    (`a@ex\u202eample.com`), and a direction override showed the members page and the invitation's mail another
    address than the one invited (`text.name_problem`). Nor the domain of a deleted account's address
    (`TOMBSTONE_DOMAIN`, or one under it): sign-up, an invitation or staff's change of an address made a live account
    look like an erased one (`erasure.is_erased` reads the address), and no mail reaches it anyway. Nor a quoted
    local part: its quotes and quoted pairs are no part of the mailbox (RFC 5322), `"ada+x"@` and `"\\ada"@` are
    `ada+x@` and `ada@`, so one inbox signed up as 2^n accounts, each with its own allowance without a card
    (`organizations.same_mailbox` reads the address as written), and no mailbox needs one. Nor a domain IDNA
    cannot encode (Hebrew and Latin letters in one label, a label past 63 bytes encoded): Django's check passes it,
    and the invitation's mail raised `UnicodeError` as it was sent, a 500. Nor a domain the log scrubber does not hide
    whole (`log_privacy.hides_domain`): Django's check passes `localhost`, an IP literal and a top label with a digit
    of another script, no relay of a production service delivers to one, and such an address was written whole in
    every log line that named it (logs outlive an account's erasure). Nor a local part of punctuation alone
    (`+@example.test`, `log_privacy.hides_local_part`): Django's check passes it, and the scrubber hid none of it.
    """
    # NOTE: NFKC, as Django folds a username (`normalize_username`, an account's is its address) and IDNA the mail's
    # domain: `ada@\uff45xample.test` (fullwidth) was stored so beside its username `ada@example.test`, and an
    # invitation to the address its mail reaches was refused to it as another address's.
    normalized = unicodedata.normalize("NFKC", address.strip()).lower()
    if normalized != address.strip().lower():
        validate_email(normalized)  # NOTE: folded, it is checked again (a fullwidth solidus is a `/`)
    if name_problem(normalized) is not None:  # NOTE: its characters include the control ones (`text.is_plain`)
        raise ValidationError("An address may not hold control characters or format characters (such as a direction override).",
                              code="invalid")
    local, _, domain = normalized.rpartition("@")
    if '"' in local or "\\" in local:  # NOTE: only a quoted local part holds either (Django's dot-atom has neither)
        raise ValidationError('Write the address without quotes or backslashes (ada@example.test, not '
                              '"ada"@example.test).', code="invalid")
    if domain == TOMBSTONE_DOMAIN or domain.endswith(f".{TOMBSTONE_DOMAIN}"):
        raise ValidationError(f"Addresses at {TOMBSTONE_DOMAIN} are reserved for deleted accounts; use your own address.",
                              code="invalid")
    if not domain.isascii():
        try:
            punycode(domain)  # NOTE: as Django's mail writes the address (`sanitize_address`)
        except UnicodeError:
            raise ValidationError("This address's domain cannot be written in a mail: IDNA refuses it (a label too "
                                  "long, or mixing scripts that read in opposite directions).", code="invalid") from None
    if len(normalized) > max_length:
        raise ValidationError(f"Ensure this address has at most {max_length} characters once lower-cased "
                              f"(it has {len(normalized)}).", code="max_length")
    # NOTE: last, the length known: a domain the other rules refuse is named by them.
    if not hides_domain(domain):
        raise ValidationError("Use an address at a domain name mail on the internet reaches (ada@example.test): not "
                              "localhost, an IP address or a name without a top-level domain of letters.",
                              code="invalid")
    if not hides_local_part(local):
        raise ValidationError("Write an address with a letter or a digit before its @ (ada@example.test, not "
                              "+@example.test).", code="invalid")
    return normalized


def same_address(one: str, other: str) -> bool:
    """Whether two stored addresses name one mailbox as `normalize_email` folds them (NFKC, lower-cased).

    NOTE: an address stored before `normalize_email` folded NFKC (`ada@\uff45xample.test`, fullwidth) is kept as it
    was; every invitation is now stored folded, so compared raw none could ever match that account's address."""
    return unicodedata.normalize("NFKC", one.strip()).lower() == unicodedata.normalize("NFKC", other.strip()).lower()


def accounts_with_email(email: str):
    """Accounts known by this address: their email, or a username that is it (case-insensitive)."""
    return get_user_model()._default_manager.filter(Q(email__iexact=email.strip()) | Q(username__iexact=email.strip()))


def account_named(username: str):
    """The account sign-in takes `username` (an address, or a username) for: the one with it as its username, or else
    the one account known by it as an address (`accounts_with_email`); None where none or several are.

    NOTE: an exact username wins; an email names an account only when exactly one has it, so two accounts sharing an
    address (made before this rule) never log in as each other."""
    user = get_user_model()._default_manager.filter(username=username).first()
    if user is None:
        matches = list(accounts_with_email(username)[:2])
        user = matches[0] if len(matches) == 1 else None
    return user


def email_in_use(email: str) -> bool:
    return bool(email.strip()) and accounts_with_email(email).exists()


class EmailBackend(ModelBackend):
    """`ModelBackend` (permissions, `is_active`) that also accepts the account's email as the username
    (`account_named`)."""

    def authenticate(self, request, username=None, password=None, **kwargs):
        if username is None:
            username = kwargs.get(get_user_model().USERNAME_FIELD)
        if not username or password is None:
            return None
        user = account_named(username)
        if user is None:
            # Hash anyway, so a missing account takes as long as a wrong password.
            get_user_model()().set_password(password)
            return None
        if user.check_password(password) and self.user_can_authenticate(user):
            return user
        return None
