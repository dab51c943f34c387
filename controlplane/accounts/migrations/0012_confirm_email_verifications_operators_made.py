"""Migration 0011 marked every existing verification not confirmed by its owner, so a forgotten password's reset
revoked the keys of owners no sign-up made: those made by operators (`create_org`, the demo's seed, the Django
admin), before verification existed (migration 0002 verified them) or since. Here a row is confirmed unless its
address is one the account signed up with or verified by a link (`signup.secure_after_password_reset`).

NOTE: whether such a link was followed in the account's own session (its owner's) or signed out (perhaps for a
stranger's kept sign-up session) was never recorded: the `user.verify_email` event names the account either way,
with no session or client address. Those rows stay unconfirmed, the safe side: the account's next reset revokes
its keys and pending invitations, and confirms it. An account signed up with an address is known by its
`organization.create` event: sign-up is the one path that makes an organisation with its new owner as the actor
(operators' paths act as the platform)."""

from django.db import migrations


def confirm_email_verifications_operators_made(apps, schema_editor):
    AuditEvent = apps.get_model("controlplane", "AuditEvent")
    EmailVerification = apps.get_model("controlplane", "EmailVerification")
    proven_by_account = set()  # (user id, address) the account signed up with or verified by a link
    events = AuditEvent.objects.filter(actor__isnull=False, action__in=("organization.create", "user.verify_email"))
    for actor_id, action, details in events.values_list("actor_id", "action", "details").iterator():
        email = (details or {}).get("owner" if action == "organization.create" else "email")
        if isinstance(email, str):
            proven_by_account.add((actor_id, email.lower()))
    unconfirmed = EmailVerification.objects.filter(confirmed_by_owner=False).values_list("user_id", "email")
    operators_made = [user_id for user_id, email in unconfirmed.iterator()
                      if (user_id, email.lower()) not in proven_by_account]
    EmailVerification.objects.filter(user_id__in=operators_made).update(confirmed_by_owner=True)


class Migration(migrations.Migration):
    dependencies = [("controlplane", "0011_email_verification_confirmed_by_owner")]

    operations = [
        migrations.RunPython(confirm_email_verifications_operators_made, migrations.RunPython.noop),
    ]
