# A nullable column: PostgreSQL adds it without rewriting the table, and pods of the release before (which do not name
# it) leave it null: no run ending a subscription, as before.

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('billing', '0039_credit_grant_kind'),
    ]

    operations = [
        migrations.AddField(
            model_name='billingaccount',
            name='subscription_ending_at',
            field=models.DateTimeField(blank=True, null=True),
        ),
    ]
