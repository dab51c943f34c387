"""Database defaults for the NOT NULL columns earlier migrations added without one: each is what its migration gave the
rows before it. A rolling deploy runs the migrations while code from before them still writes rows with the columns
it knows (README, *A rolling deploy*); its INSERT was refused (NotNullViolation), and is now given the default. Only
`ALTER COLUMN ... SET DEFAULT`: no table is rewritten (`tests/test_rolling_deploy_schema.py`). Each still takes its
table's ACCESS EXCLUSIVE lock, and waits for it behind any open transaction on the table, every later read of the
table waiting behind it: `manage.py migrate` waits at most its lock timeout (2 s) for a lock, then gives up and tries
again (`controlplane/management/commands/migrate.py`, `tests/test_migrate_lock_timeout.py`)."""

import django.contrib.postgres.fields
import django.core.validators
from decimal import Decimal
from django.db import migrations, models


class Migration(migrations.Migration):
    # NOTE: each ALTER in its own transaction: a table's lock (ACCESS EXCLUSIVE, held for the catalogue change once
    # had) is not held while the next table's is waited for. Run again after a failure part way (a lock not had within
    # migrate's lock timeout), it sets the same defaults.
    atomic = False

    dependencies = [
        ('endpoints', '0026_prompt_factor'),
    ]

    operations = [
        migrations.AlterField(
            model_name='endpoint',
            name='allow_gpu_sharing',
            field=models.BooleanField(db_default=False, default=False),
        ),
        migrations.AlterField(
            model_name='endpoint',
            name='batch_price_fraction',
            field=models.DecimalField(db_default=Decimal('0.5'), decimal_places=3, default=Decimal('0.5'), max_digits=4, validators=[django.core.validators.MinValueValidator(Decimal('0')), django.core.validators.MaxValueValidator(Decimal('1'))]),
        ),
        migrations.AlterField(
            model_name='endpoint',
            name='draft_model_source',
            field=models.CharField(blank=True, db_default='', default='', max_length=500),
        ),
        migrations.AlterField(
            model_name='endpoint',
            name='engine_generation',
            field=models.PositiveIntegerField(db_default=0, default=0, editable=False),
        ),
        migrations.AlterField(
            model_name='endpoint',
            name='gpus_per_replica',
            field=models.PositiveSmallIntegerField(choices=[(1, '1'), (2, '2'), (4, '4'), (8, '8')], db_default=1, default=1),
        ),
        migrations.AlterField(
            model_name='endpoint',
            name='idle_action',
            field=models.CharField(choices=[('stop', 'Stop'), ('sleep', 'Sleep')], db_default='stop', default='stop', max_length=8),
        ),
        migrations.AlterField(
            model_name='endpoint',
            name='keep_warm_after_cold_start_s',
            field=models.PositiveIntegerField(db_default=0, default=0),
        ),
        migrations.AlterField(
            model_name='endpoint',
            name='last_failure_reason',
            field=models.CharField(blank=True, db_default='', default='', max_length=300),
        ),
        migrations.AlterField(
            model_name='endpoint',
            name='max_lora_rank',
            field=models.PositiveSmallIntegerField(db_default=16, default=16),
        ),
        migrations.AlterField(
            model_name='endpoint',
            name='max_loras',
            field=models.PositiveSmallIntegerField(db_default=0, default=0),
        ),
        migrations.AlterField(
            model_name='endpoint',
            name='num_identical_failures',
            field=models.PositiveIntegerField(db_default=0, default=0),
        ),
        migrations.AlterField(
            model_name='endpoint',
            name='num_speculative_tokens',
            field=models.PositiveSmallIntegerField(db_default=4, default=4),
        ),
        migrations.AlterField(
            model_name='endpoint',
            name='prewarm_windows',
            field=models.JSONField(blank=True, db_default=[], default=list),
        ),
        migrations.AlterField(
            model_name='endpoint',
            name='prompt_lookup_max',
            field=models.PositiveSmallIntegerField(db_default=4, default=4),
        ),
        migrations.AlterField(
            model_name='endpoint',
            name='prompt_lookup_min',
            field=models.PositiveSmallIntegerField(db_default=2, default=2),
        ),
        migrations.AlterField(
            model_name='endpoint',
            name='speculative_method',
            field=models.CharField(choices=[('none', 'none'), ('ngram', 'ngram'), ('draft', 'draft')], db_default='none', default='none', max_length=16),
        ),
        migrations.AlterField(
            model_name='endpoint',
            name='task',
            field=models.CharField(choices=[('auto', 'auto'), ('generate', 'generate'), ('embed', 'embed')], db_default='auto', default='auto', max_length=16),
        ),
        migrations.AlterField(
            model_name='endpoint',
            name='tool_call_parser',
            field=models.CharField(blank=True, db_default='', default='', max_length=32),
        ),
        migrations.AlterField(
            model_name='endpoint',
            name='unplaced_replicas',
            field=models.PositiveIntegerField(db_default=0, default=0),
        ),
        migrations.AlterField(
            model_name='endpoint',
            name='waiting_for_capacity',
            field=models.BooleanField(db_default=False, default=False),
        ),
        migrations.AlterField(
            model_name='modelfacts',
            name='disputed',
            field=models.JSONField(blank=True, db_default={}, default=dict),
        ),
        migrations.AlterField(
            model_name='modelfacts',
            name='scope',
            field=models.CharField(blank=True, db_default='', default='', max_length=40),
        ),
        migrations.AlterField(
            model_name='replica',
            name='adapters',
            field=django.contrib.postgres.fields.ArrayField(base_field=models.CharField(max_length=63), blank=True, db_default=[], default=list, size=None),
        ),
        migrations.AlterField(
            model_name='replica',
            name='engine_generation',
            field=models.PositiveIntegerField(db_default=0, default=0, editable=False),
        ),
        migrations.AlterField(
            model_name='replica',
            name='gpu_indices',
            field=django.contrib.postgres.fields.ArrayField(base_field=models.PositiveSmallIntegerField(), blank=True, db_default=[], default=list, size=None),
        ),
        migrations.AlterField(
            model_name='replica',
            name='num_prefix_cache_hits',
            field=models.PositiveBigIntegerField(db_default=0, default=0),
        ),
        migrations.AlterField(
            model_name='replica',
            name='num_prefix_cache_queries',
            field=models.PositiveBigIntegerField(db_default=0, default=0),
        ),
    ]
