"""Staff's enrolment codes are no longer mailed: whoever holds a staff member's password and mailbox (the usual
phishing pair) could enrol the account's first authenticator with one. An operator prints a code, or a verified
staff member issues one in the admin. Mailed codes never taken are voided here; taken ones stay, the record of
who enrolled with a mailed code."""

from django.db import migrations, models


def void_mailed_codes(apps, schema_editor):
    StaffEnrolmentCode = apps.get_model("controlplane", "StaffEnrolmentCode")
    StaffEnrolmentCode.objects.filter(channel="email", used_at__isnull=True).delete()


class Migration(migrations.Migration):
    dependencies = [
        ("controlplane", "0007_staff_enrolment_code"),
    ]

    operations = [
        migrations.AlterField(
            model_name="staffenrolmentcode",
            name="channel",
            field=models.CharField(
                choices=[
                    ("operator", "Printed by an operator's command"),
                    ("staff", "Issued in the admin by a verified staff member"),
                ],
                max_length=16,
            ),
        ),
        migrations.RunPython(void_mailed_codes, migrations.RunPython.noop),
    ]
