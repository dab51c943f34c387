from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('endpoints', '0014_lora_adapters'),
    ]

    operations = [
        migrations.AddField(
            model_name='endpoint',
            name='unplaced_replicas',
            field=models.PositiveIntegerField(default=0),
        ),
    ]
