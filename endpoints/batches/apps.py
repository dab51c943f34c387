from django.apps import AppConfig


class BatchesConfig(AppConfig):
    """Files and batches: metadata in PostgreSQL, bytes in S3."""

    name = "endpoints.batches"
    label = "batches"
    verbose_name = "Batches"
    default_auto_field = "django.db.models.BigAutoField"
