"""Adapter prices became staff's to set (the admin); until now only tenants could set them, through the
API, so every price on record is a tenant's: cleared, the adapter's calls are priced as its endpoint's."""

from django.db import migrations


def clear_tenant_prices(apps, schema_editor):
    Adapter = apps.get_model("endpoints", "Adapter")
    Adapter.objects.filter(price_input_per_million__isnull=False).update(price_input_per_million=None)
    Adapter.objects.filter(price_output_per_million__isnull=False).update(price_output_per_million=None)


class Migration(migrations.Migration):
    dependencies = [("endpoints", "0016_sleep_mode")]

    operations = [migrations.RunPython(clear_tenant_prices, migrations.RunPython.noop)]
