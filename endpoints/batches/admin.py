"""Batches and files in the Django admin, read-only: they change only through the API's services."""

from django.contrib import admin

from endpoints.batches.models import Batch, File


class ReadOnly(admin.ModelAdmin):
    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(Batch)
class BatchAdmin(ReadOnly):
    list_display = ["id", "organization", "endpoint", "status", "num_total", "num_completed", "num_failed", "created_at",
                    "expires_at"]
    list_filter = ["status"]
    search_fields = ["id", "organization__slug"]
    list_select_related = ["organization", "endpoint"]


@admin.register(File)
class FileAdmin(ReadOnly):
    list_display = ["id", "organization", "purpose", "filename", "bytes", "created_at", "deleted_at"]
    list_filter = ["purpose"]
    search_fields = ["id", "filename", "organization__slug"]
    list_select_related = ["organization"]
