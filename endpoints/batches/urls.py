"""`/v1/files*` and `/v1/batches*` (OpenAI's paths, no trailing slash)."""

from django.urls import path

from endpoints.batches import api

urlpatterns = [
    path("files", api.files, name="v1-files"),
    path("files/<str:file_id>", api.file_detail, name="v1-file"),
    path("files/<str:file_id>/content", api.file_content, name="v1-file-content"),
    path("batches", api.batches, name="v1-batches"),
    path("batches/<str:batch_id>", api.batch_detail, name="v1-batch"),
    path("batches/<str:batch_id>/cancel", api.batch_cancel, name="v1-batch-cancel"),
]
