"""Batches and files in the Django admin, read-only: they change only through the API's services."""

from django.contrib import admin

from controlplane.accounts.admin import ReadOnlyAdmin
from endpoints.batches.models import Batch, File


@admin.register(Batch)
class BatchAdmin(ReadOnlyAdmin):
    list_display = ["id", "organization", "endpoint", "status", "num_total", "num_completed", "num_failed", "created_at",
                    "expires_at"]
    list_filter = ["status"]
    search_fields = ["id", "organization__slug"]
    list_select_related = ["organization", "endpoint"]


@admin.register(File)
class FileAdmin(ReadOnlyAdmin):
    list_display = ["id", "organization", "purpose", "filename", "bytes", "created_at", "deleted_at"]
    list_filter = ["purpose"]
    search_fields = ["id", "filename", "organization__slug"]
    list_select_related = ["organization"]
