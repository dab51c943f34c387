"""Staff's recovery codes: a lost phone need not wait for an operator.

Enrolling an authenticator issues `NUM_RECOVERY_CODES` codes, shown once; each passes the code page once, in
place of a code from the app, and the signed-in staff member may replace them all at any time (the old ones are
then void). They are the tokens of one django-otp static device per account (`otp_static`, whose throttling
slows wrong ones down as the authenticator's does), named `RECOVERY_DEVICE_NAME`.

NOTE: django-otp keeps a static token as it is given. What is given here is the code's digest
(`tokens.typed_code_digest`), never the code, so the database (and the admin's view of the device) holds no
usable code; `recovery_token` turns what is typed into that digest before the device compares.
"""

from __future__ import annotations

from django.db import transaction
from django_otp.plugins.otp_static.models import StaticDevice, StaticToken

from controlplane import tokens

NUM_RECOVERY_CODES = 10
RECOVERY_DEVICE_NAME = "recovery codes"


def recovery_device(user) -> StaticDevice | None:
    return (
        StaticDevice.objects.filter(user=user, name=RECOVERY_DEVICE_NAME, confirmed=True)
        .order_by("pk")
        .first()
    )


def recovery_token(typed: str) -> str:
    """What the recovery device compares: the digest of the code as typed."""
    return tokens.typed_code_digest(typed)


def replace_recovery_codes(user) -> list[str]:
    """New codes for `user`, the old ones void; returns the plain codes, which nothing keeps.

    NOTE: the device stays (only its tokens change), so a session a recovery code verified keeps its proof.
    """
    codes = [tokens.issue_typed_code() for _ in range(NUM_RECOVERY_CODES)]
    with transaction.atomic():
        device = recovery_device(user)
        if device is None:
            device = StaticDevice.objects.create(user=user, name=RECOVERY_DEVICE_NAME, confirmed=True)
        else:
            device = StaticDevice.objects.select_for_update().get(pk=device.pk)
            device.token_set.all().delete()
        StaticToken.objects.bulk_create(
            StaticToken(device=device, token=recovery_token(code)) for code in codes
        )
    return codes


def num_recovery_codes_left(user) -> int:
    return StaticToken.objects.filter(
        device__user=user, device__name=RECOVERY_DEVICE_NAME, device__confirmed=True
    ).count()


def remove_recovery_codes(user) -> int:
    """Removes `user`'s recovery device (an operator's reset); returns how many unused codes went with it."""
    num_codes = num_recovery_codes_left(user)
    StaticDevice.objects.filter(user=user).delete()
    return num_codes
