"""`/v1/files*` and `/v1/batches*` (OpenAI's paths, no trailing slash); any other path under them (a trailing slash,
one part too many) is OpenAI's 404, `unknown_url`, as the gateway answers every other unknown `/v1` path."""

from django.urls import path, re_path

from endpoints.batches import api

urlpatterns = [
    path("files", api.files, name="v1-files"),
    path("files/<str:file_id>", api.file_detail, name="v1-file"),
    path("files/<str:file_id>/content", api.file_content, name="v1-file-content"),
    path("batches", api.batches, name="v1-batches"),
    path("batches/<str:batch_id>", api.batch_detail, name="v1-batch"),
    path("batches/<str:batch_id>/cancel", api.batch_cancel, name="v1-batch-cancel"),
    # NOTE: last. Django's 404 page was HTML, where an OpenAI client reads `{"error": ...}`.
    re_path(r"^.*$", api.unknown_url, name="v1-unknown-url"),
]
