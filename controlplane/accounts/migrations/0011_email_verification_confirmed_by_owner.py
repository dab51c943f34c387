"""A verification link counts only in the account's own session. Rows made before may record a link followed signed
out, which verified whoever signed up with the address, a stranger's kept session included: they are marked not
confirmed by the owner, so a forgotten password's reset revokes that account's keys
(`signup.secure_after_password_reset`)."""

from django.db import migrations, models

HELP = (
    "Proven by the address's owner: the link followed in the account's own session, a password reset, or an "
    "operator's word (False: followed signed out, before that was refused)."
)


class Migration(migrations.Migration):
    dependencies = [("controlplane", "0010_revoke_invitations_made_with_keys")]

    operations = [
        # Existing rows: False (nobody knows who followed their link); new rows: True (their owner proved them).
        migrations.AddField(
            "emailverification", "confirmed_by_owner", models.BooleanField(default=False, help_text=HELP)
        ),
        migrations.AlterField(
            "emailverification", "confirmed_by_owner", models.BooleanField(default=True, help_text=HELP)
        ),
    ]
