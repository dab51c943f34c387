# File.expires_at and Batch.output_expires_after_s (OpenAI's expires_after and output_expires_after): nullable, so
# the release before reads and writes rows as it did. Their index, file_expiring, is built CONCURRENTLY by 0012.

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('batches', '0010_batch_line_concurrency'),
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
    ]
