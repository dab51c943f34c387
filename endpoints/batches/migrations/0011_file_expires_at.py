# File.expires_at and Batch.output_expires_after_s (OpenAI's expires_after and output_expires_after): nullable, so
# the release before reads and writes rows as it did.

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('batches', '0010_batch_line_concurrency'),
        ('controlplane', '0016_revoke_what_roles_may_not_hold_again'),
    ]

    operations = [
        migrations.AddField(
            model_name='batch',
            name='output_expires_after_s',
            field=models.PositiveIntegerField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name='file',
            name='expires_at',
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddIndex(
            model_name='file',
            index=models.Index(condition=models.Q(('deleted_at__isnull', True), ('expires_at__isnull', False)), fields=['expires_at'], name='file_expiring'),
        ),
    ]
