# A nullable column: rows written by pods of the release before are NULL (open).

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('controlplane', '0016_revoke_what_roles_may_not_hold_again'),
    ]

    operations = [
        migrations.AddField(
            model_name='organization',
            name='closed_at',
            field=models.DateTimeField(blank=True, null=True),
        ),
    ]
