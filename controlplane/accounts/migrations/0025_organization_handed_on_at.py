"""When an organisation's creator last stopped owning it (`Organization.handed_on_at`): its spend without a card
before then is its creator's allowance's, after it its owners' (`organizations.holdings_of`). Null, a cheap column to
add; one handed on before it reads as handed on for good."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('controlplane', '0024_audit_organization_creation_indexes'),
    ]

    operations = [
        migrations.AddField(
            model_name='organization',
            name='handed_on_at',
            field=models.DateTimeField(blank=True, editable=False, null=True),
        ),
    ]
